"""Back-pressure: a per-slot limit on legs in flight, and a bounded admission queue with a deadline.

Without a limit the proxy would open as many connections to an engine as clients send
requests, and nothing would ever push back. Here every slot (one engine rank) takes at most
``limit`` legs at once. A request whose chosen slots are full waits in the admission queue,
in arrival order, until a leg somewhere finishes and its slots have room again; at most
``queue_size`` requests wait, each at most ``timeout`` seconds. A request that finds the queue
full, or whose deadline passes, is *shed*: 429 with ``Retry-After`` and vLLM's error body.

The policy's candidate order is kept: slots with room come first (a stable partition), so an
unsaturated router routes exactly as before (flat interleave untouched), and a saturated one
gives the request the next slot of its order that has room. The limit is soft by the requests
between their admission and their decode leg (a few milliseconds of prefill): the decode slot's
room is checked at admission, not reserved.

The decisions (:func:`has_room`, :func:`room_first`, :func:`shed_reply`) are pure; the queue
is the only state.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.proxy.flow.reply import Reply, error_reply
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot

if TYPE_CHECKING:  # prometheus_client must load only after the worker set-up (pdserve.proxy.serving.workers)
    from pdserve.proxy.metrics import ProxyMetrics

#: With worker processes, how often waiters look for room another worker's leg freed.
ADMISSION_POLL_S = 0.01
#: ... and how many waiters one look may wake (each checks again when it runs: the room it was
#: woken for may have gone to the one before it, then it is first in line again).
POLL_WAKES = 16
#: What a shed request's Retry-After says.
RETRY_AFTER_S = 1

SHED_QUEUE_FULL = "queue_full"
SHED_QUEUE_TIMEOUT = "queue_timeout"


def has_room(role: Role, slot: Slot, book: SlotBook, limit: int) -> bool:
    return limit <= 0 or book.in_flight(role, slot.key) < limit


def room_first(role: Role, ordered: Sequence[Slot], book: SlotBook, limit: int) -> list[Slot]:
    """Stable partition: slots with room in their order, then full ones (retries may still use
    them: the limit bounds first choices, not a retry after a failure)."""
    if limit <= 0:
        return list(ordered)
    roomy = [s for s in ordered if has_room(role, s, book, limit)]
    if len(roomy) == len(ordered):
        return list(ordered)
    return roomy + [s for s in ordered if not has_room(role, s, book, limit)]


def shed_reply(reason: str, queue_size: int, timeout: float) -> Reply:
    """429 in vLLM's shape, with Retry-After; ``reason`` is ``queue_full`` or ``queue_timeout``."""
    if reason == SHED_QUEUE_FULL:
        message = f"the router is saturated: {queue_size} requests already wait for a free engine slot"
    else:
        message = f"no engine slot became free within {timeout:g} s"
    return error_reply(
        429, message + "; retry later", reason, ((b"retry-after", str(RETRY_AFTER_S).encode()),)
    )


@dataclass(eq=False)
class _Waiter:
    ready: Callable[[], bool]
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(eq=False)
class AdmissionGate:
    """The admission queue: FIFO, bounded, with a deadline; :meth:`release` after every leg."""

    limit: int  # legs in flight per slot; 0: no limit
    queue_size: int
    timeout: float
    metrics: ProxyMetrics
    poll_seconds: float | None = None  # room may also come free where release() is not called
    _waiters: deque[_Waiter] = field(default_factory=deque, init=False, repr=False)
    _poller: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)

    @property
    def depth(self) -> int:
        return len(self._waiters)

    async def admit(self, ready: Callable[[], bool]) -> str | None:
        """None once ``ready()`` holds (at once when nobody waits and it holds now), else the
        reason the request is shed (``queue_full``, ``queue_timeout``)."""
        if self.free_now(ready):
            return None
        return await self.wait(ready)

    def free_now(self, ready: Callable[[], bool]) -> bool:
        """Whether a request may go at once: nobody waits and ``ready()`` holds."""
        return not self._waiters and ready()

    async def wait(self, ready: Callable[[], bool]) -> str | None:
        """:meth:`admit` past its fast path: in the queue until ``ready()`` holds, or shed."""
        if len(self._waiters) >= self.queue_size:
            self.metrics.shed.labels(SHED_QUEUE_FULL).inc()
            return SHED_QUEUE_FULL
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter = _Waiter(ready)
        self._waiters.append(waiter)
        self.metrics.queue_depth.inc()
        if self.poll_seconds is not None and self._poller is None:
            self._poller = loop.call_later(self.poll_seconds, self._poll)
        admitted = False
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    await waiter.future
                    if ready():
                        admitted = True
                        return None
                    # Woken, but the room went to someone else meanwhile: first in line again.
                    waiter.future = loop.create_future()
                    self._waiters.appendleft(waiter)
                    self.metrics.queue_depth.inc()
        except TimeoutError:
            self.metrics.shed.labels(SHED_QUEUE_TIMEOUT).inc()
            return SHED_QUEUE_TIMEOUT
        finally:
            if self._remove(waiter):
                self.metrics.queue_depth.dec()
            self.metrics.queue_wait.observe(loop.time() - started)
            if not admitted:  # shed or cancelled: the room it may have been woken for is free
                self._wake()

    def release(self) -> None:
        """A leg finished: its slot has room again; wake the first waiter that now fits."""
        if self._waiters:
            self._wake()

    def _poll(self) -> None:
        self._poller = None
        for _ in range(POLL_WAKES):
            if not self._wake():
                break
        if self._waiters and self.poll_seconds is not None:
            self._poller = asyncio.get_running_loop().call_later(self.poll_seconds, self._poll)

    def _wake(self) -> bool:
        """Wake the first waiter if it fits now; whether one was woken."""
        for waiter in self._waiters:
            if waiter.future.done():
                continue
            if waiter.ready():
                self._waiters.remove(waiter)
                self.metrics.queue_depth.dec()
                waiter.future.set_result(None)
                return True
            return False
        return False

    def _remove(self, waiter: _Waiter) -> bool:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        return True
