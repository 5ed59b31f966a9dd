"""The spans of a request, when the router traces (``--otlp-traces-endpoint``).

Loaded only then (pdserve.proxy.app): without an endpoint no module of OpenTelemetry is
imported, and a request carries ``spans = None`` through the flow, so the hot path does no span
or context work at all. One request is one trace (continuing the client's ``traceparent``)::

    POST /v1/completions  SERVER    the request: status, outcome, attempts, slots; event first_token
      admission           INTERNAL  only when it waited in the admission queue
      route               INTERNAL  per attempt: policy, table generation, the slots chosen
      prefill             CLIENT    per prefill leg: slot, rank, attempt, retry reason, outcome
      kv_handoff          INTERNAL  from the prefill's answer to the decode's first byte
      decode              CLIENT    per decode leg, until the stream's end

Each leg sends its own span's ``traceparent`` (and the client's ``tracestate``) to its engine,
so vLLM's ``llm_request`` span is the child of the leg that caused it. A request the sampler
leaves out gets no child spans; its legs still send the request's context, marked not sampled,
so the engines leave it out too. Spans carry explicit timestamps and parents: no context
variables are set or read.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve import __version__
from pdserve.proxy.settings import TracingSettings
from pdserve.routing import Slot
from pdserve.tracing.context import TRACEPARENT, TRACESTATE, traceparent
from pdserve.tracing.sdk import Tracing, start_tracing

#: The instrumentation scope of the router's spans.
SCOPE = "pdserve.proxy"
#: ``service.name`` unless OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES) names the service.
SERVICE = "pdserve-router"
#: Leg outcomes that are not failures of the leg.
_FINE = frozenset({"ok", "streaming", "cancelled"})


class RequestTracer:
    """Starts the spans of each request; one per router process (each worker has its own)."""

    def __init__(self, tracing: Tracing, policy: str, prefill_policy: str | None = None) -> None:
        self._tracing = tracing
        self._tracer = tracing.tracer
        self._propagator = TraceContextTextMapPropagator()
        self.policies: dict[str, Any] = {"pdserve.policy": policy}
        if prefill_policy is not None:
            self.policies["pdserve.prefill_policy"] = prefill_policy

    @classmethod
    def start(
        cls, settings: TracingSettings, policy: str, prefill_policy: str | None = None
    ) -> RequestTracer:
        endpoint = settings.otlp
        assert endpoint is not None
        version = {"service.version": __version__}
        tracing = start_tracing(SCOPE, endpoint, SERVICE, settings.sampling_ratio, version)
        return cls(tracing, policy, prefill_policy)

    def shutdown(self) -> None:
        self._tracing.shutdown()

    def request(
        self, method: str, path: str, request_id: str, parent: str | None, state: str | None
    ) -> RequestSpans:
        """The server span of a request, a child of the client's ``parent`` traceparent if any."""
        context = None
        if parent is not None:
            carrier = {TRACEPARENT: parent} if state is None else {TRACEPARENT: parent, TRACESTATE: state}
            context = self._propagator.extract(carrier)
        span = self._tracer.start_span(
            f"{method} {path}",
            context,
            SpanKind.SERVER,
            {"http.request.method": method, "url.path": path, "pdserve.request_id": request_id},
        )
        return RequestSpans(self, span, state)


