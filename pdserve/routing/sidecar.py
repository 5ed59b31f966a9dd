"""The slot table of a decode-side router (``spec.router.placement: decode-sidecar``).

A sidecar runs in one decode pod next to that pod's engine. It serves a request with a prefill
slot from the flat interleaved order over every routable prefill slot of its own engine's
revision (the prefills that can hand their KV to it), and the decode leg on its own engine on
localhost, walking that engine's DP ranks itself. Its decode slots are therefore never the
table's: they are the local engine's ranks, whatever the table says about the pod (the pod is
Ready only once the sidecar is, so waiting for the table to list it as ready would never end).

Uniformity across sidecars: each sidecar has its own prefill counter, so there is no single
global walk. Each sidecar's prefill order starts at an offset, ``floor(i * P / N)`` for
instance index ``i`` of ``N`` routable decode instances over ``P`` prefill slots
(:func:`prefill_offset`). With equal traffic per decode pod (``k`` requests each), every
prefill slot gets exactly ``N * k / P`` whenever that is a whole number, and the counts never
differ by more than one in between (tests/unit/test_routing_sidecar.py checks every shape up
to P = 24, N = 12). Unequal traffic per decode pod skews it; bench/results/sidecar-spread-latest.md
measures by how much.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.routing.slots import Slot, SlotTable, Unpaired, interleaved_slots
from pdserve.routing.table import Endpoint, Instance, Role, RoutingTable

#: The local engine's name in the slot table when the sidecar does not know its pod name.
LOCAL_NAME = "local"


@dataclass(frozen=True)
class LocalDecode:
    """The engine a sidecar sends every decode leg to."""

    url: str  # e.g. http://127.0.0.1:8000
    dp_size: int = 1
    revision: str = ""  # the engine's pairing revision (pdserve.deployment.plan.revision)
    name: str = ""  # the pod's name: its entry in the routing table (draining, kvAddress)
    index: int = 0  # the pod's instance index (pdserve.io/instance): the prefill offset
    #: The first global DP rank of the local engine: a node of a multi-node decode instance
    #: with an API server per node serves ranks first_rank .. first_rank + dp_size - 1 (its
    #: ``dp_size`` is its local rank count) and takes them as local ranks in the header.
    first_rank: int = 0

    @property
    def slot_name(self) -> str:
        return self.name or LOCAL_NAME


def prefill_offset(index: int, decode_instances: int, prefill_slots: int) -> int:
    """Where instance ``index`` of ``decode_instances`` starts its walk of ``prefill_slots``."""
    if prefill_slots <= 0:
        return 0
    n = max(1, decode_instances)
    return ((index % n) * prefill_slots) // n


def own_entry(table: RoutingTable, local: LocalDecode) -> Instance | None:
    """The table's entry for the sidecar's own pod, if the table lists it."""
    if not local.name:
        return None
    return next((i for i in table.decode if i.name == local.name), None)


def draining_self(table: RoutingTable, local: LocalDecode) -> bool:
    """The operator marked this pod draining: the sidecar must turn unready and take nothing new."""
    entry = own_entry(table, local)
    return entry is not None and entry.draining


def local_instance(table: RoutingTable, local: LocalDecode) -> Instance:
    """The local engine as an always-ready instance, with the table's kvAddress when it has one.

    A node of a multi-node instance (``first_rank`` > 0, or the table lists the instance with
    endpoints) is the instance's slot numbering with one endpoint, the local engine, holding
    the local ranks: its slots keep their global ranks and are sent to the local URL with local
    ranks (pdserve.routing.slots.Slot); only those slots are ever built.
    """
    entry = own_entry(table, local)
    url = local.url.rstrip("/")
    kv_address = entry.kv_address if entry is not None else None
    endpoints: tuple[Endpoint, ...] = ()
    dp_size = local.dp_size
    if local.first_rank > 0 or (entry is not None and entry.endpoints):
        table_endpoint = entry.endpoint_for(local.first_rank) if entry is not None else None
        if table_endpoint is not None and table_endpoint.kv_address is not None:
            kv_address = table_endpoint.kv_address
        endpoints = (Endpoint(url, local.first_rank, local.dp_size, kv_address),)
        dp_size = max(entry.dp_size if entry is not None else 0, local.first_rank + local.dp_size)
    return Instance(
        name=local.slot_name,
        url=url,
        dp_size=dp_size,
        tp_size=entry.tp_size if entry is not None else 1,
        ready=True,
        draining=False,
        kv_address=kv_address,
        revision=local.revision,
        endpoints=endpoints,
    )


def local_slots(engine: Instance, local: LocalDecode) -> tuple[Slot, ...]:
    """The local engine's ranks (global numbering), in rank order."""
    return tuple(Slot(engine, rank) for rank in range(local.first_rank, local.first_rank + local.dp_size))


def build_sidecar_slot_table(table: RoutingTable, local: LocalDecode) -> SlotTable:
    """Prefill: every routable prefill slot of the local revision, rotated to this sidecar's
    offset. Decode: the local engine's ranks, whatever the table says about them."""
    engine = local_instance(table, local)
    decode = local_slots(engine, local)
    flat = interleaved_slots(i for i in table.prefill if i.revision == local.revision)
    decode_instances = sum(1 for i in table.decode if i.routable)
    start = prefill_offset(local.index, decode_instances, len(flat))
    prefill: tuple[Slot, ...] = (*flat[start:], *flat[:start])
    unpaired: tuple[Unpaired, ...] = ()
    if not prefill:
        unpaired = (Unpaired(Role.DECODE, local.revision, len(decode)),)
    return SlotTable(table, prefill, decode, {local.revision: decode}, unpaired)
