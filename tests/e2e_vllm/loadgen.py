"""The small load the profile is fitted and checked with: token-id prompts (so real vLLM and the
simulator see exactly the same tokens, whatever their tokenizers), streamed, timed per chunk.

Every measurement is a single shot; :func:`side_by_side` has the engines take turns, round by
round, so the moods of a shared machine fall on all of them alike and their ratios hold:

- ``ttft``: one request alone, a new prompt (no cache hit), ``max_tokens`` 1: the time to the
  first chunk, against the prompt's length.
- ``throughput``: ``c`` clients in a closed loop: completed requests per second (the time per
  decode step is taken from it: real vLLM on CPU sends several tokens in one write when its API
  server falls behind, so gaps between chunks mean little).
- ``wall``: ``c`` streams at once (the warm-up).
- ``send_each``: prompts one at a time (shared prefixes: the prefix-cache counters move).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import aiohttp

#: Token ids of the tiny model's vocabulary, clear of its special tokens.
LOW, HIGH = 10, 1900
K = TypeVar("K")


class Load:
    def __init__(
        self, url: str, model: str, session: aiohttp.ClientSession | None = None, seed: int = 7
    ) -> None:
        self.url = url
        self.model = model
        self.session = session
        self.rng = random.Random(seed)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(LOW, HIGH) for _ in range(n)]

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """Seconds to the first chunk and to the end of one streamed completion."""
        assert self.session is not None
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        start = time.perf_counter()
        first = None
        async with self.session.post(self.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise AssertionError(f"{self.url}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
            async for data in resp.content.iter_any():
                if first is None and b"data: {" in data:
                    first = time.perf_counter() - start
        if first is None:
            raise AssertionError(f"{self.url}: a stream without chunks")
        return first, time.perf_counter() - start

    async def ttft(self, n: int) -> float:
        return (await self.stream(self.ids(n), 1))[0]

    async def wall(self, c: int, tokens: int, prompt: int = 32) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(self.stream(self.ids(prompt), tokens) for _ in range(c)))
        return time.perf_counter() - start

    async def throughput(self, c: int, per_client: int = 6, prompt: int = 64, tokens: int = 32) -> float:
        async def client() -> None:
            for _ in range(per_client):
                await self.stream(self.ids(prompt), tokens)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c)))
        return c * per_client / (time.perf_counter() - start)

    async def send_each(self, prompts: list[list[int]], tokens: int = 2) -> None:
        for prompt in prompts:
            await self.stream(prompt, tokens)


async def side_by_side(
    loads: Mapping[str, Load],
    points: Sequence[K],
    shot: Callable[[Load, K], Awaitable[float]],
    repeats: int,
) -> dict[str, dict[K, float]]:
    """The first quartile of ``repeats`` rounds per engine and point. Engines take turns round by round (in
    the reverse order every other round); within its turn an engine gets one shot per point back
    to back, so it stays as busy as under a steady load (a real engine core left idle between two
    requests answers the next one later, woken on a busy machine)."""
    got: dict[str, dict[K, list[float]]] = {name: {p: [] for p in points} for name in loads}
    names = list(loads)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            for point in points:
                got[name][point].append(await shot(loads[name], point))
    return {name: {p: low_quartile(v) for p, v in table.items()} for name, table in got.items()}


def low_quartile(values: Sequence[float]) -> float:
    """The first quartile: robust to the bursts of others' work on a shared machine, which only
    ever make a shot slower (and to a lucky shot, unlike the minimum)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def shared_prefixes(seed: int, groups: int, per_group: int, prefix: int, suffix: int) -> list[list[int]]:
    """Prompts in ``groups`` of ``per_group`` sharing a ``prefix``-token start, interleaved."""
    load = Load("", "", seed=seed)
    starts = [load.ids(prefix) for _ in range(groups)]
    return [starts[g] + load.ids(suffix) for _ in range(per_group) for g in range(groups)]


def linear_fit(points: Mapping[int, float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b
