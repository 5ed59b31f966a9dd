"""Around the autoscaler's decision (pure): where the counts stand, what each role runs, and what
the status says.

Who owns the count: with ``spec.autoscaling`` the autoscaler does, and keeps it in
``status.autoscaling.<role>.desiredInstances``; ``spec.<role>.instances`` is where it starts.
``status.autoscaling.<role>.startedFrom`` remembers that start, so applying the same manifest
again (same ``instances``) changes nothing, and a changed ``instances`` (``kubectl apply`` of a
new value, ``kubectl scale``) is taken as a new start. The status is the operator's own (the
status subresource): nothing a client applies reaches it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.deployment.plan.autoscale import ROLES, Decision, Limit, RoleState
from pdserve.deployment.plan.rollout import ObservedPod
from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.spec.autoscaling import AutoscalingSpec
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.routing import Role

_INSUFFICIENT = re.compile(r"Insufficient ([-._a-zA-Z0-9/]+)")


@dataclass(frozen=True)
class Counts:
    """Each role's count as the autoscaler holds it, and the spec value it started from."""

    desired: Mapping[str, int]
    started_from: Mapping[str, int]


def stored_counts(pdd: PDDeployment, status: Mapping[str, Any] | None) -> Counts:
    """The counts to run now: the stored ones (within the bounds as they stand), or the spec's
    instances where there are none or the spec's value moved since they started from it."""
    spec = pdd.spec.autoscaling
    assert spec is not None
    stored = (status or {}).get("autoscaling") or {}
    desired: dict[str, int] = {}
    started: dict[str, int] = {}
    for role in ROLES:
        instances = pdd.spec.role(Role(role)).instances
        row = stored.get(role) if isinstance(stored, Mapping) else None
        row = row if isinstance(row, Mapping) else {}
        count, start = row.get("desiredInstances"), row.get("startedFrom")
        if isinstance(count, int) and not isinstance(count, bool) and start == instances:
            desired[role] = spec.bounds(role).clamp(count)
        else:
            desired[role] = spec.bounds(role).clamp(instances)
        started[role] = instances
    return Counts(desired, started)


def with_counts(pdd: PDDeployment, counts: Mapping[str, int]) -> PDDeployment:
    """The deployment as the operator renders and plans it: each role at the autoscaler's count."""
    spec = pdd.spec
    return replace(
        pdd,
        spec=replace(
            spec,
            prefill=replace(spec.prefill, instances=counts["prefill"]),
            decode=replace(spec.decode, instances=counts["decode"]),
        ),
    )


def role_state(
    desired: int,
    units: Sequence[ObservedPod],
    data_parallel: int,
    now: float,
    startup_timeout: float,
    unschedulable_messages: Sequence[str] = (),
) -> RoleState:
    """What one role runs: ready instances and their slots, those still starting (wanted, not
    Ready, not draining, younger than the startup timeout: older ones are broken, not starting),
    and those the scheduler cannot place, with what it says is missing."""
    live = [u for u in units if not u.terminating]
    ready = [u for u in live if u.routable]
    starting = [
        u
        for u in live
        if not u.ready and not u.draining and u.index < desired and now - u.created < startup_timeout
    ]
    unschedulable = [u for u in live if u.unschedulable and not u.draining]
    return RoleState(
        desired=desired,
        ready=len(ready),
        starting=len(starting),
        unschedulable=len(unschedulable),
        slots=sum(data_parallel if u.dp_size is None else u.dp_size for u in ready),
        unschedulable_reason=missing_resource(unschedulable_messages) if unschedulable else "",
    )


def missing_resource(messages: Sequence[str]) -> str:
    """``Insufficient nvidia.com/gpu`` from the scheduler's messages, else its first message."""
    for message in messages:
        found = _INSUFFICIENT.search(message)
        if found:
            return f"Insufficient {found.group(1).rstrip('.')}"
    return messages[0] if messages else ""


def autoscaling_status(
    spec: AutoscalingSpec,
    counts: Counts,
    decision: Decision | None,
    signals: Signals | None,
    previous: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """``status.autoscaling``: the counts, and the last decision's figures and reason (carried
    over from ``previous`` between decisions)."""
    previous = previous or {}
    out: dict[str, Any] = {
        role: {"desiredInstances": counts.desired[role], "startedFrom": counts.started_from[role]}
        for role in ROLES
    }
    if decision is None:
        for key in ("lastScaleTime", "lastDecisionTime", "reason", "measured", "summary"):
            if key in previous:
                out[key] = previous[key]
        for role in ROLES:
            ratio = (previous.get(role) or {}).get("objectiveRatio")
            if ratio is not None:
                out[role]["objectiveRatio"] = ratio
        return out
    for role in ROLES:
        ratio = decision.role(role).ratio
        if ratio is not None:
            out[role]["objectiveRatio"] = round(ratio, 3)
    out["lastDecisionTime"] = now
    if decision.changed:
        out["lastScaleTime"] = now
    elif "lastScaleTime" in previous:
        out["lastScaleTime"] = previous["lastScaleTime"]
    out["reason"] = decision.reason
    out["measured"] = measured_status(spec, decision, signals)
    out["summary"] = summary(spec, decision)
    return out


def measured_status(spec: AutoscalingSpec, decision: Decision, signals: Signals | None) -> dict[str, Any]:
    out: dict[str, Any] = {"windowSeconds": spec.objectives.window_seconds}
    for key, value in (
        ("ttftMilliseconds", decision.measured["ttft_ms"]),
        ("itlMilliseconds", decision.measured["itl_ms"]),
    ):
        if value is not None:
            out[key] = round(value, 1)
    if signals is None or not signals.known:
        return out
    out |= {
        "requests": signals.requests,
        "failedRequests": signals.failed,
        "requestsPerSecond": round(signals.rate, 3),
        "prefillInFlight": signals.in_flight.get("prefill", 0),
        "decodeInFlight": signals.in_flight.get("decode", 0),
        "queued": signals.queued,
        "prefillWaiting": signals.waiting.get("prefill", 0),
        "decodeWaiting": signals.waiting.get("decode", 0),
    }
    usage = signals.kv_usage.get("decode")
    if usage is not None:
        out["decodeKvCacheUsage"] = round(usage, 3)
    return out


def summary(spec: AutoscalingSpec, decision: Decision) -> str:
    """``TTFT 1.2s/2s ITL 31ms/50ms`` with ``?`` for what was not measured."""
    o = spec.objectives

    def show(ms: float | None, target: float) -> str:
        return f"{_short(ms)}/{_short(target)}"

    ttft = show(decision.measured["ttft_ms"], o.ttft_milliseconds)
    return f"TTFT {ttft} ITL {show(decision.measured['itl_ms'], o.itl_milliseconds)}"


def limits_condition(limits: Sequence[Limit]) -> tuple[bool, str, str]:
    """Condition ScalingLimited as HPA's: True with the first limit's reason and every message,
    False (DesiredWithinRange) when nothing held the counts back."""
    if not limits:
        return False, "DesiredWithinRange", "the desired counts are within the bounds and can be placed"
    return True, limits[0].reason, "; ".join(x.message for x in limits)


def _short(ms: float | None) -> str:
    if ms is None:
        return "?"
    if ms >= 1000:
        return f"{ms / 1000:.3g}s"
    return f"{ms:.3g}ms"
