"""Worker processes as one router (issue 13, item 2): the shared counter, the merged admin views."""

from __future__ import annotations

import multiprocessing
from collections import Counter

from pdserve.proxy.admin.merge import merge_debug, merge_served
from pdserve.proxy.policies import make_policy
from pdserve.proxy.policies.counters import LocalCounters
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.shared import (
    SharedConnections,
    SharedCounters,
    SharedInFlight,
    SharedState,
    key_hash,
    over_share,
    probe,
)
from pdserve.routing import Instance, Role, interleaved_slots
from tests.support.tables import choose


def _take_many(counters: SharedCounters, n: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put([counters.take("prefill", "") for _ in range(n)])


def test_shared_counter_hands_out_every_turn_once_across_processes() -> None:
    context = multiprocessing.get_context("fork")
    counters = SharedState(context.Lock()).counters
    out: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    procs = [context.Process(target=_take_many, args=(counters, 2000, out)) for _ in range(3)]
    for proc in procs:
        proc.start()
    taken = [value for _ in procs for value in out.get(timeout=30)]
    for proc in procs:
        proc.join(10)
    assert sorted(taken) == list(range(6000))  # no turn lost, none given twice
    assert counters.take("prefill", "") == 6000
    assert counters.take("decode", "rev-a") == 0  # one counter per (role, group)


def test_flat_interleaved_on_shared_counters_is_exact_whoever_asks() -> None:
    context = multiprocessing.get_context("fork")
    shared = SharedState(context.Lock()).counters
    slots = interleaved_slots(
        [Instance("a", "http://a", dp_size=3, ready=True), Instance("b", "http://b", ready=True)]
    )
    workers = [make_policy("flat-interleaved", shared) for _ in range(2)]  # two workers' policies
    book = SlotBook(10)
    firsts = Counter(choose(workers[i % 3 % 2], Role.PREFILL, slots, book)[0].key for i in range(40))
    assert firsts == {s.key: 10 for s in slots}


def test_probe_and_local_counters() -> None:
    assert probe([0, 0, 0, 0], 6) == 2
    assert probe([0, 0, 5, 0], 6) == 3  # linear probing past another key
    assert probe([0, 0, 6, 0], 6) == 2  # found
    assert probe([1, 2, 3, 5], 6) == -1  # full
    assert key_hash("counter", "prefill", "") != key_hash("counter", "decode", "")
    local = LocalCounters()
    assert [local.take("prefill", ""), local.take("prefill", ""), local.take("decode", "")] == [0, 1, 0]


def _served(worker: int, generation: int | None, in_flight: int, routable: bool) -> dict:  # type: ignore[type-arg]
    return {
        "worker": worker,
        "deployment": "d",
        "generation": generation,
        "source": "file x",
        "loaded_at": 100.0 + worker,
        "routable": {"prefill": 1, "decode": 1},
        "instances": {
            "p0": {"role": "prefill", "in_table": routable, "routable": routable, "in_flight": in_flight}
        },
        "slots": [{"role": "prefill", "instance": "p0", "dp_rank": 0, "in_flight": in_flight}],
        "error": None,
    }


def test_merged_served_view_sums_in_flight_and_reports_the_oldest_generation() -> None:
    merged = merge_served([_served(1, 8, 2, False), _served(0, 7, 3, True)])
    assert merged["generation"] == 7  # worker 0 still serves 7: the router is not past it
    assert merged["instances"]["p0"] == {
        "role": "prefill",
        "in_table": True,
        "routable": True,
        "in_flight": 5,
    }
    assert merged["slots"] == [{"role": "prefill", "instance": "p0", "dp_rank": 0, "in_flight": 5}]
    assert [w["generation"] for w in merged["workers"]] == [7, 8]
    assert "worker" not in merged
    assert merge_served([_served(0, None, 0, False), _served(1, 3, 0, True)])["generation"] is None


def test_merged_debug_view_sums_counts_and_keeps_the_longest_cool_down() -> None:
    def view(worker: int, requests: int, ejected: float) -> dict:  # type: ignore[type-arg]
        row = {"slot": "p0/0", "requests": requests, "in_flight": 1, "pinned": 0, "errors": 1, "ejections": 1}
        return {
            "worker": worker,
            "generation": 4,
            "loaded_at": 1.0,
            "unreachable": {"decode": {"d1": ejected}},
            "slots": {"prefill": [{**row, "ejected_for_seconds": ejected}], "decode": []},
        }

    merged = merge_debug([view(0, 3, 1.5), view(1, 4, 7.0)])
    row = merged["slots"]["prefill"][0]
    assert (row["requests"], row["in_flight"], row["errors"], row["ejections"]) == (7, 2, 2, 2)
    assert row["ejected_for_seconds"] == 7.0
    assert merged["unreachable"] == {"decode": {"d1": 7.0}}
    assert len(merged["workers"]) == 2


def test_shared_claims_and_deadlines() -> None:
    state = SharedState(multiprocessing.get_context("fork").Lock())
    claims = state.claims
    assert [claims.claim("x"), claims.claim("x"), claims.claim("y")] == [0, 1, 0]
    claims.release("x")
    claims.release("x")
    assert claims.claim("x") == 0  # released entries are removed, not left as tombstones
    assert [claims.rename(), claims.rename()] == [1, 2]
    for i in range(5000):  # far more ids than ever at once: deletions keep the table usable
        assert claims.claim(f"id-{i}") == 0
        claims.release(f"id-{i}")
    assert claims.claim("y") == 1
    deadlines = state.ejections
    assert deadlines.extend("prefill/a/0", until=110.0, now=100.0)  # newly ejected
    assert not deadlines.extend("prefill/a/0", until=111.0, now=101.0)  # extended, not new
    assert deadlines.until("prefill/a/0") == 111.0 and deadlines.latest() == 111.0
    assert state.unreachable.latest() == 0.0  # another kind, its own latest


def test_backward_shift_deletion_keeps_every_probe_run_reachable() -> None:
    import mmap

    from pdserve.proxy.state.shared import _INT, SharedTable

    table = SharedTable(mmap.mmap(-1, 8 * 16), 0, 8, multiprocessing.get_context("fork").Lock(), _INT)
    keys = [8, 16, 24, 3, 11, 7]  # 8, 16, 24 share home 0; 3 and 11 home 3; 7 wraps around
    for key in keys:
        table.add(key, 1)
    table.add(16, -1)
    table.add(3, -1)
    for key in (8, 24, 11, 7):
        assert table.get(key) == 1, key
    assert table.get(16) == 0 and table.get(3) == 0


def _legs(in_flight: SharedInFlight, worker: int, keys: list[str], out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    in_flight.bind(worker)
    for n, key in enumerate(keys):
        for _ in range(n + 1):
            in_flight.add("decode", key, 1)
    in_flight.add("decode", keys[0], -1)
    out.put(worker)


def test_legs_in_flight_are_summed_over_every_workers_own_array() -> None:
    context = multiprocessing.get_context("fork")
    state = SharedState(context.Lock(), workers=3)
    keys = [f"d{i}/0" for i in range(4)]
    out: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    procs = [context.Process(target=_legs, args=(state.in_flight, w, keys, out)) for w in (0, 1)]
    for proc in procs:
        proc.start()
    assert sorted(out.get(timeout=30) for _ in procs) == [0, 1]
    for proc in procs:
        proc.join(10)
    # Each of the two workers holds n + 1 legs on keys[n] (one fewer on keys[0]); worker 2 none.
    assert [state.in_flight.total("decode", key) for key in keys] == [0, 4, 6, 8]
    assert state.in_flight.total("prefill", keys[1]) == 0  # the role is part of the slot
    state.in_flight.bind(1)  # a restarted worker 1 starts from an empty array
    assert [state.in_flight.total("decode", key) for key in keys] == [0, 2, 3, 4]


def test_a_collision_can_only_over_count_and_the_smaller_row_wins() -> None:
    state = SharedState(multiprocessing.get_context("fork").Lock(), workers=1)
    in_flight = state.in_flight
    in_flight.bind(0)
    first, second = in_flight.cells("decode", "a/0")
    # Another slot that shares a's first-row cell, but not its second-row one.
    other = next(
        f"b{i}/0"
        for i in range(1_000_000)
        if in_flight.cells("decode", f"b{i}/0")[0] == first
        and in_flight.cells("decode", f"b{i}/0")[1] != second
    )
    for _ in range(5):
        in_flight.add("decode", other, 1)
    in_flight.add("decode", "a/0", 1)
    assert in_flight.total("decode", "a/0") == 1  # the second row has a alone
    assert in_flight.total("decode", other) == 5
    assert SharedInFlight.CELLS**2 > 1000 * 1000  # a thousand busy slots: double collisions are rare


def test_over_share_allows_rounding_and_a_margin_then_sheds() -> None:
    assert not over_share(1, 1, 2)  # one connection: someone has to hold it
    assert over_share(2, 2, 2) and not over_share(1, 2, 2)
    assert not over_share(2, 3, 2)  # 2 of 3: as even as 3 gets
    assert over_share(5, 8, 2) and not over_share(4, 8, 2)
    assert not over_share(33, 64, 2) and over_share(34, 64, 2)  # 5 % of a share: no churn at scale
    assert not over_share(3, 8, 3) and over_share(4, 8, 3)


def _open(connections: SharedConnections, worker: int, n: int) -> None:
    connections.bind(worker)
    connections.add(n)


def test_connection_counts_are_per_worker_and_seen_by_every_worker() -> None:
    context = multiprocessing.get_context("fork")
    connections = SharedState(context.Lock(), workers=2).connections
    procs = [context.Process(target=_open, args=(connections, w, n)) for w, n in ((0, 6), (1, 2))]
    for proc in procs:
        proc.start()
        proc.join(10)
    assert connections.counts() == [6, 2]
    connections.bind(0)  # a restarted worker 0: its connections died with it
    assert connections.counts() == [0, 2] and not connections.over_share()
    connections.add(5)
    assert connections.over_share()
    connections.add(-2)
    assert not connections.over_share()  # 3 of 5
