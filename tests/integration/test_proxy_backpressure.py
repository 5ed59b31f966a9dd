"""Back-pressure through a real proxy in front of real `pdserve sim` processes (issue 13, item 4).

* An engine that answers 503 or 429 (the simulator's ``busy`` faults) is busy, not broken: the
  request is retried on another slot and nothing is ejected; when every slot is busy the client
  gets 503 ``decode_busy`` with Retry-After.
* A per-slot limit on legs in flight: a request whose slots are full waits in the admission
  queue (bounded, with a deadline); a full queue or a passed deadline is a 429 with Retry-After
  and vLLM's error body, counted in ``shed_requests_total``; the queue's depth and wait times
  are metrics too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from tests.support.pdstack import (
    HttpAnswer,
    PDStack,
    decode_sim,
    module_stack,
    prefill_sim,
    proxy_args,
    proxy_metric,
    router_error,
    sse_events,
)
from tests.support.procs import Proc

stack = module_stack(
    "backpressure",
    {"p0": prefill_sim(), "d0": decode_sim(), "d1": decode_sim()},
    routed=(["p0"], ["d0", "d1"]),
)


@pytest.mark.parametrize("fault", ["busy", "busy-429"])
def test_busy_engine_is_retried_elsewhere_and_not_ejected(stack: PDStack, fault: str) -> None:
    p0, d0, d1 = stack.sims["p0"], stack.sims["d0"], stack.sims["d1"]
    stack.route([p0], [d0, d1])
    d0.faults(fault)
    ejections = stack.metric("pdserve_proxy_ejections_total")
    for i in range(6):
        answer = stack.complete(stream=i % 2 == 1)
        assert answer.status == 200, answer.body
        if i % 2:
            assert sse_events(answer.body)[-1] == "[DONE]"
    assert d1.stats()["by_leg"]["decode"] == 6  # every decode ended on d1
    assert stack.metric("pdserve_proxy_ejections_total") == ejections  # busy is not a failure
    assert stack.metric("pdserve_proxy_upstream_requests_total", role="decode", outcome="busy") >= 3
    assert stack.metric("pdserve_proxy_retries_total", role="decode", reason="busy") >= 3
    slots = {row["slot"]: row for row in stack.debug()["slots"]["decode"]}
    assert slots[f"{d0.name}/0"]["ejected_for_seconds"] == 0


def test_every_slot_busy_is_503_with_retry_after(stack: PDStack) -> None:
    p0, d0, d1 = stack.sims["p0"], stack.sims["d0"], stack.sims["d1"]
    stack.route([p0], [d0, d1])
    d0.faults("busy")
    d1.faults("busy-429")
    answer = stack.complete()
    assert answer.status == 503, answer.body
    reason, error = router_error(answer)
    assert reason == "decode_busy"
    assert "busy" in error["message"]
    assert answer.headers["retry-after"] == "1"
    assert stack.metric("pdserve_proxy_requests_total", outcome="busy") >= 1


@pytest.fixture(scope="module")
def limited(stack: PDStack) -> Iterator[Proc]:
    """A second proxy on the same table: one leg per slot, two waiting requests, 4 s deadline; one
    worker (with several, the limit is still the router's but each has a queue of its own; the
    router-wide limit with two workers is tested in test_proxy_workers.py)."""
    args = proxy_args(stack.routing_file, "--host", "127.0.0.1", "--max-per-slot", "1", "--workers", "1")
    args += ["--admission-queue", "2", "--admission-timeout", "4"]
    proc = stack.group.start("proxy-limited", args)
    yield proc
    proc.stop()


async def _post(session: aiohttp.ClientSession, url: str, delay: float) -> tuple[int, dict[str, str], bytes]:
    await asyncio.sleep(delay)  # arrival order
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()


def test_full_slots_queue_then_shed_with_429(stack: PDStack, limited: Proc) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    stack.route([p0], [d0])
    # A decode takes 1.5 s: one request holds the only decode slot, two wait, the fourth is shed.
    d0.faults({"kind": "slow-first-byte", "ms": 1500, "roles": ["decode"]})  # type: ignore[arg-type]

    async def burst() -> list[tuple[int, dict[str, str], bytes]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(_post(session, limited.url, 0.2 * i) for i in range(4)))

    results = asyncio.run(burst())
    statuses = [status for status, _, _ in results]
    assert statuses == [200, 200, 200, 429], statuses
    status, headers, body = results[3]
    assert headers["retry-after"] == "1"
    assert headers["x-pdserve-error"] == "queue_full"
    router_error(HttpAnswer(status, headers, body))  # vLLM's shape, integer code 429
    for _, _, ok in results[:3]:
        assert sse_events(ok)[-1] == "[DONE]"
    assert d0.stats()["by_leg"]["decode"] == 3
    assert proxy_metric(limited.url, "pdserve_proxy_shed_requests_total", reason="queue_full") == 1
    assert proxy_metric(limited.url, "pdserve_proxy_admission_wait_seconds_count") >= 2
    assert proxy_metric(limited.url, "pdserve_proxy_admission_wait_seconds_sum") > 1.0
    assert proxy_metric(limited.url, "pdserve_proxy_admission_queue_depth") == 0
    assert proxy_metric(limited.url, "pdserve_proxy_requests_total", outcome="shed") == 1


def test_a_wait_past_the_deadline_is_shed(stack: PDStack, limited: Proc) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    stack.route([p0], [d0])
    d0.faults({"kind": "slow-first-byte", "ms": 5000, "roles": ["decode"]})  # type: ignore[arg-type]
    before = proxy_metric(limited.url, "pdserve_proxy_shed_requests_total", reason="queue_timeout")

    async def two() -> list[tuple[int, dict[str, str], bytes]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(_post(session, limited.url, 0.2 * i) for i in range(2)))

    (first, _, _), (second, headers, body) = asyncio.run(two())
    assert first == 200
    assert second == 429, body
    assert headers["x-pdserve-error"] == "queue_timeout"
    assert b"within 4 s" in body
    after = proxy_metric(limited.url, "pdserve_proxy_shed_requests_total", reason="queue_timeout")
    assert after == before + 1
