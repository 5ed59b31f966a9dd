"""State the worker processes share (pdserve.proxy.serving.workers), in one shared anonymous memory
mapping made by the supervisor before it forks and inherited by every worker.

Python has no atomic operations on shared memory. What must be read-modify-written by several
processes (a counter, a deadline, a claim) sits in a small hash table under one
process-shared lock (a ``multiprocessing`` lock of the fork context: a POSIX semaphore, no
system call when uncontended), held for a probe of a few entries, never across an ``await``.
A table is ``entries`` pairs of a non-zero 64-bit key (a hash of a string; 0 marks a free
entry) and an 8-byte value, placed by linear probing; :meth:`SharedTable.add` removes an entry
whose value falls to 0 (backward-shift deletion, no tombstones), so a table of request ids in
flight never fills up with finished ones. Keys and values are native 8-byte words at 8-byte
offsets: a read sees a word whole, never half of an update.

The lock is per request's work, so the hot path takes it as rarely as it can (a py-spy
profile showed the shared state as a visible share of a worker's CPU per request when every
operation took it): reads of tables whose entries never move go without it, and the legs in
flight are counted without a table at all (:class:`SharedInFlight`).

What is shared (and why a per-worker copy would not do):

* the policies' counters (:class:`SharedCounters`): flat-interleaved is exact only with ONE
  counter per role;
* cool-downs (:class:`SharedDeadlines`): a slot ejected or an instance found unreachable by one
  worker is so for all, at once, and is counted once;
* the client request ids in flight (``claims``): two requests with one ``X-Request-Id`` on two
  workers must still get different engine ids;
* legs in flight per slot (:class:`SharedInFlight`): the per-slot limit is the router's;
* client connections open per worker (:class:`SharedConnections`): what keeps a few long-lived
  connections evenly spread over the workers;
* with the prefix-affinity policy, what each worker sends where (pdserve.proxy.state.prefix_log):
  the prefix index is the router's, not one worker's.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import struct
from typing import Any

from pdserve.proxy.state.prefix_log import PrefixLog

# Native words (no byte order given): packed and unpacked with one 8-byte copy each.
_KEY = struct.Struct("Q")
_INT = struct.Struct("q")
_FLOAT = struct.Struct("d")
ENTRY_BYTES = 16


def key_hash(*parts: str) -> int:
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1  # 0 marks a free entry


#: The hashes of the few keys every request touches (slots, counters), computed once each:
#: blake2b per shared operation was a visible share of a worker's CPU (py-spy, two workers).
slot_hash = functools.lru_cache(maxsize=8192)(key_hash)


def probe(keys: list[int], key: int) -> int:
    """Index of ``key`` among ``keys`` (0 = free), or of the free entry it would take; -1 when
    the table is full and ``key`` is not in it. Pure (the unit tests use it)."""
    n = len(keys)
    start = key % n
    for step in range(n):
        i = (start + step) % n
        if keys[i] in (0, key):
            return i
    return -1


class SharedTable:
    """One table in a region of a shared mapping; every method but :meth:`peek` takes the lock."""

    def __init__(self, buf: mmap.mmap, offset: int, entries: int, lock: Any, value: struct.Struct) -> None:
        self._buf = buf
        self._base = offset
        self._n = entries
        self._lock = lock
        self._value = value

    def _key_at(self, i: int) -> int:
        return int(_KEY.unpack_from(self._buf, self._base + i * ENTRY_BYTES)[0])

    def _find(self, key: int) -> int:
        start = key % self._n
        for step in range(self._n):
            i = (start + step) % self._n
            found = self._key_at(i)
            if found in (0, key):
                return i
        return -1

    def _get(self, i: int) -> Any:
        return self._value.unpack_from(self._buf, self._base + i * ENTRY_BYTES + 8)[0]

    def _put(self, i: int, key: int, value: Any) -> None:
        _KEY.pack_into(self._buf, self._base + i * ENTRY_BYTES, key)
        self._value.pack_into(self._buf, self._base + i * ENTRY_BYTES + 8, value)

    def get(self, key: int, default: Any = 0) -> Any:
        with self._lock:
            return self.get_locked(key, default)

    def get_locked(self, key: int, default: Any = 0) -> Any:
        """:meth:`get` for a caller that holds the lock already; also :meth:`peek`."""
        i = self._find(key)
        if i < 0 or self._key_at(i) == 0:
            return default
        return self._get(i)

    #: A read without the lock, only for a table whose entries never move (nothing is ever
    #: deleted from it): a concurrent writer's entry is then seen whole, or not yet.
    peek = get_locked

    def add(self, key: int, delta: int) -> int:
        """Add ``delta``; the value before. An entry that reaches 0 is removed. A full table
        answers 0 and keeps nothing (the callers then behave as one process would)."""
        with self._lock:
            i = self._find(key)
            if i < 0:
                return 0
            old = int(self._get(i)) if self._key_at(i) == key else 0
            new = old + delta
            if new == 0:
                if self._key_at(i) == key:
                    self._delete(i)
            else:
                self._put(i, key, new)
            return old

    def raise_to(self, key: int, value: float) -> float:
        """Set the value to ``max(old, value)``; the value before (0.0 if absent)."""
        with self._lock:
            i = self._find(key)
            if i < 0:
                return 0.0
            old = float(self._get(i)) if self._key_at(i) == key else 0.0
            if value > old:
                self._put(i, key, value)
            return old

    def clear(self) -> None:
        with self._lock:
            self._buf[self._base : self._base + self._n * ENTRY_BYTES] = bytes(self._n * ENTRY_BYTES)

    def _delete(self, i: int) -> None:
        """Backward-shift deletion: later entries of the same probe run move up into the hole."""
        n = self._n
        j = i
        while True:
            j = (j + 1) % n
            key = self._key_at(j)
            if key == 0:
                break
            home = key % n
            # Move the entry at j into the hole at i unless its home lies cyclically in (i, j].
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                self._put(i, key, self._get(j))
                i = j
        self._put(i, 0, self._value.unpack(bytes(self._value.size))[0])


class SharedCounters:
    """The policies' counters (pdserve.proxy.policies.counters.Counters) in a shared table."""

    def __init__(self, table: SharedTable) -> None:
        self._table = table

    def take(self, role: str, group: str) -> int:
        return self._table.add(slot_hash("counter", role, group), 1)


