"""``spec.tracing``: where the router and the engines send their spans.

Parsed like every section (readers.py: each error names its field); what it renders is
render/tracing.py's. The endpoint follows pdserve's URL rules (pdserve.tracing.endpoint): the
scheme says the protocol, so one URL serves the router and the engines alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.deployment.spec.readers import SpecError, no_unknown, read_object, read_string, show
from pdserve.tracing.endpoint import EndpointError, OtlpEndpoint, parse_endpoint

#: vLLM 0.32's ``--collect-detailed-traces`` choices.
DETAILED_TRACE_MODULES = ("model", "worker", "all")
DEFAULT_SAMPLING_RATIO = 1.0


@dataclass(frozen=True)
class TracingSpec:
    """OpenTelemetry traces of the deployment's requests (and of nothing else)."""

    endpoint: str
    sampling_ratio: float = DEFAULT_SAMPLING_RATIO
    #: vLLM's ``--collect-detailed-traces`` (engine flags only; empty: not given).
    collect_detailed_traces: tuple[str, ...] = ()

    @property
    def otlp(self) -> OtlpEndpoint:
        return parse_endpoint(self.endpoint)


def with_endpoint(
    tracing: TracingSpec | None, endpoint: str, path: str = "--otlp-traces-endpoint"
) -> TracingSpec:
    """``tracing`` sending to ``endpoint`` instead (its ratio and detail kept; the defaults when
    it was absent); SpecError naming ``path`` for an endpoint that names no OTLP protocol."""
    try:
        parse_endpoint(endpoint)
    except EndpointError as exc:
        raise SpecError(path, str(exc)) from None
    if tracing is None:
        return TracingSpec(endpoint)
    return TracingSpec(endpoint, tracing.sampling_ratio, tracing.collect_detailed_traces)


def parse_tracing(value: object, path: str) -> TracingSpec | None:
    """``{endpoint, samplingRatio, collectDetailedTraces}``; None when the section is absent."""
    if value is None:
        return None
    doc = read_object(value, path)
    no_unknown(doc, path, ("endpoint", "samplingRatio", "collectDetailedTraces"))
    endpoint = read_string(doc, "endpoint", path, required=True)
    try:
        parse_endpoint(endpoint)
    except EndpointError as exc:
        raise SpecError(f"{path}.endpoint", str(exc)) from None
    return TracingSpec(endpoint, _ratio(doc, path), _modules(doc, path))


def _ratio(doc: Mapping[str, Any], path: str) -> float:
    value = doc.get("samplingRatio", DEFAULT_SAMPLING_RATIO)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise SpecError(f"{path}.samplingRatio", f"expected a number from 0 to 1, got {show(value)}")
    return float(value)


def _modules(doc: Mapping[str, Any], path: str) -> tuple[str, ...]:
    value = doc.get("collectDetailedTraces", [])
    where = f"{path}.collectDetailedTraces"
    if not isinstance(value, list):
        raise SpecError(where, f"expected a list of {', '.join(DETAILED_TRACE_MODULES)}, got {show(value)}")
    for i, item in enumerate(value):
        if item not in DETAILED_TRACE_MODULES:
            listed = ", ".join(f'"{m}"' for m in DETAILED_TRACE_MODULES)
            raise SpecError(f"{where}[{i}]", f"expected one of {listed}, got {show(item)}")
    if len(set(value)) != len(value):
        raise SpecError(where, "each module once")
    return tuple(value)
