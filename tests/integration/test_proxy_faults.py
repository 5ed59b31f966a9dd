"""Every simulator fault through a real proxy (issue 6): the client gets a success after a retry
or a specific error within its deadline, no decode ever receives a bad handoff, every
deadline cancels its upstream request, and the proxy keeps serving.

Deadlines are 1 s here (the defaults are minutes); the slot cool-down is short so that each
test starts with every slot healthy.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from tests.support.pdstack import (
    PDStack,
    Sim,
    decode_sim,
    eventually,
    module_stack,
    prefill_sim,
    router_error,
    sse_error,
    sse_events,
    vllm_error,
)

EJECT_S = 0.5
DEADLINES = ("--prefill-ttfb-timeout", "1", "--decode-ttfb-timeout", "1", "--stream-idle-timeout", "1")


stack = module_stack(
    "faults",
    {
        **{"p0": prefill_sim(), "p1": prefill_sim(), "d0": decode_sim(), "d1": decode_sim()},
        "dslow": decode_sim(1, 1, "--itl-ms", "1500"),  # stalls between chunks
    },
    routed=(["p0", "p1"], ["d0", "d1"]),
    proxy=[*DEADLINES, "--eject-seconds", str(EJECT_S), "--max-retries", "2"],
)


def prefill(pd: PDStack) -> list[Sim]:
    return [pd.sims["p0"], pd.sims["p1"]]


def decode(pd: PDStack) -> list[Sim]:
    return [pd.sims["d0"], pd.sims["d1"]]


@pytest.fixture(autouse=True)
def healthy_start(stack: PDStack) -> Iterator[None]:
    time.sleep(EJECT_S + 0.1)  # earlier ejections have cooled down
    stack.route(prefill(stack), decode(stack))
    yield
    for sim in stack.sims.values():
        sim.faults()
    time.sleep(EJECT_S + 0.1)
    # the proxy keeps serving after every fault
    assert stack.complete().status == 200
    assert stack.complete(stream=True).status == 200
    for sim in stack.sims.values():
        assert sim.stats()["malformed_handoff"] == 0, sim.name


def all_cancelled(sim: Sim) -> bool:
    s = sim.stats()
    return bool(s["in_flight"] == 0 and s["cancelled"] == s["requests"] >= 1)


def test_malformed_kv_params_is_retried_and_never_reaches_a_decode(stack: PDStack) -> None:
    stack.sims["p0"].faults("malformed-kv-params")
    before = stack.metric("pdserve_proxy_handoff_failures_total", slot="p0/0")
    for i in range(4):
        assert stack.complete(stream=i % 2 == 1).status == 200
    assert stack.metric("pdserve_proxy_handoff_failures_total", slot="p0/0") > before
    assert stack.metric("pdserve_proxy_ejections_total", role="prefill", slot="p0/0") >= 1
    assert sum(s.stats()["requests"] for s in decode(stack)) == 4  # only good handoffs went on

    stack.sims["p1"].faults("malformed-kv-params")
    answer = stack.complete()
    assert answer.status == 502
    reason, error = router_error(answer)
    assert reason == "bad_kv_handoff"
    # the fields the simulator dropped (remote_request_id is optional: older vLLM omits it)
    assert "remote_host, remote_port" in error["message"]
    assert sum(s.stats()["requests"] for s in decode(stack)) == 4  # the decode was never sent


def test_http_500_is_retried_on_the_next_slot(stack: PDStack) -> None:
    stack.sims["p0"].faults("http-500")
    stack.sims["d0"].faults("http-500")
    before = stack.metric("pdserve_proxy_retries_total")
    for i in range(4):
        assert stack.complete(stream=i % 2 == 1).status == 200
    assert stack.metric("pdserve_proxy_retries_total") > before
    assert stack.sims["p0"].stats()["faults"].get("http-500", 0) >= 1

    stack.sims["d1"].faults("http-500")
    answer = stack.complete(stream=True)
    assert answer.status == 502 and router_error(answer)[0] == "decode_unavailable"
    assert "HTTP 500" in router_error(answer)[1]["message"]


def test_hung_prefill_is_cancelled_at_its_deadline_and_retried(stack: PDStack) -> None:
    p0 = stack.sims["p0"]
    p0.faults("hang")
    before = stack.metric("pdserve_proxy_deadline_expiries_total", deadline="prefill_ttfb")
    for i in range(2):
        assert stack.complete(stream=i % 2 == 1).status == 200
    eventually(lambda: all_cancelled(p0))
    assert stack.metric("pdserve_proxy_deadline_expiries_total", deadline="prefill_ttfb") > before

    stack.sims["p1"].faults("hang")
    for sim in stack.sims.values():
        sim.reset()
    time.sleep(EJECT_S + 0.1)
    answer = stack.complete()
    assert answer.status == 504
    assert router_error(answer)[0] == "prefill_timeout"
    for sim in prefill(stack):
        eventually(lambda sim=sim: all_cancelled(sim))  # type: ignore[misc]
    assert sum(s.stats()["requests"] for s in decode(stack)) == 0


def test_hung_decode_is_cancelled_at_its_deadline_and_retried(stack: PDStack) -> None:
    d0 = stack.sims["d0"]
    d0.faults("hang")
    for stream in (True, False):
        assert stack.complete(stream=stream).status == 200
    eventually(lambda: all_cancelled(d0))
    assert stack.metric("pdserve_proxy_deadline_expiries_total", deadline="decode_ttfb") >= 1


def test_slow_first_byte_within_the_deadline_is_not_retried(stack: PDStack) -> None:
    for sim in decode(stack):
        sim.faults("slow-first-byte:200")
    before = stack.metric("pdserve_proxy_retries_total")
    for i in range(2):
        assert stack.complete(stream=i % 2 == 1).status == 200
    assert stack.metric("pdserve_proxy_retries_total") == before
    assert sum(s.stats()["completed"] for s in decode(stack)) == 2


def test_slow_first_byte_past_the_deadline_fails_with_a_timeout(stack: PDStack) -> None:
    for sim in decode(stack):
        sim.faults("slow-first-byte:3000")
    answer = stack.complete(stream=True)
    assert answer.status == 504 and router_error(answer)[0] == "decode_timeout"
    for sim in decode(stack):
        eventually(lambda sim=sim: all_cancelled(sim))  # type: ignore[misc]


def test_drop_mid_stream_ends_the_stream_with_an_error_event(stack: PDStack) -> None:
    for sim in decode(stack):
        sim.faults("drop-mid-stream")
    answer = stack.complete(stream=True)
    assert answer.status == 200  # the first bytes had already reached the client
    events = sse_events(answer.body)
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == " tok0"
    assert "stream broke" in sse_error(events[-2], 502)["message"]
    assert stack.metric("pdserve_proxy_stream_errors_total", reason="upstream_dropped") >= 1

    buffered = stack.complete()  # nothing sent yet: retried, then a clear 502
    assert buffered.status == 502 and router_error(buffered)[0] == "decode_unavailable"

    stack.sims["d1"].faults()
    time.sleep(EJECT_S + 0.1)
    assert all(stack.complete().status == 200 for _ in range(2))  # d0 drops, d1 serves the retry


def test_reset_before_answering_is_retried(stack: PDStack) -> None:
    stack.sims["p0"].faults("reset")
    stack.sims["d1"].faults("reset")
    for i in range(4):
        assert stack.complete(stream=i % 2 == 1).status == 200
    assert stack.metric("pdserve_proxy_upstream_requests_total", outcome="dropped") >= 2


def test_stalled_stream_hits_the_idle_deadline(stack: PDStack) -> None:
    slow = stack.sims["dslow"]
    stack.route(prefill(stack), [slow])
    answer = stack.complete(stream=True)
    assert answer.status == 200
    events = sse_events(answer.body)
    assert json.loads(events[0])["choices"][0]["text"] == " tok0"
    assert "no data from the decode" in sse_error(events[-2], 504)["message"] and events[-1] == "[DONE]"
    eventually(lambda: all_cancelled(slow))
    assert stack.metric("pdserve_proxy_deadline_expiries_total", deadline="stream_idle") >= 1
    stack.route(prefill(stack), decode(stack))


def test_backend_4xx_is_passed_back_not_retried(stack: PDStack) -> None:
    answer = stack.complete(model="no-such-model")
    assert answer.status == 404  # the simulator's (vLLM's) answer, as is
    assert "no-such-model" in vllm_error(404, answer.body)["message"]
    assert "x-pdserve-error" not in answer.headers  # not the router's own error
    assert sum(s.stats()["rejected"].get("model_not_found", 0) for s in prefill(stack)) == 1
    assert sum(s.stats()["requests"] + sum(s.stats()["rejected"].values()) for s in decode(stack)) == 0


async def _stream_until_done_then_hang_up(url: str, path: str, body: dict[str, object]) -> bytes:
    """A client that closes its connection the moment it has read ``data: [DONE]``."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = b""
    try:
        while b"data: [DONE]\n\n" not in received:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk, f"the router ended the response before [DONE]: {received!r}"
            received += chunk
    finally:
        writer.close()
    return received


