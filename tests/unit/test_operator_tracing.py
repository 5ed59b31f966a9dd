"""The operator's pass records become spans: a rollout's passes share one trace under a ``rollout``
span whose ids come from the deployment's uid and generation (the SDK's in-memory exporter
stands in for the collector here; tests/integration/test_tracing_operator.py uses the real one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.operator.reconcile.passlog import PassRecord
from pdserve.operator.reconcile.steps import Event, Outcome
from pdserve.operator.reconcile.tracing import PassTracer, Rollout, _Ids
from pdserve.tracing.sdk import Tracing


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[PassTracer]:
    """The operator's tracer, its spans exported to ``exporter``."""
    ids = _Ids()
    provider = TracerProvider(id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield PassTracer(Tracing(provider.get_tracer("test"), provider), ids)
    provider.shutdown()


def a_pass(generation: int, progressing: bool | None, reason: str = "", uid: str = "u1") -> PassRecord:
    record = PassRecord("ns", "llama", full=True, uid=uid, generation=generation)
    with record.step("create_pods"):
        pass
    record.progressing, record.progress_reason = progressing, reason
    record.progressing_since = "2026-12-06T10:00:00Z" if progressing else ""
    return record


def spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_a_rollouts_passes_are_one_trace_under_its_rollout_span(
    tracer: PassTracer, exporter: InMemorySpanExporter
) -> None:
    tracer.finished(
        a_pass(2, True, "RollingOut"), Outcome("ok", events=[Event("Normal", "Created", "pod x")])
    )
    tracer.finished(a_pass(2, True, "RollingOut"), Outcome("ok"))
    assert spans(exporter, "rollout") == []  # exported when it ends
    tracer.finished(a_pass(2, False, "Complete"), Outcome("ok"))
    (rollout,) = spans(exporter, "rollout")
    passes = spans(exporter, "reconcile")
    expected = Rollout("u1", 2, 0)
    assert rollout.context is not None and rollout.parent is None
    assert (rollout.context.trace_id, rollout.context.span_id) == (expected.trace_id, expected.span_id)
    assert rollout.attributes is not None and rollout.attributes["pdserve.rollout.outcome"] == "Complete"
    assert rollout.start_time == 1796551200 * 10**9  # the Progressing condition's lastTransitionTime
    assert len(passes) == 3
    for span in passes:
        assert span.context is not None and span.context.trace_id == expected.trace_id
        assert span.parent is not None and span.parent.span_id == expected.span_id
    assert [e.name for e in passes[0].events] == ["Created"]
    steps = spans(exporter, "create_pods")
    assert {s.parent.span_id for s in steps if s.parent} == {p.context.span_id for p in passes if p.context}


def test_a_settled_deployments_passes_are_traces_of_their_own(
    tracer: PassTracer, exporter: InMemorySpanExporter
) -> None:
    tracer.finished(a_pass(3, False, "Complete"), Outcome("ok"))
    tracer.finished(a_pass(3, False, "Complete"), Outcome("ok"))
    first, second = spans(exporter, "reconcile")
    assert first.parent is None and second.parent is None
    assert first.context and second.context and first.context.trace_id != second.context.trace_id
    assert spans(exporter, "rollout") == []


def test_a_new_generation_supersedes_a_running_rollout_and_a_deletion_ends_one(
    tracer: PassTracer, exporter: InMemorySpanExporter
) -> None:
    tracer.finished(a_pass(4, True, "RollingOut"), Outcome("ok"))
    tracer.finished(a_pass(5, True, "RollingOut"), Outcome("ok"))
    tracer.finished(PassRecord("ns", "llama", full=True), Outcome("gone"))
    outcomes = {
        s.attributes["pdserve.generation"]: s.attributes["pdserve.rollout.outcome"]
        for s in spans(exporter, "rollout")
        if s.attributes
    }
    assert outcomes == {4: "superseded", 5: "deleted"}


def test_an_operator_that_restarts_mid_rollout_continues_its_trace(
    tracer: PassTracer, exporter: InMemorySpanExporter
) -> None:
    """The ids come from uid and generation, not from memory: a new process joins the same trace."""
    tracer.finished(a_pass(6, True, "RollingOut", uid="u2"), Outcome("ok"))
    tracer._rollouts.clear()  # a restarted operator remembers nothing
    tracer.finished(a_pass(6, True, "RollingOut", uid="u2"), Outcome("ok"))
    first, second = spans(exporter, "reconcile")
    assert first.context and second.context and first.context.trace_id == second.context.trace_id
