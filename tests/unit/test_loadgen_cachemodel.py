"""The offline prefix cache: leading full blocks hit, the last token is always computed, freed
blocks are evicted least recently used first (a prompt's tail before its head), one cache per rank."""

from __future__ import annotations

import pytest

from pdserve.loadgen.cachemodel import PrefixCache, block_keys, hit_counts, ideal_hit_ratio
from pdserve.loadgen.trace import TraceRequest


def _req(ids: tuple[int, ...], length: int | None = None) -> TraceRequest:
    return TraceRequest(0, length if length is not None else 512 * len(ids), 1, ids)


def test_block_keys_cut_trace_blocks_into_engine_blocks() -> None:
    assert block_keys(_req((7, 8), 600), 256) == [(7, 0), (7, 1)]  # 600 // 256 = 2 full blocks
    assert block_keys(_req((7, 8), 1024), 256) == [(7, 0), (7, 1), (8, 0), (8, 1)]
    with pytest.raises(ValueError):
        block_keys(_req((1,)), 48)


def test_shared_leading_blocks_hit_and_the_last_token_is_computed() -> None:
    cache = PrefixCache(block_size=16)
    assert cache.serve(_req((1, 2))) == 0
    assert cache.serve(_req((1, 3))) == 512
    assert cache.serve(_req((1, 2))) == 1024 - 16  # all cached: the last block is recomputed
    assert cache.serve(_req((1, 2), 1000)) == 992  # a partial last block: its full blocks hit
    assert (cache.counts.hits, cache.counts.queries) == (512 + 1008 + 992, 1024 * 3 + 1000)


def test_lru_evicts_the_least_recent_tail_first() -> None:
    cache = PrefixCache(block_size=256, capacity=4)  # two trace blocks' worth
    cache.serve(_req((1, 2), 1024))  # 4 blocks: (1,0) (1,1) (2,0) (2,1)
    # 2 new blocks: the tail of the first prompt, (2,1) then (2,0), makes room
    cache.serve(_req((3,), 512))
    assert list(cache.free) == [(1, 1), (1, 0), (3, 1), (3, 0)]
    assert cache.serve(_req((1, 2), 1024)) == 512  # (1,*) still there, (2,*) gone
    assert cache.serve(_req((3,), 512)) == 0  # evicted by the previous request


def test_a_request_larger_than_the_pool_never_runs() -> None:
    cache = PrefixCache(block_size=16, capacity=10)
    assert cache.serve(_req((1,))) == 0
    assert cache.counts.too_large == 1 and not cache.cached


def test_one_cache_per_rank() -> None:
    requests = [_req((1,)), _req((1,)), _req((1,)), _req((2,))]
    counts = hit_counts(requests, ranks=[0, 1, 0, 1], block_size=16)
    assert counts[0].hits == 496 and counts[1].hits == 0
    assert ideal_hit_ratio(requests) == pytest.approx(2 * 496 / 2048)


def test_blocks_holding_nothing_findable_are_in_the_same_lru_queue() -> None:
    cache = PrefixCache(block_size=256, capacity=4)
    cache.serve(_req((1,), 700))  # (1,0) (1,1) and a partial block, freed tail first
    assert list(cache.free)[1:] == [4, (1, 1), (1, 0)]  # the never-used block 3, then the partial one
    cache.serve(_req((2,), 256))  # one block: the never-used one
    cache.serve(_req((3,), 256))  # one block: the partial one, freed before (1,*)
    assert cache.cached == {(1, 0), (1, 1), (2, 0), (3, 0)}
    cache.serve(_req((4,), 256))  # now (1,1) goes
    assert cache.serve(_req((1,), 700)) == 256
