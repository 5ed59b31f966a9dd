"""The decode sidecar's slots: prefills of its revision from an offset, decode on its own engine."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.routing import Connector, Instance, RoutingTable
from pdserve.routing.sidecar import (
    LocalDecode,
    build_sidecar_slot_table,
    draining_self,
    prefill_offset,
)


def inst(name: str, dp: int = 1, ready: bool = True, draining: bool = False, revision: str = "") -> Instance:
    return Instance(name, f"http://{name}:8000", dp, 1, ready, draining, revision=revision)


def table(prefill: list[Instance], decode: list[Instance]) -> RoutingTable:
    return RoutingTable("llama", 3, Connector("nixl"), tuple(prefill), tuple(decode))


def spread(prefill_slots: int, sidecars: int, per_sidecar: list[int]) -> Counter[int]:
    """Requests per prefill slot index when sidecar i sends per_sidecar[i] requests."""
    counts: Counter[int] = Counter({s: 0 for s in range(prefill_slots)})
    for i, k in enumerate(per_sidecar):
        start = prefill_offset(i, sidecars, prefill_slots)
        for j in range(k):
            counts[(start + j) % prefill_slots] += 1
    return counts


def test_equal_traffic_gives_every_prefill_slot_an_exact_share() -> None:
    """Every shape up to 24 prefill slots and 12 decode instances: exact whenever N*k is a
    multiple of P, and never more than one apart otherwise."""
    for p in range(1, 25):
        for n in range(1, 13):
            for k in range(1, 2 * p + 1):
                counts = spread(p, n, [k] * n)
                if (n * k) % p == 0:
                    assert set(counts.values()) == {n * k // p}, (p, n, k, counts)
                assert max(counts.values()) - min(counts.values()) <= 1, (p, n, k)


def test_without_offsets_equal_traffic_piles_onto_the_first_slots() -> None:
    """Why the offset: 3 sidecars of 1 request each over 6 prefill slots all pick slot 0."""
    assert prefill_offset(0, 3, 6) == 0 and prefill_offset(1, 3, 6) == 2 and prefill_offset(2, 3, 6) == 4
    assert sorted(spread(6, 3, [2, 2, 2]).values()) == [1] * 6


def test_offset_wraps_indices_past_the_instance_count() -> None:
    # during a surge rollout a pod may carry index N (more pods than routable decodes)
    assert prefill_offset(3, 3, 6) == prefill_offset(0, 3, 6)
    assert prefill_offset(5, 0, 4) == 0  # no routable decode yet: counted as one
    assert prefill_offset(1, 2, 0) == 0


def test_sidecar_table_prefills_of_its_revision_rotated_and_local_decode_ranks() -> None:
    t = table(
        [inst("p0", 2, revision="a"), inst("p1", 2, revision="a"), inst("p2", 1, revision="b")],
        [inst("d0", 2, revision="a"), inst("d1", 2, revision="a"), inst("d2", 2, ready=False, revision="a")],
    )
    local = LocalDecode("http://127.0.0.1:8000/", dp_size=4, revision="a", name="d1", index=1)
    slots = build_sidecar_slot_table(t, local)
    # flat order of revision a's prefills: p0/0 p1/0 p0/1 p1/1; offset floor(1*4/2) = 2
    assert [s.key for s in slots.prefill] == ["p0/1", "p1/1", "p0/0", "p1/0"]
    assert [s.key for s in slots.decode] == ["d1/0", "d1/1", "d1/2", "d1/3"]
    assert {s.url for s in slots.decode} == {"http://127.0.0.1:8000"}
    assert [s.rank_header for s in slots.decode] == [0, 1, 2, 3]
    assert slots.decode_for("a") == slots.decode and slots.decode_for("b") == ()
    assert slots.serving and not slots.unpaired


def test_local_engine_is_routable_whatever_the_table_says_about_its_pod() -> None:
    # the pod is Ready only once its sidecar is: the table cannot be waited for
    t = table([inst("p0")], [inst("d0", ready=False)])
    slots = build_sidecar_slot_table(t, LocalDecode("http://127.0.0.1:8000", name="d0"))
    assert [s.key for s in slots.decode] == ["d0/0"] and slots.decode[0].rank_header is None
    nameless = build_sidecar_slot_table(t, LocalDecode("http://127.0.0.1:8000"))
    assert [s.key for s in nameless.decode] == ["local/0"]


def test_no_prefill_of_the_local_revision_is_unpaired() -> None:
    t = table([inst("p0", revision="new")], [])
    slots = build_sidecar_slot_table(t, LocalDecode("http://127.0.0.1:8000", revision="old"))
    assert slots.prefill == () and not slots.serving
    described = slots.unpaired[0].describe()
    assert "revision 'old' has 1 routable decode slot(s) but no routable prefill" in described


def test_kv_address_comes_from_the_pods_entry() -> None:
    kv = "host:10.0.0.9,handshake:6301,notify:6401"
    entry = Instance("d0", "http://10.0.0.9:8000", 1, 8, False, False, kv)
    t = RoutingTable("llama", 1, Connector("moriio", "READ"), (inst("p0"),), (entry,))
    local = LocalDecode("http://127.0.0.1:8000", name="d0")
    (slot,) = build_sidecar_slot_table(t, local).decode
    assert slot.instance.kv_address == entry.kv_address and slot.instance.tp_size == 8


@pytest.mark.parametrize(("draining", "expected"), [(True, True), (False, False)])
def test_draining_self(draining: bool, expected: bool) -> None:
    t = table([inst("p0")], [inst("d0", draining=draining), inst("d1", draining=True)])
    assert draining_self(t, LocalDecode("http://127.0.0.1:8000", name="d0")) is expected
    assert not draining_self(t, LocalDecode("http://127.0.0.1:8000"))  # no name: cannot tell
