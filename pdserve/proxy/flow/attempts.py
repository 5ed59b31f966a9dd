"""The retry policy of one P/D request: which slots each attempt may use, when a prefill's KV
handoff may go to another decode, and what the client sees when the attempts run out.

* Every attempt chooses its slots from the table served *at that moment* and the ejection state
  at that moment, with the request's own turn of each counter (:class:`Walk`): a retry never
  walks a candidate list made when the request started. One rule for both legs: a failed leg is
  retried on the best slot of its role that this request has not tried yet, and on one it tried
  only when no other is left (a single prefill slot retries on itself), at most
  ``--max-retries`` times.
* A failure of the *connection* to an instance (refused, reset, cut) is the instance's, not one
  engine rank's: all DP ranks of a vLLM server share its HTTP endpoint. Every slot of the
  instance is ejected at once, so the retry goes to another instance. A connection that was
  refused (or could not be opened in time) also marks the instance *unreachable* for the
  cool-down: it is not tried at all meanwhile, and when a role has no reachable instance left
  the router answers 503 with Retry-After *before* spending a prefill.
* No retry spends a new prefill unless a decode can take it right then: the retry's decode is
  chosen first, from the table served now; a live one (in the table, not ejected, reachable) is
  taken as it is, and one that failed recently (ejected: a last resort) must answer ``/health``
  before the prefill is sent. One that does not is marked unreachable and the next one is
  tried; with none left the answer is 503 at once. (A TCP connect would not do: a process being
  killed still completes handshakes from its listen backlog.) A first attempt does not check:
  the table and the ejection state speak for the decodes until something fails.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.proxy.engine.upstream import LegError
from pdserve.proxy.flow.reply import Reply, error_reply
from pdserve.proxy.state.health import Unreachable
from pdserve.routing import Role, Slot, SlotTable

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


@dataclass
class Walk:
    """One part's place in the candidate orders: its turn of each counter (taken once, however
    many attempts follow) and the slots its failed legs went to."""

    prefill_turn: int
    decode_turns: dict[str, int] = field(default_factory=dict)
    failed: set[tuple[Role, str]] = field(default_factory=set)

    def tried_last(self, role: Role, candidates: list[Slot]) -> list[Slot]:
        """The candidates with the slots that already failed this part moved to the end: a retry
        goes to the best slot not tried yet, and to a tried one only when none is left."""
        if not self.failed:
            return candidates
        fresh = [s for s in candidates if (role, s.key) not in self.failed]
        return fresh + [s for s in candidates if (role, s.key) in self.failed]


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
