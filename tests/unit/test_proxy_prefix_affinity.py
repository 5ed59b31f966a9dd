"""The prefix-affinity prefill policy (issue 26): exact flat counts for unique prompts, the load
bound, shared prefixes together, the index's bounds and hygiene, workers and router replicas.

Hit ratios are the engines' own: every prompt runs through a vLLM-like KV block pool per slot
(pdserve.sim.engine.blocks, the simulator's prefix cache) under the simulator's tokenizer.
"""

from __future__ import annotations

import copy
import multiprocessing
import random
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.proxy.policies import ByRole, PrefixAffinity, PrefixOptions, make_policies, make_policy
from pdserve.proxy.policies.prefix.chunks import EMPTY, NON_TEXT, chunk_prompt
from pdserve.proxy.policies.prefix.index import PrefixIndex
from pdserve.proxy.policies.prefix_affinity import (
    AFFINITY,
    FLAT,
    RENDEZVOUS,
    SPREAD,
    load_bound,
    place,
)
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.prefix_log import PrefixLog
from pdserve.proxy.state.shared import SharedState
from pdserve.routing import Connector, Instance, Role, RoutingTable, Slot, build_slot_table, interleaved_slots
from pdserve.sim.engine.blocks import BlockPool, chain_hashes
from pdserve.sim.tokenizer import text_token_ids

SMALL = PrefixOptions(chunk_chars=16, min_match_chars=32)


def shape(dp_sizes: Sequence[int], draining: Sequence[int] = ()) -> tuple[Slot, ...]:
    return interleaved_slots(
        Instance(f"p{k}", f"http://127.0.0.1:{9000 + k}", dp_size=dp, ready=True, draining=k in draining)
        for k, dp in enumerate(dp_sizes)
    )


def table(dp_sizes: Sequence[int], draining: Sequence[int] = ()) -> RoutingTable:
    prefill = tuple(
        Instance(f"p{k}", f"http://127.0.0.1:{9000 + k}", dp_size=dp, ready=True, draining=k in draining)
        for k, dp in enumerate(dp_sizes)
    )
    decode = (Instance("d0", "http://127.0.0.1:9100", dp_size=1, ready=True),)
    return RoutingTable("t", 1, Connector("nixl"), prefill, decode)


def prefix_policy(options: PrefixOptions = SMALL, **kwargs: object) -> PrefixAffinity:
    return PrefixAffinity(options=options, **kwargs)  # type: ignore[arg-type]


def route(policy: PrefixAffinity, slots: Sequence[Slot], book: SlotBook, text: str) -> tuple[Slot, str]:
    """One request through the policy as the dispatcher runs it: turn, view, candidates, sent."""
    view = policy.view("completions", {"prompt": text})
    first = policy.candidates(Role.PREFILL, slots, book, policy.turn(Role.PREFILL), view)[0]
    policy.sent(Role.PREFILL, first, view)
    return first, view.how


# --- unique prompts: exactly the flat interleave --------------------------------------------------

