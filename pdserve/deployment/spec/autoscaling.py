"""``spec.autoscaling``: one autoscaler for the prefill/decode pair, driven by latency objectives.

Names follow the HorizontalPodAutoscaler v2 where it has one (``minInstances``/``maxInstances``
for ``minReplicas``/``maxReplicas``, ``behavior.scaleUp``/``scaleDown`` with
``stabilizationWindowSeconds``, ``selectPolicy``, ``policies`` of type ``Instances`` or
``Percent`` per ``periodSeconds``, and ``tolerance``), with HPA's defaults. What the planner does
with them is :mod:`pdserve.deployment.plan.autoscale`'s.

The parser refuses what cannot hold, as the CRD's CEL rules do, and more exactly where CEL cannot
(the ratio bounds against whole instance counts): a ``prefillPerDecode`` range that no pair of
counts within the roles' bounds meets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.deployment.spec.readers import SpecError
from pdserve.deployment.spec.readers import no_unknown as _no_unknown
from pdserve.deployment.spec.readers import read_choice as _choice
from pdserve.deployment.spec.readers import read_integer as _integer
from pdserve.deployment.spec.readers import read_list as _list
from pdserve.deployment.spec.readers import read_object as _object
from pdserve.deployment.spec.readers import show as _show

# Defaults and bounds; equal to the CRD schema's (tests/unit/test_deployment_crd.py checks it).
MAX_INSTANCES = 1024
DEFAULT_MIN_INSTANCES = 1
DEFAULT_PERCENTILE = 90.0
MIN_PERCENTILE, MAX_PERCENTILE = 50.0, 99.9
MIN_TTFT_MS, MAX_TTFT_MS = 1.0, 600_000.0
MIN_ITL_MS, MAX_ITL_MS = 0.1, 60_000.0
DEFAULT_WINDOW_SECONDS = 60
MIN_WINDOW_SECONDS, MAX_WINDOW_SECONDS = 5, 600
DEFAULT_SYNC_PERIOD_SECONDS = 15
MIN_SYNC_PERIOD_SECONDS, MAX_SYNC_PERIOD_SECONDS = 1, 300
MIN_RATIO, MAX_RATIO = 0.01, 100.0
MAX_STABILIZATION_SECONDS = 3600
MAX_POLICY_PERIOD_SECONDS = 1800
MAX_POLICY_VALUE = 100_000
MAX_TOLERANCE = 1.0
DEFAULT_TOLERANCE = 0.1
POLICY_TYPES = ("Instances", "Percent")
SELECT_POLICIES = ("Max", "Min", "Disabled")
DEFAULT_SELECT_POLICY = "Max"


@dataclass(frozen=True)
class ScalingPolicy:
    """At most ``value`` instances (or ``value`` percent of them) added or removed per ``period_seconds``."""

    type: str  # "Instances" | "Percent"
    value: int
    period_seconds: int


@dataclass(frozen=True)
class ScalingRules:
    """One direction's behaviour, as HPA's ``HPAScalingRules``."""

    stabilization_window_seconds: int
    select_policy: str = DEFAULT_SELECT_POLICY  # "Max" | "Min" | "Disabled"
    policies: tuple[ScalingPolicy, ...] = ()
    tolerance: float = DEFAULT_TOLERANCE


#: HPA's defaults: up at once, by 100 % or 4 instances a 15 s (whichever is more); down after 300 s
#: of lower recommendations, by up to 100 % a 15 s.
DEFAULT_SCALE_UP = ScalingRules(
    0, "Max", (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Instances", 4, 15)), DEFAULT_TOLERANCE
)
DEFAULT_SCALE_DOWN = ScalingRules(300, "Max", (ScalingPolicy("Percent", 100, 15),), DEFAULT_TOLERANCE)


@dataclass(frozen=True)
class Behavior:
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN


@dataclass(frozen=True)
class InstanceBounds:
    min_instances: int
    max_instances: int

    def clamp(self, count: int) -> int:
        return min(max(count, self.min_instances), self.max_instances)


@dataclass(frozen=True)
class Objectives:
    """What the routers measure, per request: TTFT as the client sees it (request to first byte),
    ITL as the mean gap of the decode's stream. ``percentile`` percent of the requests of the
    last ``window_seconds`` must be within each."""

    ttft_milliseconds: float
    itl_milliseconds: float
    percentile: float = DEFAULT_PERCENTILE
    window_seconds: int = DEFAULT_WINDOW_SECONDS


@dataclass(frozen=True)
class RatioBounds:
    """Bounds on prefill instances / decode instances; None: unbounded on that side."""

    min: float | None = None
    max: float | None = None

    def holds(self, prefill: int, decode: int) -> bool:
        if decode <= 0:
            return False
        ratio = prefill / decode
        return (self.min is None or ratio >= self.min - 1e-9) and (
            self.max is None or ratio <= self.max + 1e-9
        )


@dataclass(frozen=True)
class AutoscalingSpec:
    prefill: InstanceBounds
    decode: InstanceBounds
    objectives: Objectives
    prefill_per_decode: RatioBounds = RatioBounds()
    behavior: Behavior = Behavior()
    sync_period_seconds: int = DEFAULT_SYNC_PERIOD_SECONDS

    def bounds(self, role: str) -> InstanceBounds:
        return self.prefill if role == "prefill" else self.decode


# --- parsing -------------------------------------------------------------------------------------


def parse_autoscaling(value: object, path: str) -> AutoscalingSpec | None:
    if value is None:
        return None
    doc = _object(value, path)
    _no_unknown(
        doc, path, ("prefill", "decode", "objectives", "prefillPerDecode", "behavior", "syncPeriodSeconds")
    )
    for role in ("prefill", "decode", "objectives"):
        if role not in doc:
            raise SpecError(f"{path}.{role}", "required when spec.autoscaling is set")
    spec = AutoscalingSpec(
        prefill=_bounds(doc["prefill"], f"{path}.prefill"),
        decode=_bounds(doc["decode"], f"{path}.decode"),
        objectives=_objectives(doc["objectives"], f"{path}.objectives"),
        prefill_per_decode=_ratio(doc.get("prefillPerDecode", {}), f"{path}.prefillPerDecode"),
        behavior=_behavior(doc.get("behavior", {}), f"{path}.behavior"),
        sync_period_seconds=_integer(
            doc,
            "syncPeriodSeconds",
            path,
            DEFAULT_SYNC_PERIOD_SECONDS,
            MIN_SYNC_PERIOD_SECONDS,
            MAX_SYNC_PERIOD_SECONDS,
        ),
    )
    if not feasible(spec):
        ratio = spec.prefill_per_decode
        raise SpecError(
            f"{path}.prefillPerDecode",
            f"no instance counts within prefill {spec.prefill.min_instances}-{spec.prefill.max_instances} "
            f"and decode {spec.decode.min_instances}-{spec.decode.max_instances} have a prefill/decode ratio "
            f"from {_bound(ratio.min)} to {_bound(ratio.max)}; widen the ratio or the instance bounds",
        )
    return spec


def _bound(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:g}"


def prefill_range(spec: AutoscalingSpec, decode: int) -> tuple[int, int]:
    """The prefill counts within bounds whose ratio to ``decode`` holds (empty when low > high)."""
    ratio = spec.prefill_per_decode
    low, high = spec.prefill.min_instances, spec.prefill.max_instances
    if ratio.min is not None:
        low = max(low, math.ceil(ratio.min * decode - 1e-9))
    if ratio.max is not None:
        high = min(high, math.floor(ratio.max * decode + 1e-9))
    return low, high


def feasible(spec: AutoscalingSpec) -> bool:
    """Whether some (prefill, decode) counts within the bounds meet the ratio bounds."""
    return any(
        low <= high
        for low, high in (
            prefill_range(spec, d) for d in range(spec.decode.min_instances, spec.decode.max_instances + 1)
        )
    )


def _bounds(value: object, path: str) -> InstanceBounds:
    doc = _object(value, path)
    _no_unknown(doc, path, ("minInstances", "maxInstances"))
    if "maxInstances" not in doc:
        raise SpecError(f"{path}.maxInstances", "required: the most instances the autoscaler may run")
    low = _integer(doc, "minInstances", path, DEFAULT_MIN_INSTANCES, 1, MAX_INSTANCES)
    high = _integer(doc, "maxInstances", path, 0, 1, MAX_INSTANCES)
    if low > high:
        raise SpecError(f"{path}.minInstances", f"must not exceed maxInstances ({high}), got {low}")
    return InstanceBounds(low, high)


def _number(
    doc: Mapping[str, object], key: str, path: str, default: float | None, low: float, high: float
) -> float:
    full = f"{path}.{key}"
    value = doc.get(key, default)
    if value is None:
        raise SpecError(full, "required")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(full, f"expected a number from {low:g} to {high:g}, got {_show(value)}")
    if not low <= value <= high:
        raise SpecError(full, f"expected a number from {low:g} to {high:g}, got {_show(value)}")
    return float(value)


def _objectives(value: object, path: str) -> Objectives:
    doc = _object(value, path)
    _no_unknown(doc, path, ("ttftMilliseconds", "itlMilliseconds", "percentile", "windowSeconds"))
    return Objectives(
        ttft_milliseconds=_number(doc, "ttftMilliseconds", path, None, MIN_TTFT_MS, MAX_TTFT_MS),
        itl_milliseconds=_number(doc, "itlMilliseconds", path, None, MIN_ITL_MS, MAX_ITL_MS),
        percentile=_number(doc, "percentile", path, DEFAULT_PERCENTILE, MIN_PERCENTILE, MAX_PERCENTILE),
        window_seconds=_integer(
            doc, "windowSeconds", path, DEFAULT_WINDOW_SECONDS, MIN_WINDOW_SECONDS, MAX_WINDOW_SECONDS
        ),
    )


def _ratio(value: object, path: str) -> RatioBounds:
    doc = _object(value, path)
    _no_unknown(doc, path, ("min", "max"))
    low = _number(doc, "min", path, None, MIN_RATIO, MAX_RATIO) if doc.get("min") is not None else None
    high = _number(doc, "max", path, None, MIN_RATIO, MAX_RATIO) if doc.get("max") is not None else None
    if low is not None and high is not None and low > high:
        raise SpecError(f"{path}.min", f"must not exceed max ({high:g}), got {low:g}")
    return RatioBounds(low, high)


def _behavior(value: object, path: str) -> Behavior:
    doc = _object(value, path)
    _no_unknown(doc, path, ("scaleUp", "scaleDown"))
    return Behavior(
        _rules(doc.get("scaleUp", {}), f"{path}.scaleUp", DEFAULT_SCALE_UP),
        _rules(doc.get("scaleDown", {}), f"{path}.scaleDown", DEFAULT_SCALE_DOWN),
    )


def _rules(value: object, path: str, default: ScalingRules) -> ScalingRules:
    doc = _object(value, path)
    _no_unknown(doc, path, ("stabilizationWindowSeconds", "selectPolicy", "policies", "tolerance"))
    policies = default.policies
    if "policies" in doc:
        items = _list(doc, "policies", path)
        if not items:
            raise SpecError(f"{path}.policies", "needs at least one policy (or leave it out for the default)")
        policies = tuple(_policy(item, f"{path}.policies[{i}]") for i, item in enumerate(items))
    return ScalingRules(
        stabilization_window_seconds=_integer(
            doc,
            "stabilizationWindowSeconds",
            path,
            default.stabilization_window_seconds,
            0,
            MAX_STABILIZATION_SECONDS,
        ),
        select_policy=_choice(doc, "selectPolicy", path, SELECT_POLICIES, DEFAULT_SELECT_POLICY),
        policies=policies,
        tolerance=_number(doc, "tolerance", path, DEFAULT_TOLERANCE, 0.0, MAX_TOLERANCE),
    )


def _policy(value: object, path: str) -> ScalingPolicy:
    doc = _object(value, path)
    _no_unknown(doc, path, ("type", "value", "periodSeconds"))
    for key in ("type", "value", "periodSeconds"):
        if key not in doc:
            raise SpecError(f"{path}.{key}", "required")
    return ScalingPolicy(
        type=_choice(doc, "type", path, POLICY_TYPES, "Instances"),
        value=_integer(doc, "value", path, 1, 1, MAX_POLICY_VALUE),
        period_seconds=_integer(doc, "periodSeconds", path, 15, 1, MAX_POLICY_PERIOD_SECONDS),
    )
