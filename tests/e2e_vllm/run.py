"""The scenario of `make e2e-vllm`: real vLLM on CPU behind `pdserve up`, checked from outside.

1. vLLM for CPU in its cached virtualenv; the tiny model in the cache's HF_HOME.
2. Every rendered engine command (each example, each role) parsed by vLLM's own parser.
3. `pdserve up examples/cpu/nixl-1p-1d-dp2.yaml --engine vllm`: NIXL prefill DP1, decode DP2.
4. Real exchanges recorded straight from the engines; their shapes compared with the committed
   fixtures (or written there: ``record``).
5. A burst through the router, completions and chat, streaming and not: every request
   succeeds; the decode's external prefix-cache hits rise by exactly the prompt tokens (the KV
   came over NIXL), one NIXL transfer per request; each decode rank's
   ``vllm:request_success_total`` is exactly half; the router counts every stream ok.
6. One request traced (`pdserve up --otlp-traces-endpoint`, the test collector built from its Go
   modules): one trace holds the router's request, its legs and vLLM's own ``llm_request`` span
   of the prefill and of the decode, each the child of the router's leg that sent it.
7. The decode's main process SIGKILLed while streams decode on it: it and everything it started
   go; the real prefill served exactly one prefill per request sent while the decode lived (none
   for a retry, none once no decode is left: those requests fail fast with a clean 503) and no
   KV lease expired unpulled; the restarted decode (same ports) serves again.
8. Ctrl-C: `pdserve up` exits 0 and no process of the run is left.
9. Prefill DP2 with prefix caching (examples/cpu/nixl-2p-dp2-prefix.yaml), a multi-turn workload
   through the flat interleave and through a prefix-affinity router: vLLM's own
   ``vllm:prefix_cache_hits_total`` rises more with prefix-affinity (tests/e2e_vllm/prefix.py).
10. Mooncake (tests/e2e_vllm/mooncake.py): `pdserve up examples/cpu/mooncake-1p-1d-dp2.yaml`, a
    burst with exact counts and greedy answers equal to the prefill's own, where vLLM runs its
    MooncakeConnector; elsewhere the case reports why not (it does not on CPU-only vLLM 0.32).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from pdserve.wire.headers import ERROR_REASON
from tests.e2e_vllm.argcheck import check_rendered_commands
from tests.e2e_vllm.common import (
    FIXTURES,
    MANIFEST_NAME,
    SERVED_NAME,
    Answer,
    check,
    metrics,
    request,
    say,
    total,
)
from tests.e2e_vllm.model import ensure_model
from tests.e2e_vllm.mooncake import mooncake_case
from tests.e2e_vllm.prefix import prefix_policies
from tests.e2e_vllm.record import record
from tests.e2e_vllm.up import Up
from tests.e2e_vllm.venv import ensure_venv
from tests.support.otelcol import FAST_EXPORT, Collector, ExportedSpan, start_collector
from tests.support.otelcol import build as build_collector
from tests.support.vllm_fixtures import compare_recordings

BURST = 24
IN_FLIGHT = 4
AFTER_KILL = 6
KV_LEASE_S = 30.0  # vLLM's kv_lease_duration for NIXL
PROMPT_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "model"]


def run(out: Path | None = None, record_only: bool = False, keep: bool = False) -> dict[str, Any]:
    """The whole e2e (or, with ``record_only``, only what re-recording the fixtures needs)."""
    started = time.monotonic()
    figures: dict[str, Any] = {}
    ensure_venv()
    ensure_model()
    work = out or Path(tempfile.mkdtemp(prefix="pdserve-e2e-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    collector: Collector | None = None
    tracing: tuple[str, ...] = ()
    if not record_only:
        figures["commands_checked_by_vllm"] = check_rendered_commands(work)
        collector = start_collector(work / "otelcol", build_collector(say))
        tracing = ("--otlp-traces-endpoint", collector.grpc_endpoint)
    up = Up(work / "up", extra_args=tracing, extra_env=dict(FAST_EXPORT))
    try:
        up.start()
        figures["seconds_to_serving"] = round(up.wait_serving(), 1)
        say(f"serving after {figures['seconds_to_serving']} s")
        prefill, decode = up.engine("prefill"), up.engine("decode")
        figures["memory_gb"] = {
            "prefill": round(up.memory_gb(up.engine_processes(_port(prefill))), 2),
            "decode": round(up.memory_gb(up.engine_processes(_port(decode))), 2),
        }
        memory = figures["memory_gb"]
        say(f"memory (PSS): prefill {memory['prefill']} GB, decode DP2 {memory['decode']} GB")
        recorded = work / "fixtures"
        record(prefill["url"], decode["url"], recorded)
        if record_only:  # only a whole recording replaces the committed one
            shutil.rmtree(FIXTURES, ignore_errors=True)
            shutil.copytree(recorded, FIXTURES)
            say(f"fixtures written to {FIXTURES}")
        if not record_only:
            problems = compare_recordings(FIXTURES, recorded)
            check(
                not problems,
                "vLLM no longer answers like the committed fixtures:\n  " + "\n  ".join(problems),
            )
            say(f"this vLLM's answers have the shapes of {FIXTURES.relative_to(FIXTURES.parents[2])}")
            figures["burst"] = burst(up, prefill["url"], decode["url"])
            assert collector is not None
            figures["trace"] = traced_request(up, collector)
            figures["killed_decode"] = killed_decode(up, prefill["url"], decode)
        figures["seconds_to_stop"] = round(up.stop(), 1)
        say(f"stopped in {figures['seconds_to_stop']} s; no process of the run is left")
        if not record_only:
            figures["prefill_policies"] = prefix_policies(work)
            figures["mooncake"] = mooncake_case(work)
    except BaseException:
        say(f"failed; logs kept in {work}")
        up.kill()
        raise
    finally:
        if collector is not None:
            collector.process.terminate()
            collector.process.wait(10)
    if not keep and out is None:
        shutil.rmtree(work, ignore_errors=True)
    figures["wall_seconds"] = round(time.monotonic() - started, 1)
    return figures


def _port(instance: dict[str, Any]) -> int:
    return int(str(instance["url"]).rsplit(":", 1)[1])


def _body(i: int) -> tuple[str, dict[str, Any]]:
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "with",
        "was",
        "on",
        "tiny",
        "model",
        "pdserve",
    ]
    text = " ".join(words[: 3 + i % len(words)]) + f" number {i}"
    stream = i % 2 == 1
    extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    if (i // 2) % 2 == 0:
        return "/v1/completions", {"model": SERVED_NAME, "prompt": text, "max_tokens": 4, **extra}
    return "/v1/chat/completions", {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **extra,
    }


def _prompt_tokens(path: str, body: dict[str, Any], answer: Answer) -> int:
    """The prompt tokens vLLM counted, from ``usage`` (the last chunk of a stream)."""
    check(
        answer.status == 200,
        f"{path} stream={body.get('stream', False)}: HTTP {answer.status}: {answer.body[:300]!r}",
    )
    if body.get("stream"):
        events = answer.events()
        check(events[-1] == "[DONE]", f"stream without [DONE]: {events[-3:]}")
        check(not any(isinstance(e, dict) and "error" in e for e in events), f"error event: {events}")
        chunks = [e for e in events[:-1] if e.get("choices")]
        check(bool(chunks), f"no token chunk: {events}")
        return int(events[-2]["usage"]["prompt_tokens"])
    data = answer.json()
    check(bool(data["choices"]), f"no choice: {data}")
    return int(data["usage"]["prompt_tokens"])


def burst(up: Up, prefill_url: str, decode_url: str) -> dict[str, Any]:
    say(f"{BURST} requests through the router (completions and chat, streaming and not, 4 at a time)")
    before_d, before_p, before_r = metrics(decode_url), metrics(prefill_url), metrics(up.url)
    requests = [_body(i) for i in range(BURST)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda rb: request("POST", up.url + rb[0], rb[1]), requests))
    prompt_tokens = sum(
        _prompt_tokens(path, body, a) for (path, body), a in zip(requests, answers, strict=True)
    )
    after_d, after_p, after_r = metrics(decode_url), metrics(prefill_url), metrics(up.url)

    def delta(after: Any, before: Any, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    hits = delta(after_d, before_d, "vllm:external_prefix_cache_hits_total")
    transfers = delta(after_d, before_d, "vllm:nixl_xfer_time_seconds_count")
    ranks = [delta(after_d, before_d, "vllm:request_success_total", engine=str(r)) for r in (0, 1)]
    prefills = delta(after_p, before_p, "vllm:request_success_total")
    ok = delta(after_r, before_r, "pdserve_proxy_requests_total", outcome="ok")
    cancelled = delta(after_r, before_r, "pdserve_proxy_requests_total", outcome="cancelled")
    figures = {
        "requests": BURST,
        "prompt_tokens": prompt_tokens,
        "decode_external_prefix_cache_hits": hits,
        "nixl_transfers": transfers,
        "decode_success_per_rank": ranks,
        "prefill_success": prefills,
        "router_ok": ok,
        "router_cancelled": cancelled,
        "seconds_per_request_max": round(max(a.seconds for a in answers), 2),
    }
    say(f"burst: {figures}")
    check(
        hits == prompt_tokens,
        f"decode pulled {hits} prompt tokens over NIXL, the prompts had {prompt_tokens}",
    )
    check(transfers == BURST, f"{transfers} NIXL transfers for {BURST} requests")
    check(ranks == [BURST / 2, BURST / 2], f"per-rank successes {ranks}, expected {BURST // 2} each")
    check(prefills == BURST, f"{prefills} prefills for {BURST} requests")
    check((ok, cancelled) == (BURST, 0), f"router counted ok={ok} cancelled={cancelled}")
    return figures


def traced_request(up: Up, collector: Collector) -> dict[str, Any]:
    """One request through the router is one trace: the router's spans and real vLLM's
    ``llm_request`` of each leg, that span the child of the router's leg that sent it."""
    path, body = _body(0)
    answer = request("POST", up.url + path, body, headers={"X-Request-Id": "e2e-traced"})
    _prompt_tokens(path, body, answer)
    router, prefill, decode = f"{MANIFEST_NAME}-router", f"{MANIFEST_NAME}-prefill", f"{MANIFEST_NAME}-decode"

    def trace_of(spans: list[ExportedSpan]) -> list[ExportedSpan]:
        server = next(
            (
                s
                for s in spans
                if s.service == router and s.attributes.get("pdserve.request_id") == "e2e-traced"
            ),
            None,
        )
        return [] if server is None else [s for s in spans if s.trace_id == server.trace_id]

    spans = collector.wait_for(
        lambda spans: sum(s.name == "llm_request" for s in trace_of(spans)) >= 2,
        timeout=60,
        what="the router's trace with vLLM's llm_request of both legs",
    )
    trace = trace_of(spans)
    legs = {s.name: s for s in trace if s.service == router and s.kind == "CLIENT"}
    engines = {s.service: s for s in trace if s.name == "llm_request"}
    check(set(legs) == {"prefill", "decode"}, f"the router's legs in the trace: {sorted(legs)}")
    check(set(engines) == {prefill, decode}, f"vLLM's spans in the trace: {trace}")
    for role, service in (("prefill", prefill), ("decode", decode)):
        span = engines[service]
        check(
            span.parent_id == legs[role].span_id and span.kind == "SERVER",
            f"vLLM's {role} span {span} is not the child of the router's {role} leg {legs[role]}",
        )
        check(span.scope == "vllm.tracing.otel", f"vLLM's {role} span came from {span.scope!r}")
    check(
        engines[prefill].attributes.get("gen_ai.request.max_tokens") == 1, "the prefill leg is max_tokens 1"
    )
    say(
        f"one trace ({trace[0].trace_id}): {len(trace)} spans, vLLM's llm_request of both legs "
        "under the router's"
    )
    return {
        "trace_id": trace[0].trace_id,
        "spans": len(trace),
        "services": sorted({s.service for s in trace}),
    }


