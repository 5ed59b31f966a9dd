"""The flat interleaved slot table: one entry per (instance, dp_rank) GPU group of a role.

Why flat: a router that takes instance = n mod I and rank = n mod R from one counter n
locks each instance to a subset of its ranks when I and R share a factor (two DP8
instances: instance 0 only ever sees even ranks). Walking ONE counter over the flat list
below gives every slot exactly one request per cycle, whatever the role's shape.

Order: rank 0 of every instance that has it, instance by instance, then rank 1, ...
Instances with a smaller ``dp_size`` simply drop out of the later rounds, so
heterogeneous DP sizes within a role still give each slot exactly one turn per cycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.routing.table import Instance, Role, RoutingTable


@dataclass(frozen=True)
class Slot:
    instance: Instance
    dp_rank: int

    @property
    def key(self) -> str:
        """Stable label for metrics and debug output: ``<instance>/<rank>``."""
        return slot_key(self.instance.name, self.dp_rank)

    @property
    def rank_header(self) -> int | None:
        """The ``X-data-parallel-rank`` to send, or None when the instance has one engine."""
        return self.dp_rank if self.instance.dp_size > 1 else None

    @property
    def url(self) -> str:
        return self.instance.url


def slot_key(instance: str, dp_rank: int) -> str:
    return f"{instance}/{dp_rank}"


def split_slot_key(key: str) -> tuple[str, int]:
    """``(instance, dp_rank)`` of a :func:`slot_key` (instance names never contain ``/``)."""
    instance, _, rank = key.rpartition("/")
    return instance, int(rank)


def interleaved_slots(instances: Iterable[Instance]) -> tuple[Slot, ...]:
    """Routable instances only (ready and not draining), in flat interleaved order."""
    routable = [i for i in instances if i.routable]
    rounds = max((i.dp_size for i in routable), default=0)
    return tuple(Slot(inst, rank) for rank in range(rounds) for inst in routable if rank < inst.dp_size)


@dataclass(frozen=True)
class SlotTable:
    """The proxy's view of one routing-table generation."""

    table: RoutingTable
    prefill: tuple[Slot, ...]
    decode: tuple[Slot, ...]

    def slots(self, role: Role) -> tuple[Slot, ...]:
        return self.prefill if role is Role.PREFILL else self.decode

    @property
    def serving(self) -> bool:
        return bool(self.prefill) and bool(self.decode)


def build_slot_table(table: RoutingTable) -> SlotTable:
    return SlotTable(table, interleaved_slots(table.prefill), interleaved_slots(table.decode))
