"""Default policy: one counter per role walks the flat interleaved slot list.

Over k·S consecutive requests each of the S slots gets exactly k (the routing-table
property), because every slot appears once per cycle of the list. The proxy runs one
process with one event loop, so this counter is the process's only counter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdserve.proxy.health import SlotBook
from pdserve.proxy.policies.base import healthy_first, rotation
from pdserve.routing import Role, Slot


class FlatInterleaved:
    name: ClassVar[str] = "flat-interleaved"

    def __init__(self) -> None:
        self._counters: dict[tuple[Role, str], int] = {}

    def candidates(self, role: Role, slots: Sequence[Slot], book: SlotBook, group: str = "") -> list[Slot]:
        start = self._counters.get((role, group), 0)
        self._counters[(role, group)] = start + 1
        return healthy_first(role, rotation(slots, start), book)
