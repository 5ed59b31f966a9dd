"""The policy protocol: which slot of a role serves a request, and which ones to retry on.

A policy returns an ordered list of candidates, not a single slot: the first is the choice,
the rest are the retry order. Each call is one request, so counters advance once per
request however many retries follow. ``group`` names an independent counter of the role:
the decode slots of each revision are walked by their own (see pdserve.routing.slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot


class Policy(Protocol):
    name: ClassVar[str]

    def candidates(self, role: Role, slots: Sequence[Slot], book: SlotBook, group: str = "") -> list[Slot]:
        """Every slot once, best first; ejected slots last (a last resort, never dropped)."""
        ...


def rotation(slots: Sequence[Slot], start: int) -> list[Slot]:
    """The slots in interleaved order starting at ``start`` (mod the slot count)."""
    if not slots:
        return []
    start %= len(slots)
    return [*slots[start:], *slots[:start]]


def healthy_first(role: Role, ordered: Sequence[Slot], book: SlotBook) -> list[Slot]:
    """Stable partition: healthy slots in their order, then ejected ones in theirs."""
    if not book.any_ejected():
        return list(ordered)
    healthy = [s for s in ordered if not book.ejected(role, s.key)]
    ejected = [s for s in ordered if book.ejected(role, s.key)]
    return healthy + ejected
