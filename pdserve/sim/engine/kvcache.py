"""The KV cache manager of one engine rank: which blocks each request holds, prefix-cache
lookups, allocation for the tokens a step computes (vllm/v1/core/kv_cache_manager.py).

Rules kept from vLLM: a lookup stops one token short of the whole prompt (the last token is
always computed, to sample from it), only full blocks hit, blocks are registered under their
hash when the tokens that fill them are scheduled, and a request's blocks are released tail
first so its last blocks are the first evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.sim.engine.blocks import BlockPool
from pdserve.sim.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, caching)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.caching = caching
        self.blocks: dict[str, list[int]] = {}  # request id -> its blocks, in token order
        self._registered: dict[str, int] = {}  # request id -> how many of its blocks are hashed

    def usage(self) -> float:
        return self.pool.usage()

    def computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks of the request's longest cached prefix, and their tokens."""
        if not self.caching:
            return [], 0
        max_blocks = request.hash_blocks(request.num_tokens - 1, self.block_size)
        hit = self.pool.longest_hit(request.block_hashes, max_blocks)
        return hit, len(hit) * self.block_size

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed: Sequence[int] = (),
        num_external_tokens: int = 0,
        delay_caching: bool = False,
    ) -> bool:
        """Blocks for the request's computed tokens, the hits ``computed``, ``num_external_tokens``
        to be loaded and ``num_new_tokens`` to compute; False (nothing changed) when too few are
        free."""
        held = self.blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size + num_external_tokens
        needed_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        to_take = max(0, cdiv(needed_tokens, self.block_size) - len(held) - len(computed))
        if to_take + self.pool.count_free_among(computed) > self.pool.num_free:
            if not held:
                del self.blocks[request.request_id]
            return False
        self.pool.touch(computed)
        held += computed
        held += self.pool.take(to_take)
        if self.caching and not delay_caching:
            self.cache(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def cache(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks filled by its first ``num_tokens`` tokens."""
        if not self.caching:
            return
        held = self.blocks.get(request.request_id, [])
        done = self._registered.get(request.request_id, 0)
        if (num_tokens // self.block_size) <= done:
            return  # no block filled since the last call (a decode step, mostly)
        full = min(request.hash_blocks(num_tokens, self.block_size), len(held))
        hashes = request.block_hashes
        for i in range(done, full):
            self.pool.register(held[i], hashes[i])
        self._registered[request.request_id] = max(done, full)

    def free(self, request: Request) -> None:
        held = self.blocks.pop(request.request_id, [])
        self._registered.pop(request.request_id, None)
        self.pool.release(reversed(held))

    def block_ids(self, request: Request) -> list[int]:
        return list(self.blocks.get(request.request_id, []))