dp_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    dp_sizes=dp_shapes,
    requests=st.integers(1, 60),
    events=st.lists(st.tuples(st.integers(0, 15), st.booleans()), max_size=80),
    ejected=st.sets(st.integers(0, 15), max_size=3),
)
def test_unique_prompts_get_exactly_the_flat_interleaves_slots(
    dp_sizes: list[int], requests: int, events: list[tuple[int, bool]], ejected: set[int]
) -> None:
    """Request by request the same slot as flat-interleaved, whatever the loads and ejections
    (heterogeneous DP included): so exactly its per-slot counts."""
    slots = shape(dp_sizes)
    book = SlotBook(10.0)
    for k in ejected:
        if k < len(slots):
            book.eject(Role.PREFILL, slots[k].key)
    flat, prefix = make_policy("flat-interleaved"), prefix_policy()
    rng = random.Random(len(slots) * 1000 + requests)
    counts: Counter[str] = Counter()
    for i in range(requests):
        slot_index, start = events[i % len(events)] if events else (0, True)
        key = slots[slot_index % len(slots)].key
        if start:
            book.started(Role.PREFILL, key)  # loads change between requests: no effect on flat choices
        elif book.in_flight(Role.PREFILL, key):
            book.finished(Role.PREFILL, key, ok=True)
        text = f"request {i} " + " ".join(rng.choice("abcdefgh") for _ in range(rng.randrange(0, 40)))
        expected = flat.candidates(Role.PREFILL, slots, book, flat.turn(Role.PREFILL))
        chosen, how = route(prefix, slots, book, text)
        assert chosen == expected[0]
        assert how == FLAT
        counts[chosen.key] += 1
    live = [s for s in slots if not book.ejected(Role.PREFILL, s.key)]
    per_slot = [counts[s.key] for s in live]
    assert max(per_slot, default=0) - min(per_slot, default=0) <= 1


# --- the load bound ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dp_sizes=dp_shapes,
    prefixes=st.integers(1, 4),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), min_size=1, max_size=150),
    balance=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
)
def test_the_load_bound_is_never_exceeded(
    dp_sizes: list[int], prefixes: int, steps: list[tuple[bool, int]], balance: float
) -> None:
    """Whatever arrives and finishes, a request placed by its prefix (affinity, spread) leaves its
    slot within ceil((1 + eps) x mean); with one prefix shared by every prompt (prefixes=1), that is
    every request after the first."""
    slots = shape(dp_sizes)
    book = SlotBook(10.0)
    policy = prefix_policy(PrefixOptions(chunk_chars=16, min_match_chars=32, balance=balance))
    heads = [f"shared system prompt number {k} " * 3 for k in range(prefixes)]
    running: list[str] = []
    for arrive, pick in steps:
        if not arrive and running:
            book.finished(Role.PREFILL, running.pop(pick % len(running)), ok=True)
            continue
        total = sum(book.in_flight(Role.PREFILL, s.key) for s in slots)
        chosen, how = route(policy, slots, book, heads[pick % prefixes] + f"question {pick}")
        after = book.in_flight(Role.PREFILL, chosen.key) + 1
        if how != FLAT:
            assert after <= load_bound(total, len(slots), balance), (how, after, total)
        elif prefixes == 1:
            assert total == 0 or not running  # only the very first placement is flat
        book.started(Role.PREFILL, chosen.key)
        running.append(chosen.key)


def test_one_hot_prefix_spreads_within_the_bound_and_not_onto_one_rank() -> None:
    slots = shape([2, 2])  # 4 slots
    book = SlotBook(10.0)
    policy = prefix_policy()
    head = "the one system prompt every request starts with " * 4
    for i in range(40):  # nothing finishes: the loads only grow
        chosen, _ = route(policy, slots, book, head + f"question {i}")
        book.started(Role.PREFILL, chosen.key)
    loads = [book.in_flight(Role.PREFILL, s.key) for s in slots]
    assert max(loads) <= load_bound(39, 4, 0.25) == 13 and min(loads) > 0, loads


def test_shared_prefixes_land_together_while_the_bound_allows() -> None:
    slots = shape([4])
    book = SlotBook(10.0)
    policy = prefix_policy()
    first, how = route(policy, slots, book, "conversation A: " + "hello there " * 10)
    assert how == FLAT
    for turn in range(1, 8):  # each request finishes before the next (loads stay 0)
        chosen, how = route(
            policy, slots, book, "conversation A: " + "hello there " * 10 + f"turn {turn} " * 5
        )
        assert (chosen, how) == (first, AFFINITY)
    # while the holder's load stays within the bound it still gets its prefix (4 slots, 4 legs
    # in flight elsewhere: the bound is ceil(1.25 * 6 / 4) = 2, the holder's load 1 + 1)
    book.started(Role.PREFILL, first.key)
    for other in slots:
        if other != first:
            book.started(Role.PREFILL, other.key)
    chosen, how = route(policy, slots, book, "conversation A: " + "hello there " * 10 + "again")
    assert (chosen, how) == (first, AFFINITY)


