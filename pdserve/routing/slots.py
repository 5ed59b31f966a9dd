"""The flat interleaved slot table: one entry per (instance, dp_rank) GPU group of a role.

Why flat: a router that takes instance = n mod I and rank = n mod R from one counter n
locks each instance to a subset of its ranks when I and R share a factor (two DP8
instances: instance 0 only ever sees even ranks). Walking ONE counter over the flat list
below gives every slot exactly one request per cycle, whatever the role's shape.

Order: rank 0 of every instance that has it, instance by instance, then rank 1, ...
Instances with a smaller ``dp_size`` simply drop out of the later rounds, so
heterogeneous DP sizes within a role still give each slot exactly one turn per cycle.

Revisions: a prefill may hand its KV only to a decode of the same ``revision`` (same model,
image, KV layout and connector). The prefill slots of every revision that also has routable
decode slots form ONE flat list (one counter over all of them, so each prefill slot keeps its
exact share and a revision gets traffic in proportion to its prefill slots); each revision's
decode slots form a list of their own, walked by that revision's own counter, so within a
revision every decode slot gets an exact share of that revision's requests. A revision with
routable instances on one side only is *unpaired*: its slots are left out of both lists
(its prefills would have no decode to hand their KV to) and reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from pdserve.routing.table import Endpoint, Instance, Role, RoutingTable


@dataclass(frozen=True)
class Slot:
    """One (instance, global DP rank) engine, and where a leg for it goes.

    A multi-node instance with an API server per node (``Instance.endpoints``) is still one
    instance of ``dp_size`` slots in the flat order; each slot resolves to the endpoint holding
    its rank and the rank *local* to that endpoint, because under vLLM's hybrid load balancing
    (``--data-parallel-hybrid-lb``) a node's API server only knows its own engines:
    ``ParallelConfig.local_engines_only`` is true for hybrid (and external) LB, the API
    server's client then manages ``data_parallel_size_local`` engines
    (``MPClient.engine_ranks_managed``, vllm/v1/engine/core_client.py), picks
    ``core_engines[request.data_parallel_rank]`` (``DPLBAsyncMPClient.get_core_engine_for_request``)
    and refuses a rank outside ``[0, data_parallel_size_local)``
    (``InputProcessor.process_inputs``, vllm/v1/engine/input_processor.py: "data_parallel_rank
    N is out of range [0, L)."). Without endpoints (one pod, or the leader's API server
    dispatching to every rank) the header is the global rank, as before.
    """

    instance: Instance
    dp_rank: int  # global: the slot's identity, whatever endpoint serves it

    # Computed once per slot (a slot lives as long as its table, and every request reads its
    # key and address several times): the properties below are cached on the instance.

    @cached_property
    def key(self) -> str:
        """Stable label for metrics and debug output: ``<instance>/<rank>``."""
        return slot_key(self.instance.name, self.dp_rank)

    @cached_property
    def endpoint(self) -> Endpoint | None:
        """The API server holding this rank (None: the instance's ``url`` serves every rank)."""
        return self.instance.endpoint_for(self.dp_rank) if self.instance.endpoints else None

    @cached_property
    def local_rank(self) -> int:
        """The rank as the serving API server numbers it (the global rank without endpoints)."""
        endpoint = self.endpoint
        return self.dp_rank - endpoint.first_rank if endpoint is not None else self.dp_rank

    @cached_property
    def rank_header(self) -> int | None:
        """The ``X-data-parallel-rank`` to send, or None when the instance has one engine."""
        return self.local_rank if self.instance.dp_size > 1 else None

    @cached_property
    def url(self) -> str:
        endpoint = self.endpoint
        return endpoint.url if endpoint is not None else self.instance.url

    @cached_property
    def kv_address(self) -> str | None:
        """The KV address of the node serving this rank (the endpoint's, else the instance's)."""
        endpoint = self.endpoint
        if endpoint is not None and endpoint.kv_address is not None:
            return endpoint.kv_address
        return self.instance.kv_address

    @cached_property
    def local_dp_size(self) -> int:
        """How many ranks the serving API server has (what a peer sees behind ``kv_address``)."""
        endpoint = self.endpoint
        return endpoint.ranks if endpoint is not None else self.instance.dp_size

    @cached_property
    def revision(self) -> str:
        return self.instance.revision


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
class Unpaired:
    """A revision with routable slots on one side only: they take no traffic."""

    role: Role  # the side that has the slots
    revision: str
    slots: int

    def describe(self) -> str:
        other = Role.DECODE if self.role is Role.PREFILL else Role.PREFILL
        name = f"revision {self.revision!r}" if self.revision else "the unversioned revision"
        return (
            f"{name} has {self.slots} routable {self.role.value} slot(s) but no routable "
            f"{other.value} instance: its {self.role.value} slots take no traffic"
        )


@dataclass(frozen=True)
class SlotTable:
    """The proxy's view of one routing-table generation."""

    table: RoutingTable
    prefill: tuple[Slot, ...]  # every paired revision's prefill slots, one flat order
    decode: tuple[Slot, ...]  # every paired revision's decode slots (routing uses decode_for)
    decode_by_revision: Mapping[str, tuple[Slot, ...]] = field(default_factory=dict)
    unpaired: tuple[Unpaired, ...] = ()

    def slots(self, role: Role) -> tuple[Slot, ...]:
        return self.prefill if role is Role.PREFILL else self.decode

    def decode_for(self, revision: str) -> tuple[Slot, ...]:
        """The decode slots a prefill of ``revision`` may hand its KV to, in flat order."""
        return self.decode_by_revision.get(revision, ())

    @property
    def serving(self) -> bool:
        return bool(self.prefill) and bool(self.decode)

    def revisions(self) -> dict[str, dict[str, int | bool]]:
        """Routable slots per revision and side (the /debug/routing view)."""
        out: dict[str, dict[str, int | bool]] = {}
        for role in Role:
            for inst in self.table.instances(role):
                if inst.routable:
                    row = out.setdefault(inst.revision, {"prefill_slots": 0, "decode_slots": 0})
                    row[f"{role.value}_slots"] = int(row[f"{role.value}_slots"]) + inst.dp_size
        for row in out.values():
            row["paired"] = bool(row["prefill_slots"]) and bool(row["decode_slots"])
        return out


def build_slot_table(table: RoutingTable) -> SlotTable:
    prefill_revs = {i.revision for i in table.prefill if i.routable}
    decode_revs = {i.revision for i in table.decode if i.routable}
    paired = prefill_revs & decode_revs
    decode_by_revision = {
        rev: interleaved_slots(i for i in table.decode if i.revision == rev) for rev in sorted(paired)
    }
    unpaired = tuple(
        Unpaired(role, rev, sum(i.dp_size for i in table.instances(role) if i.routable and i.revision == rev))
        for role, revs in ((Role.PREFILL, prefill_revs), (Role.DECODE, decode_revs))
        for rev in sorted(revs - paired)
    )
    return SlotTable(
        table,
        interleaved_slots(i for i in table.prefill if i.revision in paired),
        interleaved_slots(i for i in table.decode if i.revision in paired),
        decode_by_revision,
        unpaired,
    )
