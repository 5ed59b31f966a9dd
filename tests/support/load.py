"""Streaming load against routers that come and go, for the cluster e2e tests and benchmarks.

``Load`` keeps ``concurrency`` clients streaming completions in a loop, spread round-robin
over the router addresses ``targets()`` returns (re-read every second, as a Service's
endpoints would be), and records every answer that was not a whole stream.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class LoadResult:
    ok: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (router address, what went wrong)


class Load:
    def __init__(
        self,
        targets: Callable[[], list[str]],
        concurrency: int,
        max_tokens: int = 16,
        model: str = "sim-model",
        prompt_words: int = 0,
    ) -> None:
        """``prompt_words``: that many words after a number of the request's own (a longer prefill
        that no prefix cache holds)."""
        self.targets = targets
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.model = model
        self.padding = " word" * prompt_words
        self.result = LoadResult()
        self._stop = threading.Event()
        self._current: list[str] = targets()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._refresher = threading.Thread(target=self._refresh, daemon=True)

    def __enter__(self) -> Load:
        assert self._current, "no router to send load to"
        self._thread.start()
        self._refresher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        self._thread.join(timeout=60)
        self._refresher.join(timeout=10)
        return self.result

    def _refresh(self) -> None:
        while not self._stop.wait(1.0):
            try:
                current = self.targets()
            except Exception:  # keep the last list while the API server hiccups
                continue
            if current:
                self._current = current

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        n = index
        while not self._stop.is_set():
            current = self._current
            target = current[n % len(current)]
            n += 1
            body = {
                "model": self.model,
                "prompt": f"hello {n}-{index}{self.padding}" if self.padding else f"hello {n}",
                "max_tokens": self.max_tokens,
                "stream": True,
            }
            try:
                async with session.post(f"http://{target}/v1/completions", json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        self.result.failed.append((target, f"HTTP {resp.status}: {text[:200]}"))
                    elif "data: [DONE]" not in text or '"error"' in text:
                        self.result.failed.append((target, f"incomplete stream: {text[-200:]}"))
                    else:
                        self.result.ok += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.result.failed.append((target, f"{type(exc).__name__}: {exc}"))
