"""Flat interleaved slots: every routable (instance, rank) exactly once per cycle, in round order.

Property tests over random role shapes (heterogeneous dpSize, instances not ready or
draining), through the proxy's default policy, the way requests actually pick slots.
"""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.proxy.policies import make_policy
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Connector, Instance, Role, RoutingTable, build_slot_table, interleaved_slots
from tests.support.tables import choose

instance_shapes = st.lists(
    st.tuples(st.integers(1, 8), st.booleans(), st.booleans()),  # dpSize, ready, draining
    min_size=0,
    max_size=6,
)


def instances(shapes: list[tuple[int, bool, bool]], role: str = "p") -> list[Instance]:
    return [
        Instance(f"{role}{i}", f"http://10.0.0.{i + 1}:8000", dp, 1, ready, draining)
        for i, (dp, ready, draining) in enumerate(shapes)
    ]


@given(instance_shapes)
def test_each_routable_rank_once_and_nothing_else(shapes: list[tuple[int, bool, bool]]) -> None:
    insts = instances(shapes)
    slots = interleaved_slots(insts)
    expected = {(i.name, r) for i in insts if i.ready and not i.draining for r in range(i.dp_size)}
    keys = [(s.instance.name, s.dp_rank) for s in slots]
    assert len(keys) == len(set(keys))
    assert set(keys) == expected


@given(instance_shapes)
def test_order_is_round_by_round_instance_by_instance(shapes: list[tuple[int, bool, bool]]) -> None:
    insts = instances(shapes)
    position = {i.name: n for n, i in enumerate(insts)}
    slots = interleaved_slots(insts)
    order = [(s.dp_rank, position[s.instance.name]) for s in slots]
    assert order == sorted(order)  # rank 0 of every instance first, then rank 1, ...


@given(instance_shapes)
def test_rank_header_only_for_data_parallel_instances(shapes: list[tuple[int, bool, bool]]) -> None:
    for slot in interleaved_slots(instances(shapes)):
        if slot.instance.dp_size == 1:
            assert slot.rank_header is None
        else:
            assert slot.rank_header == slot.dp_rank
        assert slot.key == f"{slot.instance.name}/{slot.dp_rank}"
        assert slot.url == slot.instance.url


@settings(max_examples=60)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.booleans(), st.booleans()), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(1, 8), st.booleans(), st.booleans()), min_size=1, max_size=5),
    st.integers(1, 4),
    st.integers(0, 50),
)
def test_policy_gives_each_slot_exactly_k_of_k_times_s_requests(
    prefill: list[tuple[int, bool, bool]],
    decode: list[tuple[int, bool, bool]],
    k: int,
    offset: int,
) -> None:
    table = RoutingTable(
        "d", 1, Connector("nixl"), tuple(instances(prefill, "p")), tuple(instances(decode, "d"))
    )
    slots = build_slot_table(table)
    policy = make_policy("flat-interleaved")
    book = SlotBook(eject_seconds=10)
    for role in Role:
        for _ in range(offset):  # wherever the counter stands, any k·S window is exact
            choose(policy, role, slots.slots(role), book)
    for role in Role:
        role_slots = slots.slots(role)
        if not role_slots:
            continue
        chosen = [choose(policy, role, role_slots, book)[0] for _ in range(k * len(role_slots))]
        counts = Counter(s.key for s in chosen)
        assert counts == {s.key: k for s in role_slots}
        # consecutive requests walk the flat list in its interleaved order
        start = role_slots.index(chosen[0])
        assert chosen == [role_slots[(start + n) % len(role_slots)] for n in range(len(chosen))]


def test_two_dp8_instances_use_all_sixteen_ranks() -> None:
    """The MoRIIO toy-proxy bug: instance = n mod 2, rank = n mod 8 leaves half the ranks idle."""
    insts = [Instance(f"p{i}", f"http://p{i}:8000", 8, 1, True) for i in range(2)]
    slots = interleaved_slots(insts)
    assert [s.key for s in slots[:4]] == ["p0/0", "p1/0", "p0/1", "p1/1"]
    assert len({s.key for s in slots}) == 16


def test_heterogeneous_dp_sizes_skip_missing_ranks() -> None:
    insts = [
        Instance("a", "http://a:1", 2, 1, True),
        Instance("b", "http://b:1", 1, 1, True),
        Instance("c", "http://c:1", 3, 1, True),
        Instance("x", "http://x:1", 4, 1, True, draining=True),
        Instance("y", "http://y:1", 4, 1, False),
    ]
    assert [s.key for s in interleaved_slots(insts)] == ["a/0", "b/0", "c/0", "a/1", "c/1", "c/2"]


def test_serving_needs_both_roles() -> None:
    p = (Instance("p", "http://p:1", 1, 1, True),)
    d = (Instance("d", "http://d:1", 1, 1, False),)
    assert not build_slot_table(RoutingTable("x", 1, Connector("nixl"), p, d)).serving
    d_ready = (Instance("d", "http://d:1", 1, 1, True),)
    assert build_slot_table(RoutingTable("x", 1, Connector("nixl"), p, d_ready)).serving


