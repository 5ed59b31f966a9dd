"""Fewest in-flight requests per slot; ties broken in interleaved order.

The tie-break starts where a rotating counter points, so an idle proxy (every slot at 0)
still spreads requests over all live slots exactly like flat-interleaved instead of piling
them onto the first slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdserve.proxy.policies.base import OrderOnly, Turns, rotation
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot


class LeastOutstanding(Turns, OrderOnly):
    name: ClassVar[str] = "least-outstanding"

    def order(self, role: Role, live: Sequence[Slot], book: SlotBook, turn: int) -> Sequence[Slot]:
        # sorted() is stable, so equal in-flight counts keep the interleaved rotation order.
        return sorted(rotation(live, turn), key=lambda s: book.in_flight(role, s.key))
