"""The operator's reconcile passes as spans (``pdserve operator --otlp-traces-endpoint``).

Loaded only then. Each pass is a ``reconcile`` span (namespace, deployment, generation, full or
light, result, whether the routing table was written, the Events it posted as span events) with
a child per step (``read``, ``autoscale``, ``drain``, ``routing_table``, ``delete_pods``,
``create_pods``, ``apply_objects``, ``status``), made from the pass's
:class:`~pdserve.operator.reconcile.passlog.PassRecord` once it is over.

A rollout reads as one trace: while a PDDeployment's ``Progressing`` condition is True, its
passes are children of a ``rollout`` span whose trace and span ids are derived from the
deployment's uid and generation, so every pass of one rollout lands in one trace even across an
operator restart or a change of leader. The ``rollout`` span itself is exported when the rollout
ends (Progressing turns False: Complete, or InvalidSpec; or a new generation supersedes it, or
the deployment is deleted), from the condition's lastTransitionTime (or the first pass this
process saw) to then. Passes of a settled deployment are traces of their own.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from pdserve import __version__
from pdserve.operator.reconcile.passlog import PassRecord
from pdserve.operator.reconcile.steps import Outcome
from pdserve.tracing.endpoint import parse_endpoint
from pdserve.tracing.sdk import Tracing, start_tracing

SCOPE = "pdserve.operator"
SERVICE = "pdserve-operator"


class _Ids(RandomIdGenerator):
    """Random ids, except the next root span's when :meth:`force` says (this thread only)."""

    def __init__(self) -> None:
        self._forced = threading.local()

    def force(self, trace_id: int, span_id: int) -> None:
        self._forced.ids = (trace_id, span_id)

    def generate_trace_id(self) -> int:
        forced = getattr(self._forced, "ids", None)
        return forced[0] if forced else super().generate_trace_id()

    def generate_span_id(self) -> int:
        forced = getattr(self._forced, "ids", None)
        if forced:
            self._forced.ids = None
            return int(forced[1])
        return super().generate_span_id()


@dataclass(frozen=True)
class Rollout:
    """A rollout this process has seen passes of: its ids and since when it runs."""

    uid: str
    generation: int
    started_ns: int

    @property
    def trace_id(self) -> int:
        return _hash(f"{self.uid}/{self.generation}", 16)

    @property
    def span_id(self) -> int:
        return _hash(f"{self.uid}/{self.generation}/rollout", 8)


def _hash(text: str, size: int) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:size], "big") or 1


class PassTracer:
    def __init__(self, tracing: Tracing, ids: _Ids) -> None:
        self._tracing = tracing
        self._tracer = tracing.tracer
        self._ids = ids
        self._rollouts: dict[tuple[str, str], Rollout] = {}
        self._lock = threading.Lock()

    @classmethod
    def start(cls, endpoint: str) -> PassTracer:
        ids = _Ids()
        version = {"service.version": __version__}
        return cls(
            start_tracing(SCOPE, parse_endpoint(endpoint), SERVICE, attributes=version, id_generator=ids), ids
        )

    def shutdown(self) -> None:
        self._tracing.shutdown()

    def finished(self, record: PassRecord, outcome: Outcome) -> None:
        """The spans of a pass that is over (and of the rollout it ended, if it did)."""
        key = (record.namespace, record.name)
        gone = outcome.result == "gone"
        earlier: list[tuple[Rollout, str]] = []  # rollouts that ended before this pass
        with self._lock:
            rollout = self._rollouts.get(key)
            if rollout is not None and (
                gone or (rollout.uid, rollout.generation) != (record.uid, record.generation)
            ):
                earlier.append((self._rollouts.pop(key), "deleted" if gone else "superseded"))
                rollout = None
            if rollout is None and record.progressing:
                since = _unix_ns(record.progressing_since) or record.started_ns
                rollout = self._rollouts[key] = Rollout(record.uid, record.generation, since)
            done = rollout is not None and record.progressing is False
            if done:
                del self._rollouts[key]
        for old, why in earlier:
            self._end_rollout(old, record, why)
        self._pass_spans(record, outcome, rollout)
        if done and rollout is not None:
            self._end_rollout(rollout, record, record.progress_reason or "Complete")

    def _pass_spans(self, record: PassRecord, outcome: Outcome, rollout: Rollout | None) -> None:
        parent = None
        if rollout is not None:
            remote = SpanContext(rollout.trace_id, rollout.span_id, True, TraceFlags(TraceFlags.SAMPLED))
            parent = otel.set_span_in_context(NonRecordingSpan(remote))
        attributes: dict[str, Any] = {
            "k8s.namespace.name": record.namespace,
            "pdserve.deployment": record.name,
            "pdserve.generation": record.generation,
            "pdserve.pass": "full" if record.full else "light",
            "pdserve.result": outcome.result,
            "pdserve.routing_written": outcome.routing_written,
        }
        if record.progress_reason:
            attributes["pdserve.progressing"] = record.progress_reason
        span = self._tracer.start_span(
            "reconcile", parent, SpanKind.INTERNAL, attributes, start_time=record.started_ns
        )
        for event in outcome.events:
            span.add_event(event.reason, {"type": event.type, "message": event.message})
        if outcome.result == "error":
            span.set_status(Status(StatusCode.ERROR, "reconcile failed"))
        context = otel.set_span_in_context(span)
        for step in record.steps:
            self._tracer.start_span(step.name, context, start_time=step.start_ns).end(step.end_ns)
        span.end()

    def _end_rollout(self, rollout: Rollout, record: PassRecord, outcome: str) -> None:
        self._ids.force(rollout.trace_id, rollout.span_id)
        span = self._tracer.start_span(
            "rollout",
            None,
            SpanKind.INTERNAL,
            {
                "k8s.namespace.name": record.namespace,
                "pdserve.deployment": record.name,
                "pdserve.generation": rollout.generation,
                "pdserve.rollout.outcome": outcome,
            },
            start_time=rollout.started_ns,
        )
        if outcome not in ("Complete", "superseded", "deleted"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(time.time_ns())


def _unix_ns(rfc3339: str) -> int | None:
    if not rfc3339:
        return None
    try:
        return int(datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() * 1e9)
    except ValueError:
        return None
