"""An offline prefix cache over a trace's blocks: what hit ratio a cache of a given size would get.

vLLM's model (V1 ``KVCacheManager``, the simulator's too): a prompt is cut into full blocks of
``block_size`` tokens, each identified by its content and every block before it; a request reuses
the longest run of leading blocks still cached, at most ``prompt - 1`` tokens (the last token is
always computed); its blocks stay cached after it finishes, on an LRU free queue (freed in reverse
order, so a prompt's tail is evicted before its head), until a new block needs the room.

Here requests are served one after another (no two hold blocks at once), so the figure is what an
engine that is never busy would get; the replay measures the real one. Block identity comes from
the trace alone: a block of ``block_size`` tokens inside 512-token trace block ``j`` is
``(hash_ids[j], offset)``, as the replayer's prompts make it (:mod:`pdserve.loadgen.prompts`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.loadgen.trace import BLOCK_TOKENS, TraceRequest

BlockKey = tuple[int, int]


def block_keys(request: TraceRequest, block_size: int) -> list[BlockKey]:
    """The request's full prompt blocks of ``block_size`` tokens, in order."""
    if block_size < 1 or BLOCK_TOKENS % block_size:
        raise ValueError(f"block_size must divide {BLOCK_TOKENS}, got {block_size}")
    per_trace_block = BLOCK_TOKENS // block_size
    full = request.input_length // block_size
    return [(request.hash_ids[b // per_trace_block], b % per_trace_block) for b in range(full)]


@dataclass
class CacheCounts:
    queries: int = 0  # prompt tokens
    hits: int = 0  # prompt tokens found cached
    requests: int = 0
    too_large: int = 0  # requests needing more blocks than the whole pool (never scheduled)

    @property
    def hit_ratio(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class PrefixCache:
    """One engine's KV pool of ``capacity`` usable blocks (None: unbounded), as vLLM's block pool:
    one free queue of every block not in use, hashed or not, taken from the head (the least
    recently freed first, evicting what it held) and refilled at the tail."""

    def __init__(self, block_size: int, capacity: int | None = None) -> None:
        self.block_size = block_size
        self.capacity = capacity
        # Free blocks, LRU first: a BlockKey for a block that can still be hit, an int for one that
        # holds nothing findable (never used, a partial block, or a second copy of a cached one).
        self.free: OrderedDict[BlockKey | int, None] = OrderedDict()
        self.cached: set[BlockKey] = set()
        self._blank = 0
        if capacity is not None:
            for _ in range(capacity):
                self._add_blank()
        self.counts = CacheCounts()

    def _add_blank(self) -> None:
        self.free[self._blank] = None
        self._blank += 1

    def serve(self, request: TraceRequest, extra_tokens: int = 0) -> int:
        """Run ``request`` alone (holding room for ``extra_tokens`` more, e.g. a decode's output)
        and free its blocks; returns its cached prompt tokens."""
        keys = block_keys(request, self.block_size)
        needed = math.ceil((request.input_length + extra_tokens) / self.block_size)
        self.counts.queries += request.input_length
        self.counts.requests += 1
        if self.capacity is not None and needed > self.capacity:
            self.counts.too_large += 1
            return 0
        limit = (request.input_length - 1) // self.block_size
        hit = 0
        while hit < min(len(keys), limit) and keys[hit] in self.cached:
            hit += 1
        for key in keys[:hit]:  # in use now: out of the free queue
            del self.free[key]
        for _ in range(needed - hit):  # new blocks from the head of the free queue
            if self.capacity is None:
                break
            entry, _ = self.free.popitem(last=False)
            if not isinstance(entry, int):
                self.cached.discard(entry)  # evicted
        held: list[BlockKey | int] = list(keys[:hit])
        for key in keys[hit:]:  # filled now: findable, unless a copy is already cached
            if key in self.cached:
                held.append(self._blank)
                self._blank += 1
            else:
                self.cached.add(key)
                held.append(key)
        while len(held) < needed:  # the partial last block, room for extra tokens
            held.append(self._blank)
            self._blank += 1
        for entry in reversed(held):  # freed tail first: the prompt's head is evicted last
            self.free[entry] = None
        tokens = hit * self.block_size
        self.counts.hits += tokens
        return tokens


def hit_counts(
    requests: Iterable[TraceRequest],
    ranks: Sequence[int] | None = None,
    block_size: int = 16,
    capacity: int | None = None,
    extra_tokens: int = 0,
) -> dict[int, CacheCounts]:
    """Serve the requests in order, request ``i`` on cache ``ranks[i]`` (all on rank 0 without
    ``ranks``); every rank's counts."""
    caches: dict[int, PrefixCache] = {}
    for i, request in enumerate(requests):
        rank = ranks[i] if ranks is not None else 0
        cache = caches.setdefault(rank, PrefixCache(block_size, capacity))
        cache.serve(request, extra_tokens)
    return {rank: cache.counts for rank, cache in sorted(caches.items())}


def ideal_hit_ratio(requests: Iterable[TraceRequest], block_size: int = 16) -> float | None:
    """One unbounded cache: the most prefix reuse the requests allow."""
    counts = hit_counts(requests, block_size=block_size)
    return counts[0].hit_ratio if counts else None
