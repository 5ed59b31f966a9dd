"""The router's request spans without the network: what each child carries, the unsampled path,
and the context each leg sends (the SDK's in-memory exporter stands in for the collector;
tests/integration/test_tracing.py runs the real thing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve.proxy.flow.spans import RequestTracer, now_ns
from pdserve.routing import Instance, Slot
from pdserve.tracing.context import trace_id_of
from pdserve.tracing.sdk import Tracing

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


def tracer_of(ratio: float) -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampling.ParentBased(sampling.TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(Tracing(provider.get_tracer("t"), provider), "flat-interleaved"), exporter


@pytest.fixture
def traced() -> Iterator[tuple[RequestTracer, InMemorySpanExporter]]:
    tracer, exporter = tracer_of(1.0)
    yield tracer, exporter
    tracer.shutdown()


def slot(name: str, rank: int = 0) -> Slot:
    return Slot(Instance(name, f"http://10.0.0.1:8000/{name}", dp_size=2, ready=True), rank)


def test_children_carry_the_routing_and_the_legs(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    spans = tracer.request("POST", "/v1/completions", "r1", PARENT, "vendor=abc")
    assert spans.recording and spans.trace_id == trace_id_of(PARENT)
    spans.admission(now_ns(), "queue_timeout")
    spans.route(now_ns(), 1, 7, None, False, None)
    leg = spans.leg("prefill", slot("p0", 1), "r1-p1", 1, None, None)
    headers: dict[str, str] = {}
    spans.inject(headers, leg)
    spans.end_leg(leg, "connect_error")
    spans.route(now_ns(), 2, 7, (slot("p1"), slot("d0")), False, 0)
    handoff = spans.kv_handoff(
        slot("p1"), slot("d0"), {"remote_engine_id": "p1-dp0", "remote_block_ids": [1, 2]}, False
    )
    spans.first_token(handoff, 0)
    spans.end(503, "no_slot", {"pdserve.attempts": 2})
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    server = by_name["POST /v1/completions"]
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT[36:52]
    assert server.status.status_code is StatusCode.ERROR
    assert server.attributes is not None and server.attributes["pdserve.outcome"] == "no_slot"
    assert [e.name for e in server.events] == ["first_token"]
    assert by_name["admission"].attributes == {"pdserve.admission.outcome": "queue_timeout"}
    prefill = by_name["prefill"]
    assert prefill.attributes is not None and prefill.attributes["pdserve.dp_rank"] == 1
    assert prefill.status.status_code is StatusCode.ERROR
    assert prefill.context is not None
    assert headers == {
        "traceparent": f"00-{trace_id_of(PARENT)}-{prefill.context.span_id:016x}-01",
        "tracestate": "vendor=abc",
    }
    assert by_name["kv_handoff"].attributes is not None
    assert by_name["kv_handoff"].attributes["pdserve.kv.blocks"] == 2
    routes = [s for s in exporter.get_finished_spans() if s.name == "route"]
    assert [r.status.status_code for r in routes] == [StatusCode.ERROR, StatusCode.UNSET]
    assert routes[1].attributes is not None and routes[1].attributes["pdserve.part"] == 0
    assert all(
        s.parent is not None and s.parent.span_id == server.context.span_id for s in routes if server.context
    )


def test_a_request_the_sampler_leaves_out_has_no_spans_and_tells_the_engines() -> None:
    tracer, exporter = tracer_of(0.0)
    spans = tracer.request("POST", "/v1/completions", "r2", None, None)
    assert not spans.recording and spans.trace_id is None
    assert spans.leg("decode", slot("d0"), "r2-d1", 1, None, None) is None
    headers: dict[str, str] = {}
    spans.inject(headers, None)
    assert int(headers["traceparent"][-2:], 16) & 1 == 0  # not sampled: the engines leave it out too
    spans.end(200, "ok", {})
    assert exporter.get_finished_spans() == ()
    follows = tracer.request("POST", "/v1/completions", "r3", UNSAMPLED, None)
    assert not follows.recording  # a client's unsampled parent decides at any ratio
    tracer.shutdown()
