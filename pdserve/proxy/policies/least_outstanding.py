"""Fewest in-flight requests per slot; ties broken in interleaved order.

The tie-break starts where a rotating counter points, so an idle proxy (every slot at 0)
still spreads requests over all live slots exactly like flat-interleaved instead of piling
them onto the first slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdserve.proxy.policies.base import OrderOnly, RequestView, Turns, live_and_ejected, rotation
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot


class LeastOutstanding(Turns, OrderOnly):
    name: ClassVar[str] = "least-outstanding"

    def candidates(
        self, role: Role, slots: Sequence[Slot], book: SlotBook, turn: int, request: RequestView | None = None
    ) -> list[Slot]:
        live, ejected = live_and_ejected(role, slots, book)
        # sorted() is stable, so equal in-flight counts keep the interleaved rotation order.
        by_load = sorted(rotation(live, turn), key=lambda s: book.in_flight(role, s.key))
        return [*by_load, *ejected]