# --- revisions ----------------------------------------------------------------------------------

revision_shapes = st.lists(
    st.tuples(st.integers(1, 8), st.booleans(), st.booleans(), st.sampled_from(["", "ra", "rb"])),
    min_size=0,
    max_size=6,
)  # dpSize, ready, draining, revision


def revisioned(shapes: list[tuple[int, bool, bool, str]], role: str) -> tuple[Instance, ...]:
    return tuple(
        Instance(f"{role}{i}", f"http://10.0.{ord(role)}.{i + 1}:8000", dp, 1, ready, draining, None, rev)
        for i, (dp, ready, draining, rev) in enumerate(shapes)
    )


def routable_slots(instances: tuple[Instance, ...], revision: str) -> int:
    return sum(i.dp_size for i in instances if i.routable and i.revision == revision)


@settings(max_examples=80)
@given(revision_shapes, revision_shapes, st.integers(1, 3), st.integers(0, 40), st.integers(0, 40))
def test_pairing_is_exact_within_each_revision_and_weighted_by_prefill_slots(
    prefill: list[tuple[int, bool, bool, str]],
    decode: list[tuple[int, bool, bool, str]],
    k: int,
    prefill_offset: int,
    decode_offset: int,
) -> None:
    """The router's order: the prefill slot from ONE counter over every paired prefill slot,
    then the decode from that revision's decode slots with that revision's own counter."""
    p, d = revisioned(prefill, "p"), revisioned(decode, "d")
    slots = build_slot_table(RoutingTable("x", 1, Connector("nixl"), p, d))
    paired = {i.revision for i in p if i.routable} & {i.revision for i in d if i.routable}
    # only paired revisions route; the others are reported with their slot counts
    assert {s.revision for s in slots.prefill} == {s.revision for s in slots.decode} == paired
    assert len(slots.prefill) == sum(routable_slots(p, r) for r in paired)
    expected_unpaired = {
        (role, rev, routable_slots(insts, rev))
        for role, insts in ((Role.PREFILL, p), (Role.DECODE, d))
        for rev in {i.revision for i in insts if i.routable} - paired
    }
    assert {(u.role, u.revision, u.slots) for u in slots.unpaired} == expected_unpaired
    if not paired:
        assert not slots.serving
        return
    policy, book = make_policy("flat-interleaved"), SlotBook(eject_seconds=10)
    for _ in range(prefill_offset):  # wherever the counters stand, the window below is exact
        choose(policy, Role.PREFILL, slots.prefill, book)
    for rev in paired:
        for _ in range(decode_offset):
            choose(policy, Role.DECODE, slots.decode_for(rev), book, rev)
    sp = len(slots.prefill)
    # rounds of the prefill list such that every revision's share divides over its decode slots
    rounds = k * math.lcm(
        *(
            len(slots.decode_for(r)) // math.gcd(len(slots.decode_for(r)), routable_slots(p, r))
            for r in paired
        )
    )
    prefills: Counter[str] = Counter()
    decodes: Counter[str] = Counter()
    for _ in range(rounds * sp):
        chosen = choose(policy, Role.PREFILL, slots.prefill, book)[0]
        pair = choose(policy, Role.DECODE, slots.decode_for(chosen.revision), book, chosen.revision)[0]
        assert pair.revision == chosen.revision  # a handoff never crosses revisions
        prefills[chosen.key] += 1
        decodes[pair.key] += 1
    assert prefills == {s.key: rounds for s in slots.prefill}
    for rev in paired:
        share = rounds * routable_slots(p, rev) // len(slots.decode_for(rev))
        assert {s.key: decodes[s.key] for s in slots.decode_for(rev)} == {
            s.key: share for s in slots.decode_for(rev)
        }


def test_unversioned_tables_pair_everything_as_before() -> None:
    p = (Instance("p", "http://p:1", 2, 1, True),)
    d = (Instance("d0", "http://d:1", 1, 1, True), Instance("d1", "http://e:1", 2, 1, True))
    slots = build_slot_table(RoutingTable("x", 1, Connector("nixl"), p, d))
    assert slots.decode_for("") == slots.decode == interleaved_slots(d)
    assert slots.prefill == interleaved_slots(p) and slots.unpaired == ()


def test_unpaired_revision_is_described() -> None:
    p = (Instance("p0", "http://p:1", 8, 1, True, revision="new"), Instance("p1", "http://q:1", 1, 1, True))
    d = (Instance("d0", "http://d:1", 1, 1, True),)
    slots = build_slot_table(RoutingTable("x", 1, Connector("nixl"), p, d))
    assert [s.key for s in slots.prefill] == ["p1/0"]
    assert [u.describe() for u in slots.unpaired] == [
        "revision 'new' has 8 routable prefill slot(s) but no routable decode instance: "
        "its prefill slots take no traffic"
    ]
    assert slots.revisions() == {
        "new": {"prefill_slots": 8, "decode_slots": 0, "paired": False},
        "": {"prefill_slots": 1, "decode_slots": 1, "paired": True},
    }
