"""The retry policy of one P/D request: which instances may be tried, when a prefill's KV
handoff may go to another decode, and what the client sees when the attempts run out.

* A failure of the *connection* to an instance (refused, reset, cut) is the instance's, not one
  engine rank's: all DP ranks of a vLLM server share its HTTP endpoint. Every slot of the
  instance is ejected at once, so the retry goes to another instance. A connection that was
  refused (or could not be opened in time) also marks the instance *unreachable* for the
  cool-down: it is not tried at all meanwhile, and when a role has no reachable instance left
  the router answers 503 with Retry-After *before* spending a prefill.
* A decode that failed is retried with the same handoff (no new prefill) only when the request
  never reached it (a connect error) and the prefill still holds the KV. vLLM frees a
  prefill's KV once a decode pulled it, when a decode aborts or rejects the request (its
  serving layer tells the prefill to free the blocks), and when the KV lease expires
  (``kv_lease_duration``, 30 s by default in vLLM's NIXL pull mode, extended by the decode's
  heartbeats only once the decode holds the request; 480 s ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``
  in older vLLM). So any answer, reset or deadline from the decode means a new prefill, and a
  handoff is reused only while less than half of ``--kv-lease-seconds`` has passed since the
  prefill answered (the other half is headroom for the retried decode to start its pull).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.proxy.engine.upstream import LegError
from pdserve.proxy.flow.reply import Reply, error_reply
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot, SlotTable

if TYPE_CHECKING:
    from pdserve.proxy.state.shared import SharedDeadlines

#: Outcomes that are the connection's failure, not one engine rank's: the whole instance is ejected.
TRANSPORT_OUTCOMES = frozenset({"connect_error", "dropped"})
#: The request never reached the instance: it is unreachable, and a handoff sent to it is intact.
UNREACHABLE_OUTCOME = "connect_error"
#: The engine is saturated (503/429): try another slot, but this one is not failing (no ejection).
BUSY_OUTCOME = "busy"


class LegFailure(Exception):
    def __init__(self, role: Role, slot: Slot, error: LegError) -> None:
        super().__init__(f"{role.value} {slot.key}: {error.detail}")
        self.role = role
        self.slot = slot
        self.error = error


@dataclass(frozen=True)
class Handoff:
    """A prefill's validated ``kv_transfer_params`` (None: the connector needs none) and when they came."""

    params: Mapping[str, Any] | None
    prefill: Slot
    received: float  # monotonic clock


def handoff_reusable(
    handoff: Handoff | None, failure: LegFailure, reusable: bool, lease_seconds: float, now: float
) -> bool:
    """May the next decode attempt use ``handoff`` instead of a new prefill (see the module doc)?"""
    return (
        reusable
        and handoff is not None
        and failure.role is Role.DECODE
        and failure.error.outcome == UNREACHABLE_OUTCOME
        and now - handoff.received < lease_seconds / 2
    )


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


def next_candidate(
    role: Role, remaining: list[Slot], book: SlotBook, unreachable: Unreachable
) -> Slot | None:
    """Take the next slot to try: reachable and healthy first, then reachable but ejected
    (a last resort: ejection alone never turns a request away); unreachable ones never."""
    if not unreachable.any() and not book.any_ejected():
        return remaining.pop(0) if remaining else None
    reachable = [s for s in remaining if unreachable.reachable(role, s)]
    if not reachable:
        remaining.clear()
        return None
    chosen = next((s for s in reachable if not book.ejected(role, s.key)), reachable[0])
    remaining.remove(chosen)
    return chosen


def retry_after_header(seconds: float) -> tuple[tuple[bytes, bytes], ...]:
    return ((b"retry-after", str(max(1, math.ceil(seconds))).encode()),)


def no_slot_reply(role: Role, detail: str, retry_after: float) -> Reply:
    """503 before anything was sent to an engine of ``role`` (vLLM's error shape)."""
    return error_reply(
        503,
        f"no routable {role.value} instance: {detail}",
        f"no_{role.value}_slot",
        retry_after_header(retry_after),
    )


def no_slot_detail(
    role: Role, slots: SlotTable | None, unreachable: Unreachable, relevant: Sequence[Slot] | None = None
) -> tuple[str, float]:
    """Why ``role`` has nothing to route to (among ``relevant``, default all its slots), and when
    to retry."""
    if slots is None:
        return "no routing table is loaded yet", 1.0
    candidates = slots.slots(role) if relevant is None else relevant
    if candidates:
        down = sorted({s.instance.name for s in candidates})
        wait = unreachable.retry_after(role, candidates)
        return f"{', '.join(down)} refused connections; retried in {math.ceil(wait)} s", wait
    lonely = [u.describe() for u in slots.unpaired if u.role is not role]
    if lonely and any(i.routable for i in slots.table.instances(role)):
        return "; ".join(lonely), 1.0  # ready, but of other revisions than the other side's
    return "none is ready in the routing table", 1.0


def failure_reply(failure: LegFailure, attempts: int) -> Reply:
    error = failure.error
    message = f"{failure.role.value} {failure.slot.key} failed after {attempts} attempt(s): {error.detail}"
    if error.outcome == "bad_handoff":
        return error_reply(502, message, "bad_kv_handoff")
    if error.outcome == "timeout":
        return error_reply(504, message, f"{failure.role.value}_timeout")
    if error.outcome == BUSY_OUTCOME:
        return error_reply(503, message, f"{failure.role.value}_busy", retry_after_header(1))
    return error_reply(502, message, f"{failure.role.value}_unavailable")
