"""Load generator of the proxy benchmark, run as its own process (uvloop, aiohttp).

Why a separate process: the client must not share a core's event loop with the servers it
measures. Input: one JSON object as argv[1]; output: one JSON object on stdout.

    {"url": "http://127.0.0.1:8000", "mode": "stream" | "burst", "requests": 2000,
     "concurrency": 64, "tokens": 8, "timeout_s": 60, "stream": true}

``stream``: ``requests`` completions, at most ``concurrency`` in flight over a keep-alive pool.
``burst``: ``requests`` requests started at once, each on its own new TCP connection, so the
server faces that many simultaneous connects. ``"stream": false`` asks for buffered answers.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections import Counter
from typing import Any

import aiohttp

DONE = b"data: [DONE]"


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], tokens: int
) -> tuple[float, str | None]:
    """Streams must end with [DONE] and carry every token; a buffered answer must be a completion."""
    """Latency in seconds and None, or the failure's kind."""
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            raw = await resp.read()
            if resp.status != 200:
                return time.perf_counter() - start, f"http-{resp.status}"
    except aiohttp.ClientConnectionError as exc:
        return time.perf_counter() - start, type(exc).__name__
    except aiohttp.ClientPayloadError:
        return time.perf_counter() - start, "broken-stream"
    except TimeoutError:
        return time.perf_counter() - start, "timeout"
    elapsed = time.perf_counter() - start
    if not body["stream"]:
        return elapsed, None if raw.startswith(b"{") and b'"choices"' in raw else "not-a-completion"
    if DONE not in raw[-32:]:
        return elapsed, "no-[DONE]"
    if raw.count(b'"text":" tok') != tokens:
        return elapsed, "wrong-token-count"
    return elapsed, None


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    url = spec["url"].rstrip("/") + "/v1/completions"
    tokens = int(spec.get("tokens", 8))
    body = {
        "model": spec.get("model", "sim-model"),
        "prompt": "bench " * 32,
        "max_tokens": tokens,
        "stream": bool(spec.get("stream", True)),
    }
    requests = int(spec["requests"])
    timeout = aiohttp.ClientTimeout(total=float(spec.get("timeout_s", 60)))
    burst = spec["mode"] == "burst"
    connector = (
        aiohttp.TCPConnector(limit=0, force_close=True)
        if burst
        else aiohttp.TCPConnector(limit=int(spec["concurrency"]))
    )
    latencies: list[float] = []
    failures: Counter[str] = Counter()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def record() -> None:
            elapsed, failure = await one_request(session, url, body, tokens)
            if failure is None:
                latencies.append(elapsed)
            else:
                failures[failure] += 1

        start = time.perf_counter()
        if burst:
            await asyncio.gather(*(record() for _ in range(requests)))
        else:
            remaining = iter(range(requests))

            async def worker() -> None:
                for _ in remaining:
                    await record()

            await asyncio.gather(*(worker() for _ in range(int(spec["concurrency"]))))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "latencies_s": latencies, "failures": dict(failures), "requests": requests}


def main() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a burst needs one socket per request
    spec = json.loads(sys.argv[1])
    try:
        import uvloop

        result = uvloop.run(run(spec))
    except ImportError:  # pragma: no cover
        result = asyncio.run(run(spec))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