class SharedDeadlines:
    """Cool-downs shared by the workers: ``until`` per key on the monotonic clock (system-wide
    on Linux, so comparable between processes), and the latest of all for a one-read check."""

    def __init__(self, table: SharedTable, kind: str) -> None:
        self._table = table
        self._kind = kind
        self._latest = key_hash("latest", kind)  # the entry that holds the latest deadline

    def extend(self, key: str, until: float, now: float) -> bool:
        """Push the key's deadline to ``until``; True when it had passed (newly cooling down)."""
        old = self._table.raise_to(slot_hash(self._kind, key), until)
        self._table.raise_to(self._latest, until)
        return old <= now

    # Reads go without the lock: deadlines are only ever raised, never deleted (peek).

    def until(self, key: str) -> float:
        return float(self._table.peek(slot_hash(self._kind, key), 0.0))

    def latest(self) -> float:
        return float(self._table.peek(self._latest, 0.0))


class SharedClaims:
    """How many requests with a client request id are in flight, router-wide."""

    def __init__(self, table: SharedTable, renames: SharedTable) -> None:
        self._table = table
        self._renames = renames

    def claim(self, request_id: str) -> int:
        """Requests with ``request_id`` in flight before this one."""
        return self._table.add(key_hash("claim", request_id), 1)

    def release(self, request_id: str) -> None:
        self._table.add(key_hash("claim", request_id), -1)

    def rename(self) -> int:
        """A router-wide serial number for a renamed request id (1, 2, ...)."""
        return self._renames.add(1, 1) + 1


class SharedInFlight:
    """Legs in flight per slot, router-wide, counted without a lock (the per-slot limit of the
    back-pressure reads it on every request, and a locked table cost a visible share of a
    worker's CPU).

    Each worker counts its own legs in an array of its own. It is the array's only writer, and
    its one event loop never runs two updates at once, so it needs no lock; a read sums every
    worker's array, one whole 8-byte word per cell. A worker's array is zeroed when it starts,
    so a worker that died leaves no stale count behind.

    There are no keys to probe or delete: a slot's count is kept in one cell of each of two
    rows, the cells picked by two halves of a hash of its key (a count-min sketch). Another
    busy slot in the same cell can only add to a sum, so the smaller of the slot's two sums is
    never below its true count: the limit is never exceeded because of a collision, and a slot
    that collides on both rows (with ``b`` busy slots, about ``(b / CELLS)**2`` of them) only
    reaches its limit early.
    """

    ROWS = 2
    CELLS = 1 << 15  # per row
    BYTES = ROWS * CELLS * 8  # one worker's array

    def __init__(self, arrays: list[memoryview]) -> None:
        self._arrays = arrays  # per worker: ROWS * CELLS native int64 cells
        self._own: memoryview | None = None
        self._cells: dict[tuple[str, str], tuple[int, int]] = {}

    def bind(self, worker: int) -> None:
        """This process is worker ``worker``: its array starts empty."""
        own = self._own = self._arrays[worker]
        own[:] = memoryview(bytes(self.BYTES)).cast("q")

    def cells(self, role: str, key: str) -> tuple[int, int]:
        """The slot's cell in each row."""
        found = self._cells.get((role, key))
        if found is None:
            if len(self._cells) > 65536:  # slot keys of many past tables: start again
                self._cells.clear()
            hashed = key_hash("in-flight", role, key)
            found = (hashed & 0xFFFFFFFF) % self.CELLS, self.CELLS + (hashed >> 32) % self.CELLS
            self._cells[(role, key)] = found
        return found

    def add(self, role: str, key: str, delta: int) -> None:
        own = self._own
        if own is not None:
            first, second = self.cells(role, key)
            own[first] += delta
            own[second] += delta

    def total(self, role: str, key: str) -> int:
        first, second = self.cells(role, key)
        a = b = 0
        for cells in self._arrays:
            a += cells[first]
            b += cells[second]
        return min(a, b)


