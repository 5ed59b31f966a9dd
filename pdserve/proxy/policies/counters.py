"""The routing policies' counters: one per (role, group), in this process or shared by workers.

Flat-interleaved gives every slot exactly k of k·S consecutive requests because ONE counter per
role hands out consecutive turns. With several worker processes (pdserve.proxy.serving.workers) that
counter must stay one: pdserve.proxy.state.shared.SharedCounters keeps it in shared memory and every
worker takes its turn with an atomic fetch-and-increment under a process-shared lock. A
lock-free scheme (one counter per worker, interleaved) would be exact only while every worker
got the same share of the traffic, which the kernel's connection hashing does not promise; the
lock keeps the guarantee whatever the spread.
"""

from __future__ import annotations

from typing import Protocol


class Counters(Protocol):
    def take(self, role: str, group: str) -> int:
        """The counter's value before this call; the counter advances by one."""
        ...


class LocalCounters:
    """One process's counters (a single process, or the tests)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], int] = {}

    def take(self, role: str, group: str) -> int:
        key = (role, group)
        value = self._values.get(key, 0)
        self._values[key] = value + 1
        return value
