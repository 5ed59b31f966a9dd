"""Exact per-slot uniformity of the flat interleave over multi-node shapes.

Slots are (instance, global DP rank) whatever endpoint serves them, so the flat order and its
exactness are those of single-node instances; what a multi-node instance adds is where each
slot's leg goes. Walking the proxy's default policy for k x lcm(P, D) requests, every prefill
and every decode slot gets exactly the same count, and every slot it picked resolves to the
endpoint URL holding its rank with the rank local to that endpoint.
"""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.proxy.policies import make_policy
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Connector, Endpoint, Instance, Role, RoutingTable, Slot, build_slot_table
from tests.support.tables import choose


def group(name: str, subnet: int, nodes: int, per_node: int) -> Instance:
    """A multi-node instance with an API server per node (perNode); nodes == 1: a plain pod."""
    urls = [f"http://10.{subnet}.{n}.1:8000" for n in range(nodes)]
    eps = (
        tuple(Endpoint(urls[n], n * per_node, per_node, f"host:10.{subnet}.{n}.1") for n in range(nodes))
        if nodes > 1
        else ()
    )
    return Instance(name, urls[0], nodes * per_node, 1, True, endpoints=eps)


def expected_route(slot: Slot) -> tuple[str, int]:
    """Where the leg must go, computed from the shape rather than from Slot's own code."""
    inst = slot.instance
    if not inst.endpoints:
        return inst.url, slot.dp_rank
    per_node = inst.endpoints[0].ranks
    node = slot.dp_rank // per_node
    return inst.url.removesuffix(".0.1:8000") + f".{node}.1:8000", slot.dp_rank - node * per_node


def walk(table: RoutingTable, k: int) -> dict[Role, Counter[str]]:
    slots = build_slot_table(table)
    policy = make_policy("flat-interleaved")
    book = SlotBook(eject_seconds=10)
    p, d = len(slots.prefill), len(slots.decode)
    requests = k * math.lcm(p, d)
    counts: dict[Role, Counter[str]] = {Role.PREFILL: Counter(), Role.DECODE: Counter()}
    for _ in range(requests):
        prefill = choose(policy, Role.PREFILL, slots.prefill, book)[0]
        decode = choose(policy, Role.DECODE, slots.decode_for(prefill.revision), book)[0]
        for role, slot in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            assert (slot.url, slot.local_rank) == expected_route(slot)
            assert slot.rank_header == (slot.local_rank if slot.instance.dp_size > 1 else None)
            counts[role][slot.key] += 1
    for role, role_slots in ((Role.PREFILL, slots.prefill), (Role.DECODE, slots.decode)):
        assert counts[role] == {s.key: requests // len(role_slots) for s in role_slots}
    return counts


def test_multinode_prefill_dp16_with_single_node_decode_dp8() -> None:
    table = RoutingTable("ds", 1, Connector("nixl"), (group("p0", 1, 2, 8),), (group("d0", 2, 1, 8),))
    counts = walk(table, k=3)
    assert len(counts[Role.PREFILL]) == 16 and set(counts[Role.PREFILL].values()) == {3}
    assert len(counts[Role.DECODE]) == 8 and set(counts[Role.DECODE].values()) == {6}


def test_single_node_prefill_dp8_with_multinode_decode_dp16() -> None:
    table = RoutingTable("ds", 1, Connector("nixl"), (group("p0", 1, 1, 8),), (group("d0", 2, 2, 8),))
    counts = walk(table, k=2)
    assert set(counts[Role.PREFILL].values()) == {4}
    assert set(counts[Role.DECODE].values()) == {2}


def test_mixed_roles_two_of_each_shape() -> None:
    """Two multi-node DP16 prefills beside a DP8 pod; a DP32 (4 x 8) decode beside two DP8 pods."""
    table = RoutingTable(
        "ds",
        1,
        Connector("nixl"),
        (group("p0", 1, 2, 8), group("p1", 3, 2, 8), group("p2", 5, 1, 8)),
        (group("d0", 2, 4, 8), group("d1", 4, 1, 8), group("d2", 6, 1, 8)),
    )
    walk(table, k=1)


shapes = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 8)), min_size=1, max_size=4)  # nodes, per node


@settings(max_examples=80, deadline=None)
@given(shapes, shapes, st.integers(1, 2))
def test_random_shapes_are_exact(
    prefill: list[tuple[int, int]], decode: list[tuple[int, int]], k: int
) -> None:
    table = RoutingTable(
        "ds",
        1,
        Connector("nixl"),
        tuple(group(f"p{i}", 10 + i, n, per) for i, (n, per) in enumerate(prefill)),
        tuple(group(f"d{i}", 50 + i, n, per) for i, (n, per) in enumerate(decode)),
    )
    walk(table, k)
