"""The KV block pool of one engine rank, as vLLM V1 keeps it (vllm/v1/core/block_pool.py).

Blocks hold ``block_size`` tokens. A full block of a request gets a hash chained to its
parent's (so equal hashes mean equal prefixes, not just equal blocks) and is registered under
it; a later request whose prompt starts with the same full blocks reuses them (a prefix-cache
hit) instead of computing them. A block whose last user finished goes to the tail of the free
queue but keeps its hash: it can still be hit until a new allocation takes it from the head
(least recently freed first) and evicts it. Block 0 is vLLM's null block and never handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

#: The parent of a request's first block (vLLM seeds its chain the same way, with a constant).
ROOT_HASH = 0x5EED_B10C


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, start: int = 0
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block ``start`` on (``parent`` is block
    ``start - 1``'s hash), each over its parent and its own token ids."""
    out = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[begin : begin + block_size])))
        out.append(parent)
    return out


class BlockPool:
    """Reference counts, hashes and the LRU free queue of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.caching = caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # Free blocks, evicted from the front; a dict keeps insertion order with O(1) removal.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the share of blocks (the null block aside) not free."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.caching else None

    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks of the longest run of leading ``hashes`` (at most ``max_blocks``)."""
        out: list[int] = []
        if not self.caching:
            return out
        for i in range(min(max_blocks, len(hashes))):
            block = self.cached.get(hashes[i])
            if block is None:
                break
            out.append(block)
        return out

    def take(self, count: int) -> list[int]:
        """``count`` blocks from the head of the free queue, evicting what they cached."""
        if count > len(self.free):
            raise ValueError(f"asked for {count} blocks, {len(self.free)} free")
        out = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.block_hash[block] = None
                self.evictions += 1
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """A hit: the blocks get one more user and leave the free queue if they were in it."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free[block]
            self.ref_cnt[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One user fewer; blocks nobody uses go to the tail of the free queue (in the order
        given: pass a request's blocks tail first, so its last blocks are evicted first)."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None

    def register(self, block: int, block_hash: int) -> None:
        """A block just became full: make it findable by its hash (the first block with a hash
        keeps it, as vLLM serves hits from the first registered copy)."""
        if not self.caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self.cached.setdefault(block_hash, block)

    def count_free_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them uses up free blocks)."""
        return sum(1 for b in blocks if self.ref_cnt[b] == 0)