def killed_decode(up: Up, prefill_url: str, decode: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the decode while streams decode on it, then send more. Real vLLM's prefill counts
    every prefill it served: exactly one per request sent while the decode was alive, none for a
    retry or a request once no decode is left; and no KV lease expires unpulled (the in-flight
    requests had pulled theirs, the later ones were never prefilled)."""
    procs = up.engine_processes(_port(decode))
    main = procs[0]
    before_p = metrics(prefill_url)
    say(f"{IN_FLIGHT} long streams decoding when the decode's main process {main.pid} is SIGKILLed")
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        streams = [
            pool.submit(request, "POST", up.url + "/v1/completions", _long_stream(i))
            for i in range(IN_FLIGHT)
        ]
        _wait_decoding(decode["url"], IN_FLIGHT)
        killed = time.monotonic()
        os.kill(main.pid, signal.SIGKILL)
        in_flight = [s.result(timeout=120) for s in streams]
    for answer in in_flight:  # the stream had started: it ends with an error event, or 503 if not
        check(answer.status in (200, 503), f"a stream in flight at the kill: HTTP {answer.status}")
        if answer.status == 200:
            check(
                any(isinstance(e, dict) and "error" in e for e in answer.events()),
                "a cut stream without an error event",
            )
    while request("GET", up.url + "/ready", timeout=5).status == 200:
        check(time.monotonic() - killed < 30, "the router still routes to the killed decode after 30 s")
        time.sleep(0.05)
    out_of_table = time.monotonic() - killed
    _, alive = psutil.wait_procs(procs[1:], timeout=20)
    check(not alive, f"the killed decode's processes still run: {[p.pid for p in alive]}")
    gone = time.monotonic() - killed
    answers = [
        request("POST", up.url + path, body, timeout=30) for path, body in map(_body, range(AFTER_KILL))
    ]
    for answer in answers:
        check(answer.status == 503, f"after the kill: HTTP {answer.status}: {answer.body[:300]!r}")
        check(answer.headers.get(ERROR_REASON.lower()) == "no_decode_slot", f"reason {answer.headers}")
        error = answer.json()["error"]
        check(error["code"] == 503 and error["type"] == "ServiceUnavailableError", f"error body {error}")
    # past the KV lease (vLLM's kv_lease_duration, 30 s): a prefill nobody pulled has expired by now
    time.sleep(max(0.0, KV_LEASE_S + 5 - (time.monotonic() - killed)))
    after_p = metrics(prefill_url)
    prefills = total(after_p, "vllm:request_success_total") - total(before_p, "vllm:request_success_total")
    expired = total(after_p, "vllm:nixl_num_kv_expired_reqs_total") - total(
        before_p, "vllm:nixl_num_kv_expired_reqs_total"
    )
    check(
        "vllm:nixl_num_kv_expired_reqs_total" in after_p,
        "the prefill reports no vllm:nixl_num_kv_expired_reqs_total",
    )
    check(
        prefills == IN_FLIGHT,
        f"{prefills} prefills for {IN_FLIGHT} requests in flight at the kill and {AFTER_KILL} after it "
        f"(expected {IN_FLIGHT}: one each, none for a retry or once no decode was left)",
    )
    check(expired == 0, f"{expired} prefills' KV expired unpulled")
    say("decode back: waiting for its restart on the same ports")
    back = up.wait_serving(timeout=600)
    again = [request("POST", up.url + path, body) for path, body in map(_body, range(4))]
    for (path, body), answer in zip(map(_body, range(4)), again, strict=True):
        _prompt_tokens(path, body, answer)
    figures = {
        "streams_in_flight_at_kill": IN_FLIGHT,
        "in_flight_outcomes": sorted(a.status for a in in_flight),
        "seconds_out_of_routing_table": round(out_of_table, 2),
        "seconds_until_its_processes_were_gone": round(gone, 2),
        "requests_after_kill": AFTER_KILL,
        "slowest_error_seconds": round(max(a.seconds for a in answers), 3),
        "prefills": prefills,
        "kv_expired_unpulled": expired,
        "seconds_until_restarted_decode_served": round(back, 1),
    }
    say(f"killed decode: {figures}")
    return figures


def _long_stream(i: int) -> dict[str, Any]:
    """A stream that decodes long enough to be cut by the kill (the model ignores EOS here)."""
    prompt = " ".join(PROMPT_WORDS[: 4 + i]) + f" stream {i}"
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}


def _wait_decoding(decode_url: str, n: int, timeout: float = 120.0) -> None:
    """Until the decode runs ``n`` requests: their KV pulled, their tokens being generated."""
    deadline = time.monotonic() + timeout
    while total(metrics(decode_url), "vllm:num_requests_running") < n:
        check(time.monotonic() < deadline, f"the decode never ran {n} requests at once")
        time.sleep(0.05)