class RequestSpans:
    """The spans of one request (shared by its parts); ``recording``: sampled, children are made."""

    def __init__(self, owner: RequestTracer, span: Span, state: str | None) -> None:
        self._tracer = owner._tracer
        self.policies = owner.policies
        self.span = span
        self.recording = span.is_recording()
        ctx = span.get_span_context()
        #: The trace the request's spans go to; None when the sampler left it out (no trace exists).
        self.trace_id = f"{ctx.trace_id:032x}" if self.recording else None
        self._flags = int(ctx.trace_flags)
        self._traceparent = traceparent(ctx.trace_id, ctx.span_id, self._flags)
        self._parent = otel.set_span_in_context(span) if self.recording else None  # children's parent
        self.tracestate = state  # the client's, passed on unchanged

    # --- what the legs send ---------------------------------------------------------------------

    def inject(self, headers: dict[str, str], leg: Span | None) -> None:
        """The leg's context (the request's when the leg has no span) into its headers."""
        if leg is None:
            headers[TRACEPARENT] = self._traceparent
        else:
            ctx = leg.get_span_context()
            headers[TRACEPARENT] = traceparent(ctx.trace_id, ctx.span_id, self._flags)
        if self.tracestate:
            headers[TRACESTATE] = self.tracestate

    # --- children -------------------------------------------------------------------------------

    def _child(
        self,
        name: str,
        attributes: Mapping[str, Any],
        kind: SpanKind = SpanKind.INTERNAL,
        start: int | None = None,
    ) -> Span:
        return self._tracer.start_span(name, self._parent, kind, attributes, start_time=start)

    def admission(self, started_ns: int, shed: str | None) -> None:
        """The wait in the admission queue (back-pressure), and whether it ended in a 429."""
        if not self.recording:
            return
        span = self._child("admission", {"pdserve.admission.outcome": shed or "admitted"}, start=started_ns)
        if shed is not None:
            span.set_status(Status(StatusCode.ERROR, shed))
        span.end()

    def route(
        self,
        started_ns: int,
        attempt: int,
        generation: int,
        chosen: tuple[Slot, Slot] | None,
        reused_handoff: bool,
        part: int | None,
    ) -> None:
        """The routing decision of one attempt: the slots chosen, or none (the 503 that follows)."""
        if not self.recording:
            return
        attributes: dict[str, Any] = {
            **self.policies,
            "pdserve.table.generation": generation,
            "pdserve.attempt": attempt,
        }
        if part is not None:
            attributes["pdserve.part"] = part
        if chosen is not None:
            prefill, decode = chosen
            attributes["pdserve.prefill.slot"] = prefill.key
            attributes["pdserve.decode.slot"] = decode.key
            attributes["pdserve.kv.handoff_reused"] = reused_handoff
        span = self._child("route", attributes, start=started_ns)
        if chosen is None:
            span.set_status(Status(StatusCode.ERROR, "no slot"))
        span.end()

    def leg(
        self, role: str, slot: Slot, request_id: str, attempt: int, retry: str | None, part: int | None
    ) -> Span | None:
        """A prefill or decode leg, sent now."""
        if not self.recording:
            return None
        attributes: dict[str, Any] = {
            "pdserve.slot": slot.key,
            "pdserve.instance": slot.instance.name,
            "pdserve.dp_rank": slot.dp_rank,
            "pdserve.attempt": attempt,
            "pdserve.engine_request_id": request_id,
            "server.address": slot.url,
        }
        if retry is not None:
            attributes["pdserve.retry_reason"] = retry
        if part is not None:
            attributes["pdserve.part"] = part
        return self._child(role, attributes, SpanKind.CLIENT)

    def kv_handoff(
        self, prefill: Slot, decode: Slot, params: Mapping[str, Any] | None, reused: bool
    ) -> Span | None:
        """The KV handoff: from the prefill's answer (now) until the decode's first byte, the
        time the decode takes to pull the KV and compute its first token."""
        if not self.recording:
            return None
        attributes: dict[str, Any] = {
            "pdserve.prefill.slot": prefill.key,
            "pdserve.decode.slot": decode.key,
            "pdserve.kv.handoff_reused": reused,
        }
        if params is not None:
            for key in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id"):
                value = params.get(key)
                if isinstance(value, str | int) and not isinstance(value, bool):
                    attributes[f"pdserve.kv.{key}"] = value
            blocks = params.get("remote_block_ids")
            if isinstance(blocks, list):
                attributes["pdserve.kv.blocks"] = len(blocks)
        return self._child("kv_handoff", attributes)

    def first_token(self, handoff: Span | None, part: int | None) -> None:
        """The decode's first byte: the handoff is over, the client gets its first token."""
        if not self.recording:
            return
        if handoff is not None:
            handoff.end()
        self.span.add_event("first_token", {"pdserve.part": part} if part is not None else None)

    # --- ends -----------------------------------------------------------------------------------

    @staticmethod
    def end_leg(span: Span | None, outcome: str, status: int | None = None) -> None:
        """A leg's end; its outcome is the ``upstream_requests_total`` label."""
        if span is None:
            return
        span.set_attribute("pdserve.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if outcome not in _FINE:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()

    @staticmethod
    def end_handoff(span: Span | None, outcome: str) -> None:
        """A handoff whose decode failed before its first byte."""
        if span is None:
            return
        if span.is_recording():
            span.set_status(Status(StatusCode.ERROR, f"decode {outcome}"))
            span.end()

    def end(self, status: int, outcome: str, attributes: Mapping[str, Any]) -> None:
        """The request's end (its one log line): status, outcome and what the flow tells."""
        span = self.span
        if self.recording:
            span.set_attribute("http.response.status_code", status)
            span.set_attribute("pdserve.outcome", outcome)
            span.set_attributes(attributes)
            if status >= 500 or outcome in ("stream_error", "proxy_error"):
                span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


def now_ns() -> int:
    """The span clock (wall time in ns, as the SDK's)."""
    return time.time_ns()
