"""The operator's coalescer: bursts fold into one run, runs of one key never overlap, none is lost."""

from __future__ import annotations

import asyncio

from pdserve.operator.control.controller import Coalescer, Key

A: Key = ("ns", "a")
B: Key = ("ns", "b")


class Recorder:
    def __init__(self, hold: float = 0.0, again: float | None = None) -> None:
        self.runs: list[Key] = []
        self.active: dict[Key, int] = {}
        self.max_overlap = 0
        self.hold = hold
        self.again = again
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, key: Key) -> float | None:
        self.active[key] = self.active.get(key, 0) + 1
        self.max_overlap = max(self.max_overlap, self.active[key])
        self.runs.append(key)
        await self.release.wait()
        await asyncio.sleep(self.hold)
        self.active[key] -= 1
        again, self.again = self.again, None
        return again


async def settle(c: Coalescer, seconds: float = 0.1) -> None:
    await asyncio.sleep(seconds)


async def test_burst_of_requests_is_one_run() -> None:
    rec = Recorder()
    c = Coalescer(rec, debounce=0.02)
    for _ in range(100):
        c.request(A)
    await settle(c)
    assert rec.runs == [A]
    await c.close()


async def test_keys_run_independently() -> None:
    rec = Recorder()
    c = Coalescer(rec, debounce=0.01)
    c.request(A)
    c.request(B)
    c.request(A)
    await settle(c)
    assert sorted(rec.runs) == [A, B]
    await c.close()


async def test_request_during_a_run_gets_a_later_run_never_overlapping() -> None:
    rec = Recorder()
    rec.release.clear()
    c = Coalescer(rec, debounce=0.01)
    c.request(A)
    await asyncio.sleep(0.03)  # the first run has started and is blocked
    assert rec.runs == [A]
    c.request(A)
    c.request(A)
    await asyncio.sleep(0.03)
    assert rec.runs == [A]  # the second waits for the first
    rec.release.set()
    await settle(c)
    assert rec.runs == [A, A]
    assert rec.max_overlap == 1
    await c.close()


async def test_run_asking_to_run_again_is_rerun() -> None:
    rec = Recorder(again=0.02)
    c = Coalescer(rec, debounce=0.01)
    c.request(A)
    await settle(c, 0.15)
    assert rec.runs == [A, A]
    await c.close()


async def test_earliest_recheck_wins_and_forget_cancels() -> None:
    rec = Recorder()
    c = Coalescer(rec, debounce=0.0)
    c.request_later(A, 10.0)
    c.request_later(A, 0.02)
    c.request_later(B, 0.02)
    c.forget(B)
    await settle(c)
    assert rec.runs == [A]
    await c.close()
