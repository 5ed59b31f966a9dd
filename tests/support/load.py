"""A bounded streaming load generator for end-to-end tests against real routers.

Why its own event loop in a thread: the tests drive kubectl and the operator synchronously while
the load runs, and read every request's outcome afterwards (which router, when it started and
ended, whether the stream reached ``[DONE]``). It stops by itself after ``max_seconds`` or
``max_requests``, so a test that forgets to stop it still ends.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Outcome:
    router: str
    started: float
    ended: float = 0.0
    status: int = 0
    done: bool = False  # the stream ended with [DONE] and carried no error event
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error


@dataclass
class StreamLoad:
    """``concurrency`` clients, each sending streaming completions one after another.

    ``routers`` is called before every request, so a test can change the set of router URLs
    while the load runs (a router pod replaced, for instance).
    """

    routers: Callable[[], Sequence[str]]
    model: str
    concurrency: int = 32
    max_tokens: int = 16
    max_seconds: float = 300.0
    max_requests: int = 200_000
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StreamLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.max_seconds + 60)
        return list(self.outcomes)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ended and not o.ok]

    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    async def _main(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        budget = itertools.count()
        timeout = aiohttp.ClientTimeout(total=120, sock_connect=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def client(n: int) -> None:
                pick = itertools.count(n)
                while not self._stop.is_set() and time.monotonic() < deadline:
                    if next(budget) >= self.max_requests:
                        return
                    urls = list(self.routers())
                    if not urls:
                        await asyncio.sleep(0.05)
                        continue
                    await self._one(session, urls[next(pick) % len(urls)])

            await asyncio.gather(*(client(n) for n in range(self.concurrency)))

    async def _one(self, session: aiohttp.ClientSession, router: str) -> None:
        outcome = Outcome(router=router, started=time.time())
        self.outcomes.append(outcome)
        body = {"model": self.model, "prompt": "hello " * 8, "max_tokens": self.max_tokens, "stream": True}
        try:
            async with session.post(f"{router}/v1/completions", json=body) as resp:
                outcome.status = resp.status
                data = await resp.read()
            text = data.decode(errors="replace")
            outcome.done = text.rstrip().endswith("data: [DONE]")
            if '"error"' in text:
                outcome.error = text[-300:]
            elif resp.status != 200:
                outcome.error = text[:300]
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        finally:
            outcome.ended = time.time()
