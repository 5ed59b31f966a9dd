"""Default policy: one counter per role walks the flat interleaved list of the live slots.

Over k·L consecutive requests each of the L live slots gets exactly k (the routing-table
property), because every live slot appears once per cycle of the list; a slot that is ejected or
unreachable is left out of the cycle rather than passing its turn to its neighbour. With several
worker processes the counter lives in shared memory (pdserve.proxy.policies.counters), and so do
the ejections, so it is still the router's only counter over one live set and the property holds
for the router as a whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdserve.proxy.policies.base import OrderOnly, Turns, rotation
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot


class FlatInterleaved(Turns, OrderOnly):
    name: ClassVar[str] = "flat-interleaved"

    def order(self, role: Role, live: Sequence[Slot], book: SlotBook, turn: int) -> Sequence[Slot]:
        return rotation(live, turn)