def test_a_holder_over_the_bound_passes_the_prefix_to_the_next_slot_within_it() -> None:
    slots = shape([4])
    book = SlotBook(10.0)
    policy = prefix_policy()
    head = "conversation B: " + "hello there " * 10
    first, _ = route(policy, slots, book, head)
    for _ in range(2):
        book.started(Role.PREFILL, first.key)
    other = next(s for s in slots if s != first)
    book.started(Role.PREFILL, other.key)
    # loads: first 2, other 1, two idle: bound ceil(1.25 * 4 / 4) = 2, so first is out
    chosen, how = route(policy, slots, book, head + "more")
    assert how == SPREAD and chosen != first and book.in_flight(Role.PREFILL, chosen.key) + 1 <= 2


def test_place_and_the_bound() -> None:
    assert load_bound(0, 4, 0.25) == 1
    assert load_bound(3, 4, 0.25) == 2  # mean 1 with this request: 1.25 -> 2
    assert load_bound(7, 4, 0.0) == 2
    order = ["a", "b", "c", "d"]
    # no match of the minimum: the flat interleave's slot, whatever the loads
    assert place(order, {"c": 1}, [9, 0, 0, 0], 0.25, 2) == place(order, {}, [9, 0, 0, 0], 0.25, 2)
    assert place(order, {}, [9, 0, 0, 0], 0.25, 2).position == 0
    # the longest match within the bound; ties: the first in the flat order
    assert place(order, {"b": 3, "c": 5, "d": 5}, [0, 0, 0, 0], 0.25, 2).position == 2
    assert place(order, {"b": 3, "c": 5}, [0, 0, 2, 0], 0.25, 2).position == 1
    # the match holders all over the bound: the first slot within it
    spread = place(order, {"a": 4}, [3, 0, 0, 0], 0.25, 2)
    assert (spread.position, spread.how) == (1, SPREAD)
    # rendezvous: the given order, within the bound
    assert place(order, {}, [0, 0, 2, 0], 0.25, 2, spread=[2, 3, 0, 1]) == place(
        order, {}, [0, 0, 2, 0], 0.25, 2, spread=[3, 0, 1, 2]
    )
    assert place(order, {}, [0, 0, 2, 0], 0.25, 2, spread=[2, 3, 0, 1]).how == RENDEZVOUS


# --- the index: memory and hygiene ---------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(capacity=st.integers(1, 50), prompts=st.lists(st.integers(1, 80), min_size=1, max_size=40))
def test_the_index_stays_within_its_bound(capacity: int, prompts: list[int]) -> None:
    index = PrefixIndex(capacity)
    rng = random.Random(capacity)
    for n, length in enumerate(prompts):
        key = f"s{n % 3}"
        index.record(key, [rng.randrange(1 << 20) for _ in range(length)])
        assert index.size(key) <= capacity
    assert all(index.size(k) <= capacity for k in index.slot_keys())
    assert index.total() <= sum(index.size(k) for k in index.slot_keys())
    index.resize("s0", 1)
    assert index.size("s0") <= 1


