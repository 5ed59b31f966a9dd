"""The policy protocol: which slot of a role serves a request, and which ones to retry on.

A request takes its *turn* of the role's counter once (:meth:`Policy.turn`), however many
attempts follow; each attempt asks for the candidates again (:meth:`Policy.candidates`) with
that turn, over the slots of the table served at that moment and their state at that moment.
``group`` names an independent counter of the role: the decode slots of each revision are
walked by their own (see pdserve.routing.slots).

The candidates are every usable slot once, best first: the *live* slots (neither ejected nor
unreachable) in the policy's order, then the ejected ones as a last resort (ejection alone never
turns a request away); unreachable instances never. The policy orders the live slots only, so
a slot that is out gives its turns to no one in particular: over any run of requests in which
the live set stays the same, the live slots' counts differ by at most one (flat-interleaved),
and a slot that comes back gets its share from then on, with no catch-up burst.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from pdserve.proxy.policies.counters import Counters, LocalCounters
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot


class Policy(Protocol):
    name: ClassVar[str]

    def turn(self, role: Role, group: str = "") -> int:
        """This request's turn of the (role, group) counter; the counter advances by one."""
        ...

    def candidates(self, role: Role, slots: Sequence[Slot], book: SlotBook, turn: int) -> list[Slot]:
        """Every usable slot once, best first, for the request holding ``turn`` (module doc)."""
        ...


class Turns:
    """The turns of a policy: one counter per (role, group), in this process, or in shared memory
    for every worker process (pdserve.proxy.policies.counters)."""

    def __init__(self, counters: Counters | None = None) -> None:
        self._counters = counters or LocalCounters()

    def turn(self, role: Role, group: str = "") -> int:
        return self._counters.take(role.value, group)


def rotation(slots: Sequence[Slot], start: int) -> list[Slot]:
    """The slots in interleaved order starting at ``start`` (mod the slot count)."""
    if not slots:
        return []
    start %= len(slots)
    return [*slots[start:], *slots[:start]]


def live_and_ejected(role: Role, slots: Sequence[Slot], book: SlotBook) -> tuple[Sequence[Slot], list[Slot]]:
    """The live slots and the ejected-but-reachable ones (a last resort), each in table order;
    unreachable instances' slots in neither."""
    if book.all_live():
        return slots, []
    live: list[Slot] = []
    ejected: list[Slot] = []
    reachable = book.unreachable.reachable
    for slot in slots:
        if reachable(role, slot):
            (ejected if book.ejected(role, slot.key) else live).append(slot)
    return live, ejected
