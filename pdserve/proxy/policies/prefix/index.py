"""What the router sent to each slot: a bounded index of chained chunk hashes per slot.

Per slot an LRU set of chunk hashes, at most ``capacity`` of them; over all slots one dictionary
from a chunk hash to the set of slots holding it (a bit mask: bit ``b`` for the slot numbered
``b``). So the longest match of a prompt on every slot at once is one walk down its hashes,
one probe each, that stops where the last slot drops out (:meth:`PrefixIndex.depths`): its cost
grows with the longest match, not with the number of slots.

A prompt is recorded last chunk first, so its first chunk is the most recently used and a
slot's index loses prompts from their tails, as vLLM frees a finished request's blocks tail
first (its free queue puts them in reverse, so that the common prefix is evicted last). A
prefix therefore stays whole until it goes, and a walk that stops at the first miss finds what
the engine would find.

A slot's index starts empty when the slot appears (:meth:`PrefixIndex.keep_only`) and goes with
it when the slot leaves the table (removed or draining); what a slot's index may hold is set by
:meth:`PrefixIndex.resize`, from the engine's KV capacity when it is known.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class SlotIndex:
    bit: int
    capacity: int
    chunks: OrderedDict[int, None] = field(default_factory=OrderedDict)


class PrefixIndex:
    """Chunk hashes per slot key, each slot's at most its ``capacity`` (LRU)."""

    def __init__(self, capacity: int) -> None:
        self.default_capacity = capacity
        self._slots: dict[str, SlotIndex] = {}
        self._holders: dict[int, int] = {}  # chunk hash -> bit mask of the slots holding it
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._capacities: dict[str, int] = {}  # set per slot before or after it appears

    # --- slots ------------------------------------------------------------------------------------

    def slot(self, key: str) -> SlotIndex:
        """The slot's index, made empty on first use."""
        found = self._slots.get(key)
        if found is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit + 1
            found = self._slots[key] = SlotIndex(bit, self._capacities.get(key, self.default_capacity))
        return found

    def bit(self, key: str) -> int:
        return 1 << self.slot(key).bit

    def slot_keys(self) -> list[str]:
        return list(self._slots)

    def keep_only(self, keys: Iterable[str]) -> list[str]:
        """Drop every slot not in ``keys`` (it left the table); the keys dropped."""
        keep = set(keys)
        gone = [key for key in self._slots if key not in keep]
        for key in gone:
            self.drop(key)
        return gone

    def drop(self, key: str) -> None:
        """Forget the slot, everything sent to it and its size; its bit may be reused by a new slot."""
        self._capacities.pop(key, None)
        entry = self._slots.pop(key, None)
        if entry is None:
            return
        clear = ~(1 << entry.bit)
        holders = self._holders
        for chunk in entry.chunks:
            mask = holders[chunk] & clear
            if mask:
                holders[chunk] = mask
            else:
                del holders[chunk]
        self._free_bits.append(entry.bit)

    def resize(self, key: str, capacity: int) -> None:
        """The slot holds at most ``capacity`` chunks from now on (its oldest go first)."""
        capacity = max(1, capacity)
        self._capacities[key] = capacity
        entry = self._slots.get(key)
        if entry is not None:
            entry.capacity = capacity
            self._evict(entry)

    def capacity(self, key: str) -> int:
        entry = self._slots.get(key)
        return entry.capacity if entry is not None else self._capacities.get(key, self.default_capacity)

    def size(self, key: str) -> int:
        entry = self._slots.get(key)
        return len(entry.chunks) if entry is not None else 0

    def total(self) -> int:
        """Distinct chunk hashes held by any slot."""
        return len(self._holders)

    # --- prompts ----------------------------------------------------------------------------------

    def record(self, key: str, hashes: Sequence[int]) -> None:
        """``hashes`` (one prompt's) were sent to the slot: last chunk first, so the prompt's head
        is the most recently used (module doc)."""
        entry = self.slot(key)
        bit = 1 << entry.bit
        chunks = entry.chunks
        holders = self._holders
        for chunk in reversed(hashes):
            if chunk in chunks:
                chunks.move_to_end(chunk)
            else:
                chunks[chunk] = None
                holders[chunk] = holders.get(chunk, 0) | bit
        self._evict(entry)

    def _evict(self, entry: SlotIndex) -> None:
        chunks = entry.chunks
        excess = len(chunks) - entry.capacity
        if excess <= 0:
            return
        clear = ~(1 << entry.bit)
        holders = self._holders
        for _ in range(excess):
            chunk, _ = chunks.popitem(last=False)
            mask = holders[chunk] & clear
            if mask:
                holders[chunk] = mask
            else:
                del holders[chunk]

    def depths(self, hashes: Sequence[int], among: int) -> dict[int, int]:
        """How many leading chunks of ``hashes`` each slot of the bit mask ``among`` holds, by bit
        mask of the slot; slots that hold not even the first chunk are left out."""
        out: dict[int, int] = {}
        alive = among
        holders = self._holders
        depth = 0
        for chunk in hashes:
            held = holders.get(chunk, 0) & alive
            dropped = alive & ~held
            if dropped and depth:
                _spread(dropped, depth, out)
            alive = held
            if not alive:
                return out
            depth += 1
        _spread(alive, depth, out)
        return out


def _spread(mask: int, depth: int, out: dict[int, int]) -> None:
    while mask:
        low = mask & -mask
        out[low] = depth
        mask ^= low
