"""Load through a real proxy: a burst of 1000+ simultaneous connections (none reset), and a
bounded soak with faults injected at random into half the instances (every request succeeds
or fails fast with a clear error; the proxy's open files and memory do not grow)."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import aiohttp
import psutil

from tests.support.pdstack import (
    PDStack,
    decode_sim,
    module_stack,
    prefill_sim,
    sse_error,
    sse_events,
    vllm_error,
)

BURST = 1200
SOAK_SECONDS = 20.0
FAULTS = ["malformed-kv-params", "http-500", "hang", "slow-first-byte:1500", "drop-mid-stream", "reset"]
#: The router's own reasons (X-PDServe-Error) for a failed buffered answer.
KNOWN_ERROR_REASONS = {
    "bad_kv_handoff",
    "prefill_unavailable",
    "decode_unavailable",
    "prefill_timeout",
    "decode_timeout",
}
#: What a stream's error event says, per cause: (status in ``code``, words of the message).
STREAM_ERRORS = {
    "upstream_dropped": (502, "stream broke"),
    "stream_idle_timeout": (504, "no data from the decode"),
}


# each test starts its own router
stack = module_stack(
    "load",
    {"p0": prefill_sim(2), "p1": prefill_sim(2), "d0": decode_sim(2), "d1": decode_sim(2)},
    routed=(["p0", "p1"], ["d0", "d1"]),
    proxy=None,
)


async def test_burst_of_simultaneous_connections_is_queued_not_reset(stack: PDStack) -> None:
    stack.start_proxy()
    stack.route([stack.sims["p0"], stack.sims["p1"]], [stack.sims["d0"], stack.sims["d1"]])
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one fresh connection per request
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=180)
    ) as session:

        async def one(i: int) -> tuple[int, bytes]:
            body = {"prompt": "hi", "max_tokens": 2, "stream": i % 2 == 1}
            async with session.post(stack.url + "/v1/completions", json=body) as resp:
                return resp.status, await resp.read()

        results = await asyncio.gather(*(one(i) for i in range(BURST)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException) or r[0] != 200]
    assert failures == []
    decode_legs = sum(sim.stats()["by_leg"]["decode"] for sim in (stack.sims["d0"], stack.sims["d1"]))
    assert decode_legs == BURST


def check_outcome(status: int, reason: str, stream: bool, body: bytes, tally: Counter[str]) -> None:
    """Either a full answer or a clear, specific error: nothing else is acceptable."""
    if status == 200 and stream:
        events = sse_events(body)
        assert events[-1] == "[DONE]", body
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        if errors:
            kind = next(k for k, (code, words) in STREAM_ERRORS.items() if words in errors[0]["message"])
            sse_error(json.dumps({"error": errors[0]}), STREAM_ERRORS[kind][0])
            tally[f"stream:{kind}"] += 1
        else:
            tally["ok"] += 1
    elif status == 200:
        assert json.loads(body)["choices"][0]["text"] == " tok0 tok1", body
        tally["ok"] += 1
    else:
        assert status in (502, 504), (status, body)
        assert reason in KNOWN_ERROR_REASONS, reason
        vllm_error(status, body)
        tally[f"{status}:{reason}"] += 1


async def test_soak_with_random_faults_stays_clean_and_bounded(stack: PDStack) -> None:
    stack.start_proxy(
        "--prefill-ttfb-timeout",
        "1",
        "--decode-ttfb-timeout",
        "1",
        "--stream-idle-timeout",
        "1",
        "--eject-seconds",
        "1",
    )
    healthy, faulty = [stack.sims["p0"], stack.sims["d0"]], [stack.sims["p1"], stack.sims["d1"]]
    stack.route([stack.sims["p0"], stack.sims["p1"]], [stack.sims["d0"], stack.sims["d1"]])
    assert stack.proxy is not None
    proxy = psutil.Process(stack.proxy.popen.pid)
    rng = random.Random(20261202)
    tally: Counter[str] = Counter()
    stop = asyncio.Event()

    async def chaos() -> None:
        while not stop.is_set():
            for sim in faulty:
                spec = f"{rng.choice(FAULTS)}@{rng.choice([0.3, 0.6, 1.0])}"
                await asyncio.to_thread(sim.faults, spec)
            await asyncio.sleep(2.0)

    # A request may take at most every attempt's deadline (3 x 1 s, with a margin): a client
    # timeout here would be a request that did not fail fast.
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker(n: int) -> None:
            while not stop.is_set():
                n += 1
                stream = n % 2 == 0
                body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
                async with session.post(stack.url + "/v1/completions", json=body) as resp:
                    reason = resp.headers.get("X-PDServe-Error", "")
                    check_outcome(resp.status, reason, stream, await resp.read(), tally)

        chaos_task = asyncio.create_task(chaos())
        workers = [asyncio.create_task(worker(i)) for i in range(16)]
        await asyncio.sleep(4.0)  # warm-up: pools and caches reach their working size
        fds_before, rss_before = proxy.num_fds(), proxy.memory_info().rss
        await asyncio.sleep(SOAK_SECONDS)
        stop.set()
        await asyncio.gather(chaos_task, *workers)
    for sim in faulty:
        sim.faults()
    await asyncio.sleep(1.0)
    fds_after, rss_after = proxy.num_fds(), proxy.memory_info().rss
    mib = (rss_before >> 20, rss_after >> 20)
    print(f"soak outcomes: {dict(tally)}; fds {fds_before}->{fds_after}; rss {mib[0]}->{mib[1]} MiB")
    assert tally["ok"] > sum(tally.values()) // 2
    assert fds_after <= fds_before + 40
    assert rss_after <= rss_before + 64 * 2**20
    for sim in healthy + faulty:
        assert sim.stats()["malformed_handoff"] == 0
    assert stack.complete().status == 200
