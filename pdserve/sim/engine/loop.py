"""The engine of one DP rank in time: a loop that schedules a step, sleeps for what the
profile says the step costs, then hands out the step's tokens. One asyncio task per rank; no
CPU is burnt to model time, and one step serves every request in its batch.

Also the P/D parts that take time: a decode leg's KV pull (the profile's transfer time) and a
prefill leg's lease (its blocks are held until the decode says it pulled them, or the lease
ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import traceback
from collections.abc import Callable

from pdserve.sim.engine.metrics import RankMetrics
from pdserve.sim.engine.profile import Profile
from pdserve.sim.engine.request import Request
from pdserve.sim.engine.scheduler import EngineConfig, Scheduler

#: How far behind its schedule a busy engine may catch up (seconds); beyond, it starts afresh.
MAX_LAG = 0.05


class RankEngine:
    def __init__(
        self,
        rank: int,
        config: EngineConfig,
        profile: Profile,
        on_pulled: Callable[[Request], None] | None = None,
    ) -> None:
        self.rank = rank
        self.config = config
        self.profile = profile
        self.scheduler = Scheduler(config)
        self.metrics = RankMetrics()
        self.on_pulled = on_pulled
        self._wake = asyncio.Event()
        self._waiters: dict[int, asyncio.Future[None]] = {}  # id(request) -> its handler's wait
        self._task: asyncio.Task[None] | None = None
        self._pulls: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-rank-{self.rank}")
            self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A bug in the engine must not leave its requests waiting in silence."""
        if task.cancelled() or task.exception() is None:
            return
        print(f"pdserve sim: engine of rank {self.rank} failed:", file=sys.stderr)
        traceback.print_exception(task.exception(), file=sys.stderr)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(RuntimeError(f"the engine of rank {self.rank} failed"))

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._pulls) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None

    # --- the handlers' side -----------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """The request reaches the engine's queue after the profile's frontend time."""
        loop = asyncio.get_running_loop()
        request.arrival = loop.time()
        delay = self.profile.request.frontend_ms / 1000
        if delay > 0:
            loop.call_later(delay, self._enqueue, request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if request.is_finished:  # aborted before it got here
            return
        self.scheduler.add(request)
        self._wake.set()

    async def wait(self, request: Request, seen: int) -> int:
        """Until the request has more than ``seen`` output tokens or is over; its token count."""
        while request.num_output_tokens <= seen and not request.is_finished:
            future = asyncio.get_running_loop().create_future()
            self._waiters[id(request)] = future
            try:
                await future
            finally:
                self._waiters.pop(id(request), None)
        return request.num_output_tokens

    def abort(self, request: Request) -> None:
        if not request.is_finished:
            self.scheduler.abort(request)
            self._wake.set()

    def release(self, request_id: str) -> bool:
        """A decode pulled this finished prefill leg's KV."""
        released = self.scheduler.release_held(request_id)
        if released:
            self._wake.set()
        return released

    # --- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        planned: float | None = None  # when the previous step was due to end, while busy
        while True:
            now = loop.time()
            if sched.expire_leases(now):
                self.metrics.expired_leases = sched.counters.expired_leases
            step = sched.schedule(now) if sched.has_work else None
            if step is None or step.empty:
                if step is not None:
                    self._start_pulls(step.pulls)
                    if step.preempted:  # it preempted itself: admit it again at once
                        continue
                planned = None
                await self._idle(loop)
                continue
            self._start_pulls(step.pulls)
            cost = self.profile.step_seconds(step.prefill_tokens, step.decode_seqs, step.context_tokens)
            # Back to back, a step starts when the previous one was due to end: waking up late on a
            # busy machine shortens the next sleep, so the steps keep the profile's pace on average.
            start = now if planned is None or now - planned > MAX_LAG else planned
            planned = start + cost
            await asyncio.sleep(max(0.0, planned - loop.time()))
            end = loop.time()
            emitted = sched.finish_step(step, end)
            self.metrics.on_step(step, emitted, end)
            for request in emitted:
                waiter = self._waiters.get(id(request))
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to compute: wait for an arrival, a finished pull, freed blocks or a lease end."""
        self._wake.clear()
        expiry = self.scheduler.next_lease_expiry()
        if expiry is None:  # the common case: no timer, no task
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, expiry - loop.time()))

    def _start_pulls(self, requests: list[Request]) -> None:
        for request in requests:
            task = asyncio.get_running_loop().create_task(self._pull(request))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)

    async def _pull(self, request: Request) -> None:
        seconds = self.profile.transfer_seconds(request.num_external_tokens)
        await asyncio.sleep(seconds)
        self.metrics.on_pull(request, seconds)
        self.scheduler.remote_kv_loaded(request)
        self._wake.set()
        if self.on_pulled is not None:
            self.on_pulled(request)
