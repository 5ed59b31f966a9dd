"""Exact shares over the live slots (issue 23, item 2): whatever is ejected, unreachable, draining
or gone, the slots that are live keep exact shares among themselves, and a slot that comes back
gets its share from then on, with no catch-up burst.

Property tests over shapes (heterogeneous DP), any subset out, one router process or two worker
processes (a shared counter and shared ejection state, whichever worker takes each request), and
the decode sidecar's prefill walk.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.proxy.policies import Policy, make_policy
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.shared import SharedState
from pdserve.routing import Connector, Instance, Role, RoutingTable, Slot, build_slot_table
from pdserve.routing.sidecar import LocalDecode, build_sidecar_slot_table


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def instances(prefix: str, dp_sizes: Sequence[int], draining: Sequence[bool] = ()) -> tuple[Instance, ...]:
    return tuple(
        Instance(
            f"{prefix}{k}",
            f"http://127.0.0.1:{9000 + k}",
            dp_size=dp,
            ready=True,
            draining=k < len(draining) and draining[k],
        )
        for k, dp in enumerate(dp_sizes)
    )


class Router:
    """``workers`` worker processes' views of one router: one policy and one book each, over the
    shared counters and shared ejection/unreachable state (as pdserve.proxy.app builds them)."""

    def __init__(self, workers: int, clock: Clock) -> None:
        shared = SharedState(multiprocessing.get_context("fork").Lock(), workers) if workers > 1 else None
        self.policies: list[Policy] = []
        self.books: list[SlotBook] = []
        for _ in range(workers):
            self.policies.append(make_policy("flat-interleaved", shared.counters if shared else None))
            self.books.append(
                SlotBook(
                    10.0,
                    clock,
                    shared=shared.ejections if shared else None,
                    shared_unreachable=shared.unreachable if shared else None,
                )
            )

    def first(self, worker: int, role: Role, slots: Sequence[Slot]) -> Slot | None:
        policy, book = self.policies[worker], self.books[worker]
        candidates = policy.candidates(role, slots, book, policy.turn(role))
        return candidates[0] if candidates else None


def key_of(slot: Slot | None) -> str:
    assert slot is not None
    return slot.key


def assert_within_one(counts: Counter[str], live: Sequence[Slot]) -> None:
    per_slot = [counts.get(s.key, 0) for s in live]
    assert set(counts) <= {s.key for s in live}, "a slot that is out was chosen first"
    assert max(per_slot) - min(per_slot) <= 1, dict(counts)


shapes = st.lists(st.integers(1, 8), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp_sizes=shapes,
    data=st.data(),
    workers=st.sampled_from([1, 2]),
    requests=st.integers(1, 80),
)
def test_live_slots_keep_exact_shares_whatever_is_out(
    dp_sizes: list[int], data: st.DataObject, workers: int, requests: int
) -> None:
    clock = Clock()
    router = Router(workers, clock)
    draining = data.draw(st.lists(st.booleans(), min_size=len(dp_sizes), max_size=len(dp_sizes)))
    table = RoutingTable("d", 1, Connector("nixl"), instances("p", dp_sizes, draining), instances("d", [1]))
    slots = build_slot_table(table).prefill  # draining instances are not in it
    if not slots:
        return
    ejected = data.draw(st.sets(st.sampled_from([s.key for s in slots])))
    unreachable = data.draw(st.sets(st.sampled_from(sorted({s.instance.name for s in slots}))))
    book = router.books[0]  # any worker's book: the state is the router's
    for key in ejected:
        book.eject(Role.PREFILL, key)
    for name in unreachable:
        book.unreachable.mark(Role.PREFILL, name)
    live = [s for s in slots if s.key not in ejected and s.instance.name not in unreachable]
    # the whole window is served under one live set; whichever worker takes each request
    who = data.draw(st.lists(st.integers(0, workers - 1), min_size=requests, max_size=requests))
    chosen = [router.first(w, Role.PREFILL, slots) for w in who]
    counts = Counter(s.key for s in chosen if s is not None)
    if live:
        assert_within_one(counts, live)
        if requests % len(live) == 0:
            assert all(counts[s.key] == requests // len(live) for s in live)
    else:  # nothing live: the ejected (reachable) slots are the last resort, never an unreachable one
        reachable = [s for s in slots if s.instance.name not in unreachable]
        assert set(counts) <= {s.key for s in reachable}
        assert (None in chosen) == (not reachable)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp_sizes=shapes, data=st.data(), workers=st.sampled_from([1, 2]))
def test_a_slot_that_comes_back_gets_its_share_from_then_on_without_a_burst(
    dp_sizes: list[int], data: st.DataObject, workers: int
) -> None:
    clock = Clock()
    router = Router(workers, clock)
    table = RoutingTable("d", 1, Connector("nixl"), instances("p", dp_sizes), instances("d", [1]))
    slots = build_slot_table(table).prefill
    if len(slots) < 2:
        return  # a lone slot that is out is still the last resort
    out = data.draw(st.sampled_from(slots))
    router.books[0].eject(Role.PREFILL, out.key)
    before = data.draw(st.integers(0, 50))
    for k in range(before):  # served while it is out
        assert router.first(k % workers, Role.PREFILL, slots) != out
    clock.now += 10.5  # the cool-down is over: it is live again
    after = data.draw(st.integers(1, 60))
    counts = Counter(key_of(router.first(k % workers, Role.PREFILL, slots)) for k in range(after))
    assert_within_one(counts, slots)  # every slot, the one back included: no catch-up


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefill_dp=shapes,
    decode_instances=st.integers(1, 4),
    data=st.data(),
    requests=st.integers(1, 60),
)
def test_a_decode_sidecars_prefill_walk_is_exact_over_its_live_prefills(
    prefill_dp: list[int], decode_instances: int, data: st.DataObject, requests: int
) -> None:
    """Each sidecar walks its own (offset) prefill order; what is out leaves every sidecar's walk."""
    clock = Clock()
    table = RoutingTable(
        "d", 1, Connector("nixl"), instances("p", prefill_dp), instances("d", [2] * decode_instances)
    )
    index = data.draw(st.integers(0, decode_instances - 1))
    local = LocalDecode("http://127.0.0.1:8000", dp_size=2, name=f"d{index}", index=index)
    slots = build_sidecar_slot_table(table, local)
    router = Router(1, clock)
    ejected = data.draw(st.sets(st.sampled_from([s.key for s in slots.prefill])))
    for key in ejected:
        router.books[0].eject(Role.PREFILL, key)
    live = [s for s in slots.prefill if s.key not in ejected]
    counts = Counter(key_of(router.first(0, Role.PREFILL, slots.prefill)) for _ in range(requests))
    if live:
        assert_within_one(counts, live)
    # the sidecar's own decode ranks: one of them out, the other takes every turn, exactly
    router.books[0].eject(Role.DECODE, slots.decode[0].key)
    decodes = Counter(key_of(router.first(0, Role.DECODE, slots.decode)) for _ in range(requests))
    assert decodes == {slots.decode[1].key: requests}


def test_the_reported_skew_is_gone() -> None:
    """Two decode instances of DP2, one out: its turns no longer all fall to the next slot (the
    live ranks got 14 and 26 of 40 before; now 20 and 20)."""
    clock = Clock()
    router = Router(1, clock)
    table = RoutingTable("d", 1, Connector("nixl"), instances("p", [1]), instances("d", [2, 2]))
    decode = build_slot_table(table).decode  # d0/0, d1/0, d0/1, d1/1
    router.books[0].unreachable.mark(Role.DECODE, "d1")
    counts = Counter(key_of(router.first(0, Role.DECODE, decode)) for _ in range(40))
    assert counts == {"d0/0": 20, "d0/1": 20}