def test_the_index_memory_per_chunk_is_bounded() -> None:
    """Bytes the index allocates per chunk held (all slots): the figure the docs give."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(20_000)
        rng = random.Random(7)
        for key in ("a", "b", "c", "d"):
            for _ in range(40):
                index.record(key, [rng.getrandbits(63) for _ in range(1000)])
        held = sum(index.size(k) for k in index.slot_keys())
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held == 4 * 20_000
    assert used / held < 300, f"{used / held:.0f} bytes per chunk"


def test_a_prompt_is_kept_whole_until_its_head_goes() -> None:
    """Recorded tail first: eviction takes a prompt's tail before its head (vLLM's order)."""
    index = PrefixIndex(6)
    index.record("a", [1, 2, 3, 4])
    index.record("a", [10, 20, 30])  # 7 > 6: one chunk goes, the older prompt's tail
    assert index.depths([1, 2, 3, 4], index.bit("a")) == {index.bit("a"): 3}


def test_a_removed_or_draining_slot_gets_nothing_and_a_new_one_starts_empty() -> None:
    policy, book = prefix_policy(), SlotBook(10.0)
    served = build_slot_table(table([2, 2]))
    policy.table_changed(served)
    head = "conversation C: " + "words words " * 10
    first, _ = route(policy, served.prefill, book, head)
    assert policy.index.size(first.key) > 0
    # the holder's instance drains: out of the table, out of the index
    draining = int(first.instance.name[1:])
    served = build_slot_table(table([2, 2], draining=[draining]))
    policy.table_changed(served)
    assert first.key not in policy.index.slot_keys()
    for i in range(20):
        chosen, _ = route(policy, served.prefill, book, head + f"turn {i}")
        assert chosen.instance.name != first.instance.name
    # back again (same name: a new pod, an empty engine): it starts empty
    served = build_slot_table(table([2, 2]))
    policy.table_changed(served)
    assert policy.index.size(first.key) == 0


def test_an_ejected_holder_gets_no_affinity() -> None:
    slots = shape([4])
    policy, book = prefix_policy(), SlotBook(10.0)
    head = "conversation D: " + "words words " * 10
    first, _ = route(policy, slots, book, head)
    book.eject(Role.PREFILL, first.key)
    chosen, _ = route(policy, slots, book, head + "more")
    assert chosen != first
    candidates = policy.candidates(Role.PREFILL, slots, book, 0, policy.view("completions", {"prompt": head}))
    assert candidates[-1] == first  # a last resort only


def test_unchunkable_prompts_go_flat_and_are_counted() -> None:
    from prometheus_client import CollectorRegistry

    from pdserve.proxy.metrics import PrefixMetrics

    metrics = PrefixMetrics(CollectorRegistry())
    policy, book, slots = prefix_policy(metrics=metrics), SlotBook(10.0), shape([2])
    flat = make_policy("flat-interleaved")
    bodies = [
        ("completions", {"prompt": ""}),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        ),
        ("chat", {"messages": [{"role": "user", "content": ""}]}),
    ]
    for endpoint, body in bodies:
        view = policy.view(endpoint, body)
        chosen = policy.candidates(Role.PREFILL, slots, book, policy.turn(Role.PREFILL), view)[0]
        assert chosen == flat.candidates(Role.PREFILL, slots, book, flat.turn(Role.PREFILL))[0]
        policy.sent(Role.PREFILL, chosen, view)
    assert metrics.unchunkable.labels(EMPTY)._value.get() == 2
    assert metrics.unchunkable.labels(NON_TEXT)._value.get() == 1


# --- chunks ------------------------------------------------------------------------------------------


def test_chunks_follow_the_prompt_as_the_router_sees_it() -> None:
    chat = {
        "messages": [{"role": "system", "content": "be brief " * 10}, {"role": "user", "content": "hi " * 10}]
    }
    as_user = {
        "messages": [{"role": "user", "content": "be brief " * 10}, {"role": "user", "content": "hi " * 10}]
    }
    a, b = chunk_prompt("chat", chat, 16), chunk_prompt("chat", as_user, 16)
    assert a.hashes and a.hashes[0] != b.hashes[0]  # the role is part of the text
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "ok"}]}
    c = chunk_prompt("chat", longer, 16)
    assert c.hashes[: len(a.hashes) - 1] == a.hashes[: len(a.hashes) - 1]  # a shared head
    text = [{"type": "text", "text": "be brief " * 10}]
    parts = chunk_prompt("chat", {"messages": [{"role": "system", "content": text}, chat["messages"][1]]}, 16)
    assert parts.hashes == a.hashes  # text parts read as the string they make
    tools = chunk_prompt("chat", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 16)
    assert tools.hashes[0] != a.hashes[0]
    ids = chunk_prompt("completions", {"prompt": list(range(100))}, 16)
    assert len(ids.hashes) == 25 and ids.chars == 400
    assert (
        chunk_prompt("completions", {"prompt": ["only one"]}, 4).hashes
        == chunk_prompt("completions", {"prompt": "only one"}, 4).hashes
    )
    assert chunk_prompt("completions", {"prompt": "short"}, 16).hashes == []
    assert chunk_prompt("completions", {"prompt": ""}, 16).reason == EMPTY


# --- workers and routers: hit ratios of the engines ----------------------------------------------


@dataclass
class Engines:
    """A vLLM-like prefix cache per slot (the simulator's block pool), fed the prompts' tokens."""

    blocks: int
    block_size: int = 16
    pools: dict[str, BlockPool] = field(default_factory=dict)
    hit: int = 0
    queried: int = 0

    def serve(self, key: str, text: str) -> None:
        pool = self.pools.setdefault(key, BlockPool(self.blocks))
        hashes = chain_hashes(text_token_ids(text), self.block_size)
        hit = pool.longest_hit(hashes, len(hashes))
        pool.touch(hit)
        new = pool.take(len(hashes) - len(hit))
        for block, block_hash in zip(new, hashes[len(hit) :], strict=True):
            pool.register(block, block_hash)
        pool.release(list(reversed(hit + new)))
        self.hit += len(hit)
        self.queried += len(hashes)

    @property
    def ratio(self) -> float:
        return self.hit / self.queried


def conversations(count: int, turns: int, seed: int) -> list[str]:
    """Multi-turn chat prompts (a few shared system prompts, each turn the last one plus more),
    conversations interleaved at random."""
    rng = random.Random(seed)
    systems = [" ".join(f"sys{k}w{i}" for i in range(20)) for k in range(3)]
    state = {c: rng.choice(systems) for c in range(count)}
    left = {c: turns for c in range(count)}
    prompts = []
    while left:
        c = rng.choice(sorted(left))
        state[c] += " " + " ".join(f"c{c}t{left[c]}w{i}" for i in range(rng.randrange(20, 60)))
        prompts.append(state[c])
        left[c] -= 1
        if not left[c]:
            del left[c]
    return prompts


def replay(
    routers: Sequence[PrefixAffinity], pick: random.Random, prompts: Sequence[str], one_book: bool = False
) -> float:
    """Each prompt through one of ``routers`` (chosen by ``pick``), a few in flight at a time;
    ``one_book``: they count legs in flight together (a router's workers), else each its own
    (router replicas)."""
    slots = shape([2, 2])
    engines = Engines(blocks=120)
    books = [SlotBook(10.0)] * len(routers) if one_book else [SlotBook(10.0) for _ in routers]
    running: list[tuple[int, str]] = []
    for text in prompts:
        r = pick.randrange(len(routers))
        chosen, _ = route(routers[r], slots, books[r], text)
        books[r].started(Role.PREFILL, chosen.key)
        running.append((r, chosen.key))
        engines.serve(chosen.key, text)
        if len(running) > 3:
            done, key = running.pop(pick.randrange(len(running)))
            books[done].finished(Role.PREFILL, key, ok=True)
    return engines.ratio


OPTIONS = PrefixOptions(chunk_chars=64, min_match_chars=256, index_chunks=2000)


def test_two_workers_hit_within_five_points_of_one() -> None:
    """Two worker processes' policies, one shared counter and one index kept in step through the
    shared log, each taking whichever requests the kernel gives it (here: at random)."""
    prompts = conversations(count=40, turns=6, seed=3)
    one = replay([PrefixAffinity(options=OPTIONS)], random.Random(1), prompts)
    flat = replay([PrefixAffinity(options=PrefixOptions(min_match_chars=10**9))], random.Random(1), prompts)
    shared = SharedState(multiprocessing.get_context("fork").Lock(), 2, prefix_log_words=1 << 16)
    assert shared.prefix_log is not None
    logs = [shared.prefix_log, copy.copy(shared.prefix_log)]  # each worker's view of the rings
    for worker, log in enumerate(logs):
        log.bind(worker)
    workers = [PrefixAffinity(shared.counters, OPTIONS, log) for log in logs]
    served = build_slot_table(table([2, 2]))
    for policy in workers:
        policy.table_changed(served)
    two = replay(workers, random.Random(1), prompts, one_book=True)
    assert one > 2 * flat, (one, flat)  # the workload rewards affinity at all
    assert abs(one - two) <= 0.05, (one, two)


def test_router_replicas_agree_on_new_prefixes_by_rendezvous() -> None:
    prompts = conversations(count=40, turns=6, seed=5)
    one = replay([PrefixAffinity(options=OPTIONS)], random.Random(2), prompts)
    rendezvous = PrefixOptions(chunk_chars=64, min_match_chars=256, index_chunks=2000, unmatched="rendezvous")
    apart = replay([PrefixAffinity(options=OPTIONS) for _ in range(2)], random.Random(2), prompts)
    agreeing = replay([PrefixAffinity(options=rendezvous) for _ in range(2)], random.Random(2), prompts)
    # two routers that agree on new prefixes keep most of one router's hits; two that do not,
    # fewer (here 64 % for one router, 55 % and 46 %: the bench measures the Mooncake trace)
    assert agreeing - apart >= 0.05, (one, agreeing, apart)
    assert agreeing <= one
    # the same new prompt goes to the same slot from either router, whatever their turns
    slots, book = shape([2, 2]), SlotBook(10.0)
    a, b = PrefixAffinity(options=rendezvous), PrefixAffinity(options=rendezvous)
    b.turn(Role.PREFILL)
    for i in range(10):
        text = f"a brand new conversation {i} " * 5
        assert route(a, slots, book, text)[0] == route(b, slots, book, text)[0]


# --- the shared log between workers ------------------------------------------------------------


def test_the_log_passes_records_between_workers_and_counts_what_a_slow_reader_lost() -> None:
    log = PrefixLog(2, words=64)
    reader = copy.copy(log)
    log.bind(0)
    reader.bind(1)
    assert log.publish(7, [1, 2, 3])
    assert reader.pending()
    assert list(reader.read()) == [(7, [1, 2, 3])]
    assert not reader.pending()
    for n in range(10):  # 10 records of 5 words wrap a 64-word ring
        assert log.publish(n, [n, n + 1, n + 2])
        assert list(reader.read()) == [(n, [n, n + 1, n + 2])]
    assert not log.publish(1, list(range(40)))  # larger than a quarter of the ring
    for n in range(20):  # the reader falls a whole ring behind
        log.publish(n, [n, n, n])
    assert list(reader.read()) == []
    assert reader.lost == 1
    log.publish(99, [9])
    assert list(reader.read()) == [(99, [9])]


# --- composition ---------------------------------------------------------------------------------


def test_the_decode_keeps_its_policy_and_flat_stays_plain() -> None:
    assert not make_policies("flat-interleaved").reads_requests
    assert make_policies("flat-interleaved", "flat-interleaved").reads_requests is False
    both = make_policies("least-outstanding", "prefix-affinity")
    assert isinstance(both, ByRole) and both.reads_requests
    assert type(both.decode).__name__ == "LeastOutstanding"
    with pytest.raises(ValueError, match="unknown prefill policy 'random'"):
        make_policies("flat-interleaved", "random")
