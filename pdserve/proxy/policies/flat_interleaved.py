"""Default policy: one counter per role walks the flat interleaved slot list.

Over k·S consecutive requests each of the S slots gets exactly k (the routing-table
property), because every slot appears once per cycle of the list. With several worker
processes the counter lives in shared memory (pdserve.proxy.policies.counters), so it is still the
router's only counter and the property holds for the router as a whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdserve.proxy.policies.base import healthy_first, rotation
from pdserve.proxy.policies.counters import Counters, LocalCounters
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Role, Slot


class FlatInterleaved:
    name: ClassVar[str] = "flat-interleaved"

    def __init__(self, counters: Counters | None = None) -> None:
        self._counters = counters or LocalCounters()

    def candidates(self, role: Role, slots: Sequence[Slot], book: SlotBook, group: str = "") -> list[Slot]:
        start = self._counters.take(role.value, group)
        return healthy_first(role, rotation(slots, start), book)
