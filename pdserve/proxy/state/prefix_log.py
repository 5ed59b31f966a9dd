"""The prefix index's records, passed between worker processes (pdserve.proxy.serving.workers).

The prefix-affinity policy (pdserve.proxy.policies.prefix_affinity) keeps an index of what was
sent to each prefill slot. The kernel gives a client's requests to any worker, so with one
index per worker a conversation's turns would land on whichever slot each worker chose first,
and its KV would be computed once per worker. Instead every worker keeps the whole index: each
publishes what it sends (slot, chunk hashes) in a ring of its own in shared memory, and reads
the others' rings before it chooses. One index, one copy per worker, kept in step without a lock.

A ring has one writer (its worker, whose single event loop never runs two appends at once) and
is read by the others. A record is ``[slot key hash, n, n chunk hashes]`` in native 8-byte words;
the writer copies it in, then advances its *head* (the count of words ever written, one word at
the ring's start): a reader that sees the new head sees the record whole. A reader that fell a
whole ring behind, or whose words were overwritten while it read them (it reads the head again
after copying), skips to the head and counts the records it lost: affinity degrades, nothing
else does. A record larger than a ring's quarter is not published.
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Iterator, Sequence

HEADER_WORDS = 1  # the head
RECORD_HEADER = 2  # slot key hash, chunk count


class PrefixLog:
    """``workers`` rings of ``words`` 8-byte words each, in one shared anonymous mapping."""

    def __init__(self, workers: int, words: int = 1 << 20) -> None:
        self.workers = workers
        self.words = words
        self._buf = mmap.mmap(-1, workers * (HEADER_WORDS + words) * 8)
        cells = memoryview(self._buf).cast("q")
        span = HEADER_WORDS + words
        self._rings = [cells[w * span : (w + 1) * span] for w in range(workers)]
        self._own = -1
        self._cursors = [0] * workers
        self.lost = 0  # records skipped because this reader fell behind

    def bind(self, worker: int) -> None:
        """This process is worker ``worker``: it writes its ring and reads from the others' heads
        on (a restarted worker does not replay what its index never had)."""
        self._own = worker
        self._cursors = [int(ring[0]) for ring in self._rings]

    def publish(self, slot_hash: int, chunks: Sequence[int]) -> bool:
        """Append one record to this worker's ring; False when it is too large to publish."""
        if self._own < 0:
            return False
        n = len(chunks)
        if RECORD_HEADER + n > self.words // 4:
            return False
        ring = self._rings[self._own]
        head = int(ring[0])
        self._write(ring, head, array("q", (_signed(slot_hash), n)))
        self._write(ring, head + RECORD_HEADER, array("q", chunks))
        ring[0] = head + RECORD_HEADER + n
        return True

    def _write(self, ring: memoryview, at: int, words: array[int]) -> None:
        size = self.words
        start = at % size
        first = min(len(words), size - start)
        ring[HEADER_WORDS + start : HEADER_WORDS + start + first] = words[:first]
        if first < len(words):
            ring[HEADER_WORDS : HEADER_WORDS + len(words) - first] = words[first:]

    def _read(self, ring: memoryview, at: int, n: int) -> list[int]:
        size = self.words
        start = at % size
        first = min(n, size - start)
        out = ring[HEADER_WORDS + start : HEADER_WORDS + start + first].tolist()
        if first < n:
            out += ring[HEADER_WORDS : HEADER_WORDS + n - first].tolist()
        return out

    def pending(self) -> bool:
        """Whether another worker published something this one has not read."""
        return any(int(ring[0]) != self._cursors[w] for w, ring in enumerate(self._rings) if w != self._own)

    def read(self) -> Iterator[tuple[int, list[int]]]:
        """``(slot key hash, chunk hashes)`` of every record the other workers published since
        the last read."""
        for w, ring in enumerate(self._rings):
            if w == self._own:
                continue
            cursor = self._cursors[w]
            head = int(ring[0])
            if head - cursor > self.words:  # lapped: what was there is overwritten
                self.lost += 1
                cursor = head
            records: list[tuple[int, list[int]]] = []
            while cursor < head:
                slot, n = self._read(ring, cursor, RECORD_HEADER)
                if not 0 <= n <= self.words // 4:  # torn by the writer lapping this reader
                    cursor = -1
                    break
                chunks = self._read(ring, cursor + RECORD_HEADER, n)
                records.append((slot & 0xFFFFFFFFFFFFFFFF, chunks))
                cursor += RECORD_HEADER + n
            if cursor < 0 or int(ring[0]) - self._cursors[w] > self.words:  # overwritten meanwhile
                self.lost += len(records)
                records = []
                cursor = int(ring[0])
            self._cursors[w] = cursor
            yield from records


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
