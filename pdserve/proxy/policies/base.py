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

A policy that orders by the request itself (prefix-affinity reads the prompt) says so with
``reads_requests``: the dispatcher then makes the request's view once per sequence
(:meth:`Policy.view`), passes it to every :meth:`Policy.candidates` call, and tells the policy
where each new prefill went (:meth:`Policy.sent`). For the others nothing is computed: their
hot path is the order alone. :class:`OrderOnly` gives them the rest of the protocol, so that
such a policy writes only :meth:`OrderOnly.order`, its order of the live slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from pdserve.proxy.policies.counters import Counters, LocalCounters
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot, SlotTable


class RequestView:
    """What a policy that reads requests keeps of one sequence's request (its own subclass)."""

    __slots__ = ()


class Policy(Protocol):
    name: ClassVar[str]
    #: True when :meth:`candidates` orders by the request (``view`` is then called per sequence).
    reads_requests: bool

    def turn(self, role: Role, group: str = "") -> int:
        """This request's turn of the (role, group) counter; the counter advances by one."""
        ...

    def candidates(
        self, role: Role, slots: Sequence[Slot], book: SlotBook, turn: int, request: RequestView | None = None
    ) -> list[Slot]:
        """Every usable slot once, best first, for the request holding ``turn`` (module doc)."""
        ...

    def view(self, endpoint: str, body: Mapping[str, Any]) -> RequestView:
        """What the policy needs of one sequence's request (``endpoint``: chat or completions)."""
        ...

    def sent(self, role: Role, slot: Slot, request: RequestView) -> None:
        """A new leg of ``request`` was sent to ``slot`` (not a retry reusing a handoff)."""
        ...

    def table_changed(self, slots: SlotTable) -> None:
        """The router now serves ``slots`` (a new routing table)."""
        ...

    def describe(self) -> dict[str, Any]:
        """The policy's state for ``/debug/routing`` (empty for a policy that keeps none)."""
        ...


class OrderOnly:
    """The rest of the protocol for a policy that orders slots without reading requests: it
    gives its :meth:`order` of the live slots, and the candidates are those, then the ejected."""

    reads_requests = False

    def order(self, role: Role, live: Sequence[Slot], book: SlotBook, turn: int) -> Sequence[Slot]:
        """The live slots in this policy's order for the request holding ``turn``."""
        raise NotImplementedError

    def candidates(
        self, role: Role, slots: Sequence[Slot], book: SlotBook, turn: int, request: RequestView | None = None
    ) -> list[Slot]:
        live, ejected = live_and_ejected(role, slots, book)
        return [*self.order(role, live, book, turn), *ejected]

    def view(self, endpoint: str, body: Mapping[str, Any]) -> RequestView:
        raise TypeError(f"{type(self).__name__} does not read requests")

    def sent(self, role: Role, slot: Slot, request: RequestView) -> None:
        pass

    def table_changed(self, slots: SlotTable) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {}


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