def over_share(mine: int, total: int, workers: int) -> bool:
    """``mine`` of ``total`` open connections is more than a fair share of them, by more than
    rounding (and by 5 % of a share, so that large counts do not churn)."""
    share = total / workers
    return mine > share + max(0.5, 0.05 * share)


class SharedConnections:
    """Client connections open on each worker, one native word per worker (its only writer).

    SO_REUSEPORT spreads new connections by a hash of their addresses, which spreads a few
    long-lived ones unevenly: of a gateway's pool of 8 connections, one of two workers often
    gets most, and serves most of the traffic on one core. A
    worker over its share closes a connection once its response is sent (pdserve.proxy.serving.server),
    and the client's next connection is spread again.
    """

    def __init__(self, words: memoryview) -> None:
        self._words = words
        self._own = -1

    def bind(self, worker: int) -> None:
        """This process is worker ``worker``: its count starts at 0."""
        self._own = worker
        self._words[worker] = 0

    def add(self, delta: int) -> None:
        if self._own >= 0:
            self._words[self._own] += delta

    def counts(self) -> list[int]:
        return self._words.tolist()

    def over_share(self) -> bool:
        if self._own < 0:
            return False
        counts = self.counts()
        return over_share(counts[self._own], sum(counts), len(counts))


class SharedState:
    """Everything the workers share, in one mapping; build before forking."""

    COUNTER_ENTRIES = 1024
    DEADLINE_ENTRIES = 8192  # slots and instances ever ejected (a few per GPU group)
    CLAIM_ENTRIES = 1 << 17  # client request ids in flight at once

    def __init__(self, lock: Any, workers: int = 1, prefix_log_words: int = 0) -> None:
        """``prefix_log_words``: each worker's ring of prefix-index records (0: none, the prefill
        policy keeps no index)."""
        sizes = (self.COUNTER_ENTRIES, self.DEADLINE_ENTRIES, self.CLAIM_ENTRIES, 1, 4)
        tables = sum(sizes) * ENTRY_BYTES
        in_flight = workers * SharedInFlight.BYTES
        self._buf = mmap.mmap(-1, tables + in_flight + workers * 8)  # MAP_SHARED | MAP_ANONYMOUS
        offsets = [sum(sizes[:k]) * ENTRY_BYTES for k in range(len(sizes))]
        self.counters = SharedCounters(SharedTable(self._buf, offsets[0], sizes[0], lock, _INT))
        deadlines = SharedTable(self._buf, offsets[1], sizes[1], lock, _FLOAT)
        self.ejections = SharedDeadlines(deadlines, "ejected")  # slots cooling down
        self.unreachable = SharedDeadlines(deadlines, "unreachable")  # instances that refused
        self.claims = SharedClaims(
            SharedTable(self._buf, offsets[2], sizes[2], lock, _INT),
            SharedTable(self._buf, offsets[3], sizes[3], lock, _INT),
        )
        self._flags = SharedTable(self._buf, offsets[4], sizes[4], lock, _INT)
        words = memoryview(self._buf).cast("q")
        per_worker = SharedInFlight.BYTES // 8
        first = tables // 8
        self.in_flight = SharedInFlight(
            [words[first + w * per_worker : first + (w + 1) * per_worker] for w in range(workers)]
        )
        after = first + workers * per_worker
        self.connections = SharedConnections(words[after : after + workers])
        self.prefix_log = PrefixLog(workers, prefix_log_words) if prefix_log_words else None

    _STOPPING = 1

    def set_stopping(self) -> None:
        """The supervisor got SIGTERM: every worker's /ready says so at once, before the signal
        it forwards reaches the worker."""
        if not self.stopping():
            self._flags.add(self._STOPPING, 1)

    def stopping(self) -> bool:
        return bool(self._flags.get(self._STOPPING, 0))
