"""The simulator's step engine as a pure state machine: every test drives the scheduler step by
step with made-up times (no clock, no event loop), and checks what vLLM V1 would do."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.sim.engine.request import Kind, Request, Status
from pdserve.sim.engine.scheduler import EngineConfig, Scheduler, Step

BASE = EngineConfig(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    block_size=4,
    num_gpu_blocks=65,  # 64 usable: block 0 is the null block
    max_model_len=128,
)


_fresh = iter(range(10**6, 10**9, 10**4))


def req(rid: str, prompt: list[int] | int, max_tokens: int = 4, kind: Kind = Kind.PLAIN) -> Request:
    """A request; an int prompt is that many token ids shared with no other request."""
    if isinstance(prompt, int):
        start = next(_fresh)
        prompt = list(range(start, start + prompt))
    return Request(rid, list(prompt), max_tokens, arrival=0.0, kind=kind)


def run(s: Scheduler, t: float = 1.0) -> tuple[Step, list[Request]]:
    step = s.schedule(t)
    return step, s.finish_step(step, t + 0.01)


def drain(s: Scheduler, limit: int = 1000) -> int:
    """Steps until nothing is left to compute."""
    for n in range(limit):
        if not s.has_work:
            return n
        run(s, float(n))
    raise AssertionError("the scheduler did not finish")


def test_token_budget_splits_a_long_prompt_into_chunks() -> None:
    s = Scheduler(BASE)
    r = req("a", 150 - 22)  # 128 tokens, budget 64: two prefill chunks
    s.add(r)
    step, out = run(s)
    assert [(x.request_id, n) for x, n in step.scheduled] == [("a", 64)]
    assert step.prefill_tokens == 64 and out == []  # a partial prefill samples nothing
    step, out = run(s)
    assert [n for _, n in step.scheduled] == [64] and out == [r]
    assert r.num_output_tokens == 1 and r.first_token is not None


def test_decodes_first_then_the_budget_left_goes_to_waiting_prefills() -> None:
    s = Scheduler(BASE)
    a, b = req("a", 10, max_tokens=10), req("b", 100)
    s.add(a)
    run(s)  # a prefilled: decoding from now on
    s.add(b)
    step, _ = run(s)
    assert [(x.request_id, n) for x, n in step.scheduled] == [("a", 1), ("b", 63)]
    assert (step.decode_seqs, step.prefill_tokens) == (1, 63)
    step, _ = run(s)
    assert [(x.request_id, n) for x, n in step.scheduled] == [("a", 1), ("b", 37)]


def test_max_num_seqs_caps_the_batch_and_the_rest_waits_fcfs() -> None:
    s = Scheduler(replace(BASE, max_num_seqs=2))
    requests = [req(f"r{i}", 4 + i, max_tokens=3) for i in range(4)]
    for r in requests:
        s.add(r)
    step, _ = run(s)
    assert [x.request_id for x, _ in step.scheduled] == ["r0", "r1"]
    assert [x.request_id for x in s.waiting] == ["r2", "r3"]
    run(s)
    step, _ = run(s)  # r0 and r1 finish on their third token
    assert requests[0].status is Status.FINISHED and requests[1].status is Status.FINISHED
    step, _ = run(s)
    assert [x.request_id for x, _ in step.scheduled] == ["r2", "r3"]


def test_a_request_that_does_not_fit_blocks_the_queue_head_of_line() -> None:
    s = Scheduler(replace(BASE, num_gpu_blocks=9, max_num_batched_tokens=200))  # 8 usable blocks
    big, small = req("big", 20, max_tokens=20), req("small", 3)
    s.add(big)
    run(s)  # big holds 6 blocks (21 tokens after its first token)
    s.add(req("x", 12))  # needs 3 blocks, 2 free: waits
    s.add(small)  # would fit, but FCFS: behind x
    step, _ = run(s)
    assert [x.request_id for x, _ in step.scheduled] == ["big"]
    assert [x.request_id for x in s.waiting] == ["x", "small"]


def test_preemption_by_recompute_when_kv_runs_out() -> None:
    # 8 usable blocks; each request alone needs up to 7 (27 tokens computed), both together 14
    s = Scheduler(replace(BASE, num_gpu_blocks=9, max_num_batched_tokens=100))
    first, second = req("first", 8, max_tokens=20), req("second", 8, max_tokens=20)
    s.add(first)
    s.add(second)
    run(s)
    preempted = []
    for n in range(20):
        step, _ = run(s, float(n))
        preempted += step.preempted
        if preempted:
            break
    assert preempted == [second]  # the most recently admitted running request goes
    assert second.status is Status.PREEMPTED and second.num_computed_tokens == 0
    assert s.kv.block_ids(second) == [] and s.waiting[0] is second
    assert s.counters.preemptions == 1 and second.num_preemptions == 1
    outputs = second.num_output_tokens
    assert drain(s) > 0
    # recomputed from scratch (prompt and its outputs), and it still ends with its 20 tokens
    assert second.status is Status.FINISHED and second.num_output_tokens == 20 and outputs > 0
    assert first.num_output_tokens == 20


def test_a_preempted_requests_lookup_is_not_counted_again() -> None:
    s = Scheduler(replace(BASE, num_gpu_blocks=9, max_num_batched_tokens=100))
    s.add(req("first", 8, max_tokens=20))
    s.add(req("second", 8, max_tokens=20))
    drain(s)
    assert s.counters.preemptions >= 1
    assert s.counters.prefix_queries == 16  # the two admissions, not the re-admission


def test_shared_prefix_hits_exactly_its_full_blocks() -> None:
    s = Scheduler(BASE)
    shared = list(range(10))  # 2 full blocks of 4, and 2 tokens of a third
    a = req("a", [*shared, 50, 51, 52])
    s.add(a)
    drain(s)
    b = req("b", [*shared, 60, 61, 62])
    s.add(b)
    run(s)
    assert b.num_cached_tokens == 8  # only the full blocks: 10 shared tokens hit 8
    assert (s.counters.prefix_queries, s.counters.prefix_hits) == (26, 8)


def test_a_whole_repeated_prompt_still_computes_its_last_block() -> None:
    """vLLM stops a lookup one token short of the prompt, so a fully cached prompt recomputes
    its last block (170 tokens in blocks of 128: 128 cached, as real vLLM answers)."""
    s = Scheduler(
        replace(BASE, block_size=128, num_gpu_blocks=10, max_num_batched_tokens=2048, max_model_len=512)
    )
    prompt = list(range(170))
    for name in ("a", "b", "c"):
        s.add(req(name, prompt, max_tokens=2))
        drain(s)
    assert (s.counters.prefix_queries, s.counters.prefix_hits) == (510, 256)
    exact = req("d", list(range(500, 756)), max_tokens=1)
    s.add(req("e", list(range(500, 756)), max_tokens=1))
    drain(s)
    s.add(exact)
    run(s)
    assert exact.num_cached_tokens == 128  # 256 tokens = 2 full blocks, the second is recomputed


def test_prefix_hits_need_the_same_parent_chain() -> None:
    s = Scheduler(BASE)
    s.add(req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    drain(s)
    moved = req("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])  # the second block alone matches
    s.add(moved)
    run(s)
    assert moved.num_cached_tokens == 0


def test_freed_blocks_stay_cached_until_lru_eviction() -> None:
    s = Scheduler(replace(BASE, num_gpu_blocks=9, max_num_batched_tokens=200))  # 8 usable blocks
    old, newer = req("old", 8, max_tokens=1), req("newer", list(range(500, 508)), max_tokens=1)
    s.add(old)
    drain(s)
    s.add(newer)
    drain(s)
    assert s.kv.pool.num_free == 8  # both finished; their 2 x 3 blocks are free and still cached
    again = req("again", [*old.token_ids[:8], 99])
    s.add(again)
    drain(s)
    assert again.num_cached_tokens == 8
    # 6 fresh blocks take the never-used ones first, then the least recently freed: "newer"'s
    # ("again" freed old's blocks after newer's, so they are the most recently used)
    s.add(req("filler", list(range(900, 924)), max_tokens=1))
    run(s)
    probe_old, probe_newer = req("p1", [*old.token_ids[:8], 7]), req("p2", [*newer.token_ids[:8], 7])
    assert s.kv.computed_blocks(probe_old)[1] == 8
    assert s.kv.computed_blocks(probe_newer)[1] == 0
    assert s.kv.pool.evictions > 0


def test_prefix_caching_off_never_hits() -> None:
    s = Scheduler(replace(BASE, enable_prefix_caching=False))
    for name in ("a", "b"):
        s.add(req(name, 20, max_tokens=1))
        drain(s)
    assert s.counters.prefix_queries == 0 and s.counters.prefix_hits == 0
    assert s.kv.pool.cached == {}


def test_blocks_are_freed_on_finish_and_on_abort() -> None:
    s = Scheduler(BASE)
    done, gone, queued = req("done", 10, max_tokens=1), req("gone", 10, max_tokens=50), req("q", 10)
    s.add(done)
    s.add(gone)
    run(s)
    assert s.kv.block_ids(done) == [] and len(s.kv.block_ids(gone)) == 3
    s.abort(gone)
    s.add(queued)
    s.abort(queued)
    assert gone.status is Status.ABORTED and s.kv.pool.num_free == 64
    assert not s.running and not s.waiting


def test_prefill_leg_holds_its_blocks_until_pulled() -> None:
    s = Scheduler(BASE)
    leg = req("p1", 10, max_tokens=1, kind=Kind.PREFILL)
    s.add(leg)
    run(s, 5.0)
    assert leg.status is Status.FINISHED and s.kv.block_ids(leg) != []
    assert s.kv.pool.num_free == 64 - 3 and s.next_lease_expiry() == pytest.approx(5.01 + 30)
    assert s.release_held("p1") and s.kv.pool.num_free == 64
    assert not s.release_held("p1")
    again = req("p2", leg.token_ids[:10], max_tokens=1, kind=Kind.PREFILL)
    s.add(again)
    run(s)
    assert again.num_cached_tokens == 8  # released blocks stay in the prefix cache


def test_a_lease_ends_after_kv_lease_duration() -> None:
    s = Scheduler(replace(BASE, kv_lease_seconds=30.0))
    s.add(req("p1", 10, max_tokens=1, kind=Kind.PREFILL))
    run(s, 100.0)
    assert s.expire_leases(129.9) == 0 and s.held
    assert s.expire_leases(130.02) == 1 and not s.held
    assert s.counters.expired_leases == 1 and s.kv.pool.num_free == 64


def test_decode_leg_allocates_the_prompt_then_pulls_what_is_not_cached() -> None:
    s = Scheduler(BASE)
    leg = req("d1", 10, max_tokens=3, kind=Kind.DECODE)
    s.add(leg)
    step, _ = run(s)
    assert step.pulls == [leg] and step.scheduled == []
    assert leg.status is Status.WAITING_FOR_REMOTE_KVS and len(s.kv.block_ids(leg)) == 3
    assert leg.num_external_tokens == 10
    assert (s.counters.external_queries, s.counters.external_hits) == (10, 10)
    assert not s.has_work  # nothing to compute until the pull ends
    s.remote_kv_loaded(leg)
    step, out = run(s)
    assert [(x, n) for x, n in step.scheduled] == [(leg, 1)]  # only the last prompt token
    assert out == [leg] and leg.num_cached_tokens == 9
    drain(s)
    assert leg.num_output_tokens == 3 and s.kv.pool.num_free == 64
    # a second decode of the same prompt finds 2 blocks here and pulls only the rest
    again = req("d2", leg.token_ids[:10], max_tokens=1, kind=Kind.DECODE)
    s.add(again)
    run(s)
    assert again.num_external_tokens == 2
    assert (s.counters.external_queries, s.counters.external_hits) == (12, 12)
    assert (s.counters.prefix_queries, s.counters.prefix_hits) == (20, 8)


def test_decode_leg_blocks_count_for_prompt_and_output() -> None:
    s = Scheduler(BASE)
    leg = req("d1", 8, max_tokens=9, kind=Kind.DECODE)
    s.add(leg)
    run(s)
    assert len(s.kv.block_ids(leg)) == 2
    s.remote_kv_loaded(leg)
    peak = 0
    while s.has_work:
        run(s)
        peak = max(peak, len(s.kv.block_ids(leg)))
    assert peak == 4  # 8 prompt + 8 computed outputs (the 9th is sampled, never computed): 16 = 4 blocks


def test_an_aborted_decode_leg_frees_its_blocks_while_pulling() -> None:
    s = Scheduler(BASE)
    leg = req("d1", 10, kind=Kind.DECODE)
    s.add(leg)
    run(s)
    s.abort(leg)
    s.remote_kv_loaded(leg)  # the pull ends after the client left: nothing happens
    assert s.kv.pool.num_free == 64 and leg.status is Status.ABORTED and not s.waiting


def test_step_figures_feed_the_profile() -> None:
    s = Scheduler(BASE)
    a = req("a", 10, max_tokens=5)
    s.add(a)
    run(s)
    s.add(req("b", 20))
    step = s.schedule(2.0)
    assert (step.decode_seqs, step.prefill_tokens) == (1, 20)
    assert step.context_tokens == 11 + 20  # the KV each sequence attends over
