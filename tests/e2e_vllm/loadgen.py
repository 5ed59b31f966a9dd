"""The small load the profile is fitted and checked with: token-id prompts (so real vLLM and the
simulator see exactly the same tokens, whatever their tokenizers), streamed, timed per chunk.

- ``ttft``: one request at a time, each prompt new (no cache hit), ``max_tokens`` 1: the time to
  the first chunk against the prompt's length.
- ``tpot``: ``c`` streams at once with short prompts: the time per output token, from the wall
  time of long and short streams (real vLLM on CPU sends several tokens in one write when its
  API server falls behind, so gaps between chunks, even a stream's own span, mean little)
  against the batch size.
- ``throughput``: ``c`` clients in a closed loop: completed requests per second.
- ``prefix``: prompts that share leading token runs, one at a time: the engine's prefix-cache
  counters before and after.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

#: Token ids of the tiny model's vocabulary, clear of its special tokens.
LOW, HIGH = 10, 1900


@dataclass
class Stream:
    first: float  # seconds to the first chunk
    total: float


class Load:
    def __init__(self, url: str, model: str, seed: int = 7) -> None:
        self.url = url
        self.model = model
        self.rng = random.Random(seed)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(LOW, HIGH) for _ in range(n)]

    async def stream(self, session: aiohttp.ClientSession, prompt: list[int], max_tokens: int) -> Stream:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        start = time.perf_counter()
        marks: list[float] = []
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise AssertionError(f"{self.url}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if event.startswith(b"data: {"):
                        marks.append(time.perf_counter())
        end = time.perf_counter()
        if not marks:
            raise AssertionError(f"{self.url}: a stream without chunks")
        return Stream(marks[0] - start, end - start)

    async def ttft(self, lengths: list[int], repeats: int = 7) -> dict[int, float]:
        """Median seconds to the first token per prompt length, one request at a time."""
        out = {}
        async with aiohttp.ClientSession() as session:
            for n in lengths:  # warm-up: every shape once
                await self.stream(session, self.ids(n), 2)
            for n in lengths:
                times = [(await self.stream(session, self.ids(n), 1)).first for _ in range(repeats)]
                out[n] = statistics.median(times)
        return out

    async def tpot(
        self, batches: list[int], prompt: int = 32, tokens: int = 64, repeats: int = 3
    ) -> dict[int, float]:
        """Seconds per output token with ``c`` streams decoding together: the wall time of ``c``
        streams of ``tokens`` less that of ``c`` streams of 2, over the ``tokens - 2`` more steps
        (medians of ``repeats``)."""
        out = {}
        async with aiohttp.ClientSession() as session:

            async def wall(c: int, n: int) -> float:
                start = time.perf_counter()
                await asyncio.gather(*(self.stream(session, self.ids(prompt), n) for _ in range(c)))
                return time.perf_counter() - start

            for c in batches:
                long = statistics.median([await wall(c, tokens) for _ in range(repeats)])
                short = statistics.median([await wall(c, 2) for _ in range(repeats)])
                out[c] = max(long - short, 0.0) / (tokens - 2)
        return out

    async def throughput(
        self, clients: list[int], per_client: int = 6, prompt: int = 64, tokens: int = 32
    ) -> dict[int, float]:
        """Requests per second with ``c`` clients each sending ``per_client`` requests back to back."""
        out = {}
        async with aiohttp.ClientSession() as session:

            async def client() -> None:
                for _ in range(per_client):
                    await self.stream(session, self.ids(prompt), tokens)

            for c in clients:
                start = time.perf_counter()
                await asyncio.gather(*(client() for _ in range(c)))
                out[c] = c * per_client / (time.perf_counter() - start)
        return out

    async def shared_prefixes(self, groups: int, per_group: int, prefix: int, suffix: int) -> list[list[int]]:
        """Prompts in ``groups`` of ``per_group`` sharing a ``prefix``-token start, interleaved."""
        starts = [self.ids(prefix) for _ in range(groups)]
        return [starts[g] + self.ids(suffix) for _ in range(per_group) for g in range(groups)]

    async def send_each(self, prompts: list[list[int]], tokens: int = 2) -> None:
        async with aiohttp.ClientSession() as session:
            for prompt in prompts:
                await self.stream(session, prompt, tokens)


def linear_fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b
