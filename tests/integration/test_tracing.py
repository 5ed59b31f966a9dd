"""One trace per request across both legs, read back from a real OpenTelemetry Collector.

Real processes on loopback: `pdserve sim` engines that trace as vLLM does (the protocol from
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, one ``llm_request`` span per finished request), a real
`pdserve proxy`, and the collector built from its Go modules (tests/support/otelcol.py) with the
OTLP receiver and the file exporter. The router sends over gRPC and the engines over HTTP, so
both exporters are exercised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import __version__
from tests.support.otelcol import FAST_EXPORT, Collector, ExportedSpan
from tests.support.pdstack import PDStack, http
from tests.support.procs import REPO, ProcessGroup, free_port, wait_http

ROUTER = "pdserve-router"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def stack(procs: ProcessGroup, tmp_path: Path) -> Iterator[PDStack]:
    yield PDStack(procs, tmp_path)


def engine_env(collector: Collector, service: str) -> dict[str, str]:
    """What the operator and `pdserve up` give an engine: vLLM's protocol variable, a service name."""
    return {
        **FAST_EXPORT,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": service,
    }


def traced_sims(stack: PDStack, collector: Collector, prefills: int = 1) -> None:
    tracing = ["--otlp-traces-endpoint", collector.http_endpoint]
    for i in range(prefills):
        stack.sim(
            f"prefill-{i}", "prefill", extra=tracing, wait=False, env=engine_env(collector, "sim-prefill")
        )
    stack.sim("decode-0", "decode", extra=tracing, wait=False, env=engine_env(collector, "sim-decode"))
    stack.wait_sims()
    prefill = [stack.sims[f"prefill-{i}"] for i in range(prefills)]
    stack.write(stack.table(prefill, [stack.sims["decode-0"]]), wait=False)


