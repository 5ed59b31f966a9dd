"""One router, two worker processes (issue 13, item 2), through real `pdserve sim` processes.

* Connections are spread over both workers (SO_REUSEPORT), and the flat interleave is still
  exact for the router as a whole (one counter per role in shared memory). A few long-lived
  connections end up evenly spread (a worker over its share closes one after its response).
* A new table is served by every worker within one reload interval; the window is measured from
  the workers' own ``loaded_at`` (``/routing/served`` lists them).
* ``/routing/served`` and ``/metrics`` answer for the whole router: in-flight streams held by
  both workers are all counted, whichever worker answers.
* A worker that dies is started again; SIGTERM stops the router with status 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from tests.support.pdstack import (
    PDStack,
    decode_sim,
    eventually,
    http,
    module_stack,
    prefill_sim,
    proxy_args,
    proxy_metric,
)
from tests.support.procs import Proc

WORKERS = 2
#: The routing file's poll interval (the proxy's default) and the slack of a loaded machine.
RELOAD_INTERVAL_S = 0.2
SWAP_WINDOW_BOUND_S = RELOAD_INTERVAL_S + 0.3


stack = module_stack(
    "workers",
    {
        "p0": prefill_sim(2),
        "p1": prefill_sim(1),
        "d0": decode_sim(3),
        "dslow": decode_sim(1, 1, "--itl-ms", "400", "--tokens", "10"),
    },
    routed=(["p0", "p1"], ["d0"]),
    proxy=["--workers", str(WORKERS)],
)


def served(url: str) -> dict:  # type: ignore[type-arg]
    answer = http("GET", url + "/routing/served")
    assert answer.status == 200, answer.body
    return answer.json()  # type: ignore[no-any-return]


async def _many(url: str, n: int, stream: bool = False) -> list[int]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a new connection per request
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one() -> int:
            body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one() for _ in range(n)))


def test_both_workers_serve_and_the_interleave_stays_exact(stack: PDStack) -> None:
    s = stack.sims
    stack.route([s["p0"], s["p1"]], [s["d0"]])
    before = {w["worker"]: w["requests"] for w in served(stack.url)["workers"]}
    n = 3 * 3 * 8  # prefill: 3 slots, decode: 3 slots; 24 turns each
    assert asyncio.run(_many(stack.url, n)) == [200] * n
    workers = served(stack.url)["workers"]
    assert [w["worker"] for w in workers] == list(range(WORKERS))
    took = [w["requests"] - before[w["worker"]] for w in workers]
    assert sum(took) == n and all(t > 0 for t in took), took  # the kernel spread the connections
    assert s["p0"].stats()["by_rank"] == {"0": n // 3, "1": n // 3}
    assert s["p1"].stats()["by_rank"] == {"0": n // 3}
    assert s["d0"].stats()["by_rank"] == {"0": n // 3, "1": n // 3, "2": n // 3}
    # the metrics are the router's: every request, whichever worker served it
    requests = proxy_metric(stack.url, "pdserve_proxy_upstream_requests_total", role="prefill", outcome="ok")
    assert requests >= n


def test_a_few_long_lived_connections_end_up_evenly_spread(stack: PDStack) -> None:
    """A gateway's small pool of keep-alive connections: the kernel's hash alone puts 6 or more of
    8 on one worker in about 29 % of starts; here each worker serves close to half."""
    s = stack.sims
    stack.route([s["p0"], s["p1"]], [s["d0"]])
    before = {w["worker"]: w["requests"] for w in served(stack.url)["workers"]}
    pool, each = 8, 40

    async def gateway() -> list[int]:
        connector = aiohttp.TCPConnector(limit=pool)  # keep-alive: connections are reused
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def client() -> list[int]:
                statuses = []
                for _ in range(each):
                    body = {"prompt": "hi", "max_tokens": 2}
                    async with session.post(stack.url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                return statuses

            per_client = await asyncio.gather(*(client() for _ in range(pool)))
            return [status for statuses in per_client for status in statuses]

    assert asyncio.run(gateway()) == [200] * (pool * each)
    took = [w["requests"] - before[w["worker"]] for w in served(stack.url)["workers"]]
    assert sum(took) == pool * each
    assert min(took) >= 0.42 * pool * each, took  # the hash alone: 3 of 8 or fewer in 73 % of starts


def test_every_worker_swaps_to_a_new_table_within_one_reload(stack: PDStack) -> None:
    s = stack.sims
    windows = []
    for _ in range(3):
        doc = stack.table([s["p0"]], [s["d0"]])
        stack.write(doc, wait=False)
        deadline = time.monotonic() + 10
        while True:
            view = served(stack.url)
            if all(w["generation"] == doc["generation"] for w in view["workers"]):
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.02)
        assert view["generation"] == doc["generation"]
        loaded = [w["loaded_at"] for w in view["workers"]]
        windows.append(max(loaded) - min(loaded))
    print(f"swap windows between workers (s): {[round(w, 4) for w in windows]}")
    assert max(windows) < SWAP_WINDOW_BOUND_S, windows


def test_routing_served_counts_the_streams_of_every_worker(stack: PDStack) -> None:
    s = stack.sims
    stack.route([s["p0"]], [s["dslow"]])
    streams = 6

    async def hold() -> list[int]:
        task = asyncio.create_task(_many(stack.url, streams, stream=True))
        seen = []
        while not task.done():  # every answer, whichever worker took the admin request
            view = await asyncio.to_thread(served, stack.url)
            seen.append(view["instances"].get("dslow", {}).get("in_flight", 0))
            if streams in seen:
                break
            await asyncio.sleep(0.1)
        await task
        return seen

    seen = asyncio.run(hold())
    assert streams in seen, seen  # all six at once, although two workers hold them
    eventually(lambda: served(stack.url)["instances"]["dslow"]["in_flight"] == 0)
    assert proxy_metric(stack.url, "pdserve_proxy_in_flight") == 0


def test_the_per_slot_limit_is_the_routers_not_each_workers(stack: PDStack) -> None:
    s = stack.sims
    stack.route([s["p0"]], [s["d0"]])
    # A first byte slow enough that the six requests all arrive within the first round, even when a
    # loaded machine starts their connections late (at 600 ms a straggler once found room: no wait).
    first_byte = 1.5
    s["d0"].faults({"kind": "slow-first-byte", "ms": round(first_byte * 1000), "roles": ["decode"]})  # type: ignore[arg-type]
    args = proxy_args(stack.routing_file, "--host", "127.0.0.1", "--workers", str(WORKERS))
    proc = stack.group.start("proxy-limit", [*args, "--max-per-slot", "1"], health="/ready")
    try:
        started = time.monotonic()
        assert asyncio.run(_many(proc.url, 6)) == [200] * 6  # 3 decode ranks, one leg each at a time
        elapsed = time.monotonic() - started
        # Two rounds: a limit per worker would let both workers' requests in at once (one round).
        assert elapsed >= 2 * first_byte - 0.05, elapsed
        # Some waited for room. Not necessarily three: the limit is soft by a request's prefill (a
        # decode's room is checked when the pair is chosen, counted when its leg starts; see
        # pdserve/proxy/flow/admission.py), so a request admitted in that instant may share a rank.
        assert proxy_metric(proc.url, "pdserve_proxy_admission_wait_seconds_count") >= 1
    finally:
        proc.stop()
        s["d0"].faults()


def _worker_pids(proxy: Proc) -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process(proxy.popen.pid).children()]


def test_a_dead_worker_is_started_again(stack: PDStack) -> None:
    s = stack.sims
    stack.route([s["p0"]], [s["d0"]])
    assert stack.proxy is not None
    pids = _worker_pids(stack.proxy)
    assert len(pids) == WORKERS
    os.kill(pids[0], signal.SIGKILL)
    eventually(lambda: len(set(_worker_pids(stack.proxy)) - set(pids)) == 1, timeout=15)  # type: ignore[arg-type]

    # Until the new worker listens, the whole-router view is 503 (never a partial count): poll.
    def whole() -> bool:
        answer = http("GET", stack.url + "/routing/served")
        return answer.status == 200 and len(answer.json()["workers"]) == WORKERS

    eventually(whole, timeout=15)
    assert asyncio.run(_many(stack.url, 20)) == [200] * 20


def test_sigterm_stops_every_worker_and_exits_0(stack: PDStack) -> None:
    args = proxy_args(stack.routing_file, "--host", "127.0.0.1", "--workers", str(WORKERS))
    proc = stack.group.start("proxy-stop", args, health="/ready")
    pids = _worker_pids(proc)
    assert len(pids) == WORKERS
    assert json.loads(http("GET", proc.url + "/health").body)["status"] == "ok"
    assert proc.stop(grace=30) == 0
    import psutil

    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)
