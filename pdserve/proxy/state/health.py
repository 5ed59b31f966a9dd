"""Per-slot bookkeeping: request counters, in-flight counts and ejection with a cool-down.

In-flight counts are kept by slot key (``<instance>/<rank>``), never by table generation, so a
request that started on generation N and still streams after N+1 removed its instance keeps
counting against that instance: this is what ``/routing/served`` reports, and what tells the
operator a draining pod is no longer in use.

A slot that failed (connect error, 5xx, deadline, bad handoff) is ejected for a while so the
next requests go elsewhere instead of paying the same failure again. An ejected slot is still
a last resort: policies order it after the live ones, so ejection alone never turns a
request away. An instance that refused a connection is *unreachable* for the same cool-down:
none of its slots is tried at all meanwhile.

A slot is *live* while it is neither ejected nor unreachable: the policies give the live slots
exact shares among themselves (pdserve.proxy.policies), whatever else is out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.routing import Role, Slot

if TYPE_CHECKING:
    from pdserve.proxy.state.shared import SharedDeadlines, SharedInFlight


@dataclass
class SlotState:
    requests: int = 0
    in_flight: int = 0  # legs being sent to or streamed from the slot
    pinned: int = 0  # prefill answered, its KV not yet pulled: the decode's first byte is pending
    errors: int = 0
    ejections: int = 0
    ejected_until: float = 0.0  # monotonic clock


class SlotBook:
    """Counters per (role, slot key); keys survive table reloads so counts stay comparable."""

    def __init__(
        self,
        eject_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedDeadlines | None = None,
        shared_in_flight: SharedInFlight | None = None,
        shared_unreachable: SharedDeadlines | None = None,
    ) -> None:
        self.eject_seconds = eject_seconds
        self.unreachable = Unreachable(eject_seconds, clock, shared_unreachable)
        self._clock = clock
        self._shared = shared  # worker processes: cool-downs are the router's, not one worker's
        self._shared_in_flight = shared_in_flight  # ... and so are the legs in flight per slot
        self._states: dict[tuple[Role, str], SlotState] = {}
        self._last_cool_down_end = 0.0  # no slot is ejected once the clock has passed it

    def state(self, role: Role, key: str) -> SlotState:
        entry = self._states.get((role, key))
        if entry is None:
            entry = self._states[(role, key)] = SlotState()
        return entry

    def in_flight(self, role: Role, key: str) -> int:
        """Legs in flight on the slot, router-wide (every worker's); ``state().in_flight`` is this
        process's own."""
        if self._shared_in_flight is not None:
            return self._shared_in_flight.total(role, key)
        return self.state(role, key).in_flight

    def _until(self, role: Role, key: str) -> float:
        if self._shared is not None:
            return self._shared.until(f"{role.value}/{key}")
        return self.state(role, key).ejected_until

    def ejected(self, role: Role, key: str) -> bool:
        return self._until(role, key) > self._clock()

    def any_ejected(self) -> bool:
        """False when no slot of any role is cooling down: one clock read, not one per slot."""
        if self._shared is not None:
            return self._shared.latest() > self._clock()
        return self._last_cool_down_end > self._clock()

    def all_live(self) -> bool:
        """True when no slot is ejected and no instance unreachable: two clock reads, the common case."""
        return not self.any_ejected() and not self.unreachable.any()

    def live(self, role: Role, slot: Slot) -> bool:
        return not self.ejected(role, slot.key) and self.unreachable.reachable(role, slot)

    def ejected_for(self, role: Role, key: str) -> float:
        """Seconds of cool-down left (0 when the slot is healthy)."""
        return max(0.0, self._until(role, key) - self._clock())

    def eject(self, role: Role, key: str) -> bool:
        """Start (or extend) the cool-down; True when the slot was healthy until now (with
        workers: in every worker; exactly one of them counts the ejection)."""
        entry = self.state(role, key)
        now = self._clock()
        newly = entry.ejected_until <= now
        entry.ejected_until = now + self.eject_seconds
        if self._shared is not None:
            newly = self._shared.extend(f"{role.value}/{key}", entry.ejected_until, now)
        self._last_cool_down_end = max(self._last_cool_down_end, entry.ejected_until)
        if newly:
            entry.ejections += 1
        return newly

    def started(self, role: Role, key: str) -> None:
        entry = self.state(role, key)
        entry.requests += 1
        entry.in_flight += 1
        if self._shared_in_flight is not None:
            self._shared_in_flight.add(role, key, 1)

    def finished(self, role: Role, key: str, ok: bool) -> None:
        entry = self.state(role, key)
        entry.in_flight -= 1
        if self._shared_in_flight is not None:
            self._shared_in_flight.add(role, key, -1)
        if not ok:
            entry.errors += 1

    def pin(self, role: Role, key: str) -> None:
        """A decode is about to pull this (prefill) slot's KV: the slot is still in use."""
        self.state(role, key).pinned += 1

    def unpin(self, role: Role, key: str) -> None:
        self.state(role, key).pinned -= 1

    def busy(self, role: Role, key: str) -> int:
        """Requests that still need the slot: legs in flight plus KV waiting to be pulled."""
        entry = self._states.get((role, key))
        return 0 if entry is None else entry.in_flight + entry.pinned

    def busy_slots(self) -> Iterator[tuple[Role, str, int]]:
        """``(role, key, busy)`` of every slot that is in use, whatever table it came from."""
        for (role, key), entry in self._states.items():
            count = entry.in_flight + entry.pinned
            if count > 0:
                yield role, key, count


class Unreachable:
    """Instances that refused a connection within the cool-down; they are not routed to. With
    worker processes the marks are shared (``shared``): one worker's refused connection keeps
    every worker away from the instance."""

    def __init__(
        self,
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedDeadlines | None = None,
    ) -> None:
        self.seconds = seconds
        self._clock = clock
        self._shared = shared
        self._until: dict[tuple[Role, str], float] = {}
        self._latest = 0.0  # nothing is unreachable once the clock has passed it

    def mark(self, role: Role, name: str) -> None:
        now = self._clock()
        until = now + self.seconds
        self._until[(role, name)] = until
        self._latest = max(self._latest, until)
        if self._shared is not None:
            self._shared.extend(_shared_key(role, name), until, now)

    def down_for(self, role: Role, name: str) -> float:
        """Seconds until the instance is tried again (0: reachable)."""
        if self._shared is not None:
            until = self._shared.until(_shared_key(role, name))
            if until > self._clock():
                self._until[(role, name)] = until  # listed by this worker's snapshot too
        found = self._until.get((role, name))
        if found is None:
            return 0.0
        left = found - self._clock()
        if left <= 0:
            del self._until[(role, name)]
            return 0.0
        return left

    def any(self) -> bool:
        """False when no instance is unreachable: one clock read, the common case."""
        if self._shared is not None:
            return self._shared.latest() > self._clock()
        return self._latest > self._clock()

    def reachable(self, role: Role, slot: Slot) -> bool:
        if not self.any():
            return True
        return self.down_for(role, slot.instance.name) == 0.0

    def retry_after(self, role: Role, slots: Sequence[Slot]) -> float:
        """The soonest any of ``slots`` is reachable again (0 when one is now)."""
        return min((self.down_for(role, s.instance.name) for s in slots), default=0.0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for role, name in list(self._until):
            left = self.down_for(role, name)
            if left:
                out.setdefault(role.value, {})[name] = round(left, 3)
        return out


def _shared_key(role: Role, name: str) -> str:
    return f"{role.value}/{name}"