def of_trace(spans: list[ExportedSpan], trace_id: str) -> list[ExportedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def named(spans: list[ExportedSpan], service: str, name: str) -> list[ExportedSpan]:
    return sorted((s for s in spans if s.service == service and s.name == name), key=lambda s: s.start_ns)


def one(spans: list[ExportedSpan], service: str, name: str) -> ExportedSpan:
    found = named(spans, service, name)
    assert len(found) == 1, (service, name, spans)
    return found[0]


def request_trace(collector: Collector, engine_spans: int, router: str = ROUTER) -> list[ExportedSpan]:
    """The one trace of the router's first request, once the router's server span and
    ``engine_spans`` engine spans of it have arrived."""

    def complete(spans: list[ExportedSpan]) -> bool:
        servers = [s for s in spans if s.service == router and s.kind == "SERVER"]
        if not servers:
            return False
        mine = of_trace(spans, servers[0].trace_id)
        return sum(1 for s in mine if s.name == "llm_request") >= engine_spans

    spans = collector.wait_for(complete, what=f"the router's trace with {engine_spans} engine spans")
    server = next(s for s in spans if s.service == router and s.kind == "SERVER")
    return of_trace(spans, server.trace_id)


def test_a_request_is_one_trace_through_router_prefill_and_decode(stack: PDStack, otelcol: Collector) -> None:
    traced_sims(stack, otelcol)
    stack.start_proxy("--otlp-traces-endpoint", otelcol.grpc_endpoint, env=FAST_EXPORT)
    answer = stack.complete(stream=True, headers={"X-Request-Id": "traced-1"})
    assert answer.status == 200, answer.body

    trace = request_trace(otelcol, engine_spans=2)
    server = one(trace, ROUTER, "POST /v1/completions")
    route = one(trace, ROUTER, "route")
    prefill = one(trace, ROUTER, "prefill")
    handoff = one(trace, ROUTER, "kv_handoff")
    decode = one(trace, ROUTER, "decode")
    engine_prefill = one(trace, "sim-prefill", "llm_request")
    engine_decode = one(trace, "sim-decode", "llm_request")

    # The tree: the router's request is the root; vLLM's spans are children of the legs that sent them.
    assert server.parent_id == "" and server.kind == "SERVER"
    for child in (route, prefill, handoff, decode):
        assert child.parent_id == server.span_id, child
    assert (prefill.kind, decode.kind) == ("CLIENT", "CLIENT")
    assert engine_prefill.parent_id == prefill.span_id and engine_prefill.kind == "SERVER"
    assert engine_decode.parent_id == decode.span_id and engine_decode.kind == "SERVER"
    assert engine_prefill.scope == "vllm.tracing.otel"
    assert engine_prefill.resource["vllm.instrumenting_module_name"] == "vllm.llm_engine"

    # What each span carries.
    assert server.resource["service.version"] == __version__
    assert server.attributes["pdserve.request_id"] == "traced-1"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["pdserve.outcome"] == "ok"
    assert server.attributes["pdserve.attempts"] == 1
    assert "first_token" in server.events
    assert route.attributes["pdserve.policy"] == "flat-interleaved"
    assert route.attributes["pdserve.table.generation"] == stack.generation
    assert route.attributes["pdserve.prefill.slot"] == "prefill-0/0"
    assert route.attributes["pdserve.decode.slot"] == "decode-0/0"
    assert prefill.attributes["pdserve.slot"] == "prefill-0/0"
    assert prefill.attributes["pdserve.dp_rank"] == 0
    assert prefill.attributes["pdserve.outcome"] == "ok"
    assert prefill.attributes["http.response.status_code"] == 200
    assert "pdserve.retry_reason" not in prefill.attributes
    assert decode.attributes["pdserve.outcome"] == "ok"
    assert handoff.attributes["pdserve.kv.remote_engine_id"] == "prefill-0-dp0"
    assert handoff.attributes["pdserve.kv.handoff_reused"] is False
    # The handoff starts at the prefill's answer and ends at the decode's first byte.
    assert prefill.end_ns <= handoff.start_ns <= handoff.end_ns <= decode.end_ns
    assert engine_decode.attributes["gen_ai.usage.completion_tokens"] == 3
    assert engine_prefill.attributes["gen_ai.request.max_tokens"] == 1  # the prefill leg's
    assert engine_decode.attributes["gen_ai.request.id"].startswith("cmpl-")
    assert not any(s.error for s in trace)

    # The router's request log line names the trace.
    assert stack.proxy is not None
    log_line = next(line for line in stack.proxy.log().splitlines() if "request id=traced-1 " in line)
    assert f"trace_id={server.trace_id}" in log_line


def test_a_retried_prefill_shows_two_attempt_spans(stack: PDStack, otelcol: Collector) -> None:
    traced_sims(stack, otelcol, prefills=2)
    stack.start_proxy("--otlp-traces-endpoint", otelcol.grpc_endpoint, env=FAST_EXPORT)
    stack.sims["prefill-0"].faults("http-500")
    # The counter alternates: within two requests one goes to prefill-0 first and is retried.
    for i in range(2):
        answer = stack.complete(headers={"X-Request-Id": f"retry-{i}"})
        assert answer.status == 200, answer.body

    def retried(spans: list[ExportedSpan]) -> list[ExportedSpan]:
        """The trace of the request whose prefill was retried, once all of it has arrived: the
        router's request span ends last, the decode's vLLM span too."""
        second = [s for s in spans if s.name == "prefill" and s.attributes.get("pdserve.attempt") == 2]
        trace = of_trace(spans, second[0].trace_id) if second else []
        done = any(s.kind == "SERVER" and s.service == ROUTER for s in trace)
        return trace if done and sum(s.name == "llm_request" for s in trace) == 2 else []

    trace = retried(otelcol.wait_for(lambda spans: bool(retried(spans)), what="a retried prefill's trace"))
    first, second = named(trace, ROUTER, "prefill")
    server = one(trace, ROUTER, "POST /v1/completions")
    assert [r.attributes["pdserve.attempt"] for r in named(trace, ROUTER, "route")] == [1, 2]
    assert first.attributes["pdserve.attempt"] == 1
    assert first.attributes["pdserve.slot"] == "prefill-0/0"
    assert first.attributes["pdserve.outcome"] == "http_5xx"
    assert first.attributes["http.response.status_code"] == 500
    assert first.error and "pdserve.retry_reason" not in first.attributes
    assert second.attributes["pdserve.slot"] == "prefill-1/0"
    assert second.attributes["pdserve.retry_reason"] == "prefill http_5xx"
    assert second.attributes["pdserve.outcome"] == "ok" and not second.error
    assert server.attributes["pdserve.attempts"] == 2
    assert server.parent_id == "" and first.parent_id == second.parent_id == server.span_id
    # Only the prefill that served the leg made vLLM's span (a 500 finishes no request), under attempt 2.
    engine = named(trace, "sim-prefill", "llm_request")
    assert [s.parent_id for s in engine] == [second.span_id]
    assert one(trace, "sim-decode", "llm_request").parent_id == one(trace, ROUTER, "decode").span_id


def test_a_client_traceparent_is_continued(stack: PDStack, otelcol: Collector) -> None:
    traced_sims(stack, otelcol)
    stack.start_proxy("--otlp-traces-endpoint", otelcol.grpc_endpoint, env=FAST_EXPORT)
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    answer = stack.complete(headers={"traceparent": parent, "tracestate": "vendor=abc"})
    assert answer.status == 200, answer.body
    trace = request_trace(otelcol, engine_spans=2)
    server = one(trace, ROUTER, "POST /v1/completions")
    assert server.trace_id == CLIENT_TRACE
    assert server.parent_id == CLIENT_SPAN
    assert {s.service for s in trace} == {ROUTER, "sim-prefill", "sim-decode"}
    # The engines got the client's tracestate with the legs' traceparent.
    assert {s.trace_state for s in trace} == {"vendor=abc"}


def test_sampling_ratio_zero_exports_nothing_and_tells_the_engines(
    stack: PDStack, otelcol: Collector
) -> None:
    """A request the router's sampler leaves out: no span of it anywhere, the engines follow."""
    traced_sims(stack, otelcol)
    stack.start_proxy(
        "--otlp-traces-endpoint", otelcol.grpc_endpoint, "--trace-sampling-ratio", "0", env=FAST_EXPORT
    )
    assert stack.complete(stream=True).status == 200
    assert stack.proxy is not None
    assert stack.proxy.stop() == 0  # the router flushes what it buffered before it exits
    for sim in stack.sims.values():
        sim.proc.stop()
    otelcol.mark()
    assert [s for s in otelcol.spans() if s.service != "test-marker"] == []
    # No trace exists, so the request's log line names none.
    lines = [line for line in stack.proxy.log().splitlines() if "request id=" in line]
    assert lines and not any("trace_id=" in line for line in lines)


def test_no_trace_is_exported_when_the_router_does_not_trace(stack: PDStack, otelcol: Collector) -> None:
    """Tracing off in the router: nothing of it is exported, nor loaded; the engines (tracing on
    their own) get no context from it, and a client's context passes through unchanged."""
    traced_sims(stack, otelcol)
    stack.start_proxy(env=FAST_EXPORT)
    assert stack.complete(stream=True, headers={"X-Request-Id": "untraced"}).status == 200
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    assert stack.complete(headers={"traceparent": parent, "X-Request-Id": "passed"}).status == 200
    assert stack.proxy is not None
    assert stack.proxy.stop() == 0
    for sim in stack.sims.values():
        sim.proc.stop()  # the engines flush their spans before they exit
    otelcol.mark()
    spans = [s for s in otelcol.spans() if s.service != "test-marker"]
    assert not [s for s in spans if s.service == ROUTER]
    assert len(spans) == 4 and {s.name for s in spans} == {"llm_request"}
    # The untraced request: each engine's span is a root of its own trace.
    untraced = [s for s in spans if s.trace_id != CLIENT_TRACE]
    assert len(untraced) == 2 and all(s.parent_id == "" for s in untraced)
    assert untraced[0].trace_id != untraced[1].trace_id
    # The client's context went through the router to both engines.
    passed = [s for s in spans if s.trace_id == CLIENT_TRACE]
    assert sorted(s.service for s in passed) == ["sim-decode", "sim-prefill"]
    assert all(s.parent_id == CLIENT_SPAN for s in passed)
    log = stack.proxy.log()
    assert "opentelemetry" not in log
    assert any("id=passed " in line and f"trace_id={CLIENT_TRACE}" in line for line in log.splitlines())


def test_the_router_refuses_tracing_without_the_sdk(tmp_path: Path) -> None:
    """Asked to trace without the tracing extra: a clear error naming it, before anything starts."""
    routing = tmp_path / "routing.json"
    routing.write_text("{}")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nfor m in ('opentelemetry', 'opentelemetry.sdk', 'opentelemetry.sdk.trace'):\n"
        "    sys.modules[m] = None\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pdserve.cli", "proxy", "--routing-file", str(routing)),
            *("--otlp-traces-endpoint", "http://127.0.0.1:4318"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'pdserve[tracing]'" in done.stderr
    assert "--otlp-traces-endpoint" in done.stderr


def test_local_mode_traces_the_router_and_every_engine(tmp_path: Path, otelcol: Collector) -> None:
    """`pdserve up --otlp-traces-endpoint URL`: one request is one trace across the three services."""
    port = free_port()
    log = tmp_path / "up.log"
    manifest = REPO / "examples" / "sim" / "quickstart.yaml"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [
                *(sys.executable, "-m", "pdserve.cli", "up", str(manifest), "--port", str(port), "--no-view"),
                *("--sim-ttft-ms", "1", "--sim-itl-ms", "0", "--sim-tokens", "4"),
                *("--otlp-traces-endpoint", otelcol.grpc_endpoint),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **FAST_EXPORT, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=60, proc=up)
        deadline = time.monotonic() + 30
        while "is serving on" not in log.read_text():  # every instance routable
            assert time.monotonic() < deadline and up.poll() is None, log.read_text()
            time.sleep(0.1)
        body = {"model": "qwen-0.5b", "prompt": "hello", "max_tokens": 2}
        assert http("POST", f"http://127.0.0.1:{port}/v1/completions", body).status == 200
        trace = request_trace(otelcol, engine_spans=2, router="quickstart-router")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    assert "tracing: the router and every engine send their spans to" in log.read_text()
    router = "quickstart-router"
    server = one(trace, router, "POST /v1/completions")
    assert one(trace, "quickstart-prefill", "llm_request").parent_id == one(trace, router, "prefill").span_id
    assert one(trace, "quickstart-decode", "llm_request").parent_id == one(trace, router, "decode").span_id
    assert server.resource["pdserve.deployment"] == "quickstart"
    pods = {s.resource["k8s.pod.name"] for s in trace}
    assert "router" in pods and any(p.startswith("quickstart-prefill-") for p in pods)