async def test_a_stream_that_reached_the_client_whole_is_not_counted_cancelled(stack: PDStack) -> None:
    # The decode ends its body 400 ms after [DONE] (real vLLM ends it in a write of its own), and
    # every client hangs up as soon as it has [DONE]: the answer was complete, not cancelled.
    for sim in decode(stack):
        sim.faults("slow-end:400")
    assert stack.proxy is not None
    log_before = stack.proxy.log().count("outcome=cancelled")
    ok_before = stack.metric("pdserve_proxy_requests_total", outcome="ok")
    cancelled_before = stack.metric("pdserve_proxy_requests_total", outcome="cancelled")
    requests = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
    ] * 3
    for path, body in requests:
        received = await _stream_until_done_then_hang_up(stack.url, path, {**body, "stream": True})
        assert received.startswith(b"HTTP/1.1 200"), received

    def outcomes() -> tuple[float, float]:
        return (
            stack.metric("pdserve_proxy_requests_total", outcome="ok") - ok_before,
            stack.metric("pdserve_proxy_requests_total", outcome="cancelled") - cancelled_before,
        )

    eventually(lambda: sum(outcomes()) == len(requests))  # every request has its log line
    assert outcomes() == (len(requests), 0)
    assert stack.proxy.log().count("outcome=cancelled") == log_before
    assert sum(s.stats()["faults"].get("slow-end", 0) for s in decode(stack)) == len(requests)
