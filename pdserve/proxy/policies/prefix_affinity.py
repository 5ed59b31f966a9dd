"""Prefill policy ``prefix-affinity``: the slot that already holds the longest prefix of the
prompt, among the slots whose load stays within a bound; the flat interleave otherwise.

The router keeps, per prefill slot, an index of the prompt prefixes it sent there (chunks of the
prompt text with chained hashes, bounded per slot: pdserve.proxy.policies.prefix). For each
request, over the live slots:

* if no live slot holds at least the minimum match (``--prefix-min-match`` characters, in whole
  chunks), the request takes the next turn of the flat interleave's counter and its slot,
  exactly as flat-interleaved would: a stream of unique prompts gets the flat interleave's
  per-slot counts, exactly. Requests placed by their prefix take no turn of that counter, so
  they never shift it (a benchmark of sequential conversations of four turns would otherwise
  start every conversation on the same slot of two);
* otherwise the eligible slots are those whose load (prefill legs in flight, router-wide) would
  stay within ``ceil((1 + ε) x mean)`` with this request counted (``ε``: ``--prefix-balance``); of
  those, the one with the longest match; if no eligible slot matches the minimum, the first
  eligible one. Ties, and that first one, follow an interleave of its own (a second counter).
  A hot prefix shared by every prompt therefore spreads round-robin over the slots as their
  loads allow, and a slot is never given a request with a prefix match that would take it past
  the bound. (At least one slot is always eligible: the least loaded.)

Several routers (replicas, or a router in every decode pod) each keep their own index. With
``--prefix-unmatched rendezvous`` a prompt that matches nothing (and one whose holders are all over
the bound) goes to the slot its *head* ranks highest by rendezvous hashing, within the bound; the
head is the prompt's first minimum match (``--prefix-min-match``), so two prompts that would
match each other have the same head, and every router sends a new prefix to the same slot
without talking. The price: unique prompts are spread by hash within the bound rather than by
exact counts, and a shared head longer than the minimum match (a long system prompt) starts
every new conversation on the same slots, spread only by the bound. The default, ``flat``, is for
one router (its worker processes share one index: pdserve.proxy.state.prefix_log).

Decode legs keep the flat interleave.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.argtypes import Checked, SettingsError, setting
from pdserve.proxy.metrics import PrefixMetrics
from pdserve.proxy.policies.base import RequestView, live_and_ejected, rotation
from pdserve.proxy.policies.counters import Counters, LocalCounters
from pdserve.proxy.policies.prefix.chunks import Chunked, chunk_prompt, stable_hash
from pdserve.proxy.policies.prefix.index import PrefixIndex
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.prefix_log import PrefixLog
from pdserve.routing import Role, Slot, SlotTable

#: Chunks per slot while the engine's KV capacity is unknown and no size is given (2 MB of text
#: at the default chunk: about half a million tokens).
DEFAULT_INDEX_CHUNKS = 8192
#: The most chunks one slot's index holds, whatever its engine reports (memory: about 200
#: bytes per chunk and slot, in every worker process).
MAX_INDEX_CHUNKS = 1 << 18
UNMATCHED_MODES = ("flat", "rendezvous")

# How a slot was chosen (pdserve_proxy_prefix_routed_total{how}).
AFFINITY = "affinity"
FLAT = "flat"
SPREAD = "spread"
RENDEZVOUS = "rendezvous"
UNCHUNKABLE = "unchunkable"

#: What :meth:`PrefixAffinity.turn` answers for a prefill: its turn is taken later, lazily.
LAZY = -1
#: The counters of the prefill role: the flat interleave's (flat-interleaved's own, so unique
#: prompts walk exactly as they would there), and the one that breaks ties among prefix holders.
FLAT_GROUP = ""
TIE_GROUP = "prefix-ties"


@dataclass(frozen=True)
class PrefixOptions(Checked):
    """The policy's options, each with its flag of ``pdserve proxy`` (its settings group
    pdserve.proxy.settings.GROUPS lists; docs/proxy.md); checked when made, however made."""

    balance: float = setting(
        0.25,
        "--prefix-balance",
        minimum=0,
        metavar="EPSILON",
        help="the load bound: a slot takes a request for its prefix only while its prefill legs in flight "
        "stay within ceil((1 + EPSILON) x the mean over the live slots), this request counted",
    )
    min_match_chars: int = setting(
        1024,
        "--prefix-min-match",
        minimum=0,
        metavar="CHARS",
        help="the shortest prompt prefix (characters, rounded up to whole chunks) worth leaving the flat "
        "interleave for",
    )
    chunk_chars: int = setting(
        256,
        "--prefix-chunk-chars",
        minimum=1,
        metavar="CHARS",
        help="prompts are indexed in chunks of this many characters, each chunk's hash chained to the one "
        "before",
    )
    index_chunks: int = setting(
        0,  # 0: from the engine's KV capacity (vllm:cache_config_info) once known
        "--prefix-index-chunks",
        minimum=0,
        metavar="N",
        help="chunks each prefill slot's index holds (LRU); 0 sizes it from the engine's KV capacity "
        "(num_gpu_blocks x block_size tokens of vllm:cache_config_info, x --prefix-chars-per-token), "
        f"{DEFAULT_INDEX_CHUNKS} until that is read",
    )
    chars_per_token: float = setting(
        4.0,
        "--prefix-chars-per-token",
        minimum=0.01,
        help="characters per engine token, to size the index from the engine's KV capacity",
    )
    unmatched: str = setting(
        "flat",
        "--prefix-unmatched",
        env="PDSERVE_PROXY_PREFIX_UNMATCHED",
        choices=UNMATCHED_MODES,
        help="where a prompt that matches no slot goes: flat (the flat interleave's next slot: unique "
        "prompts keep exact shares; one router) or rendezvous (the slot its head hashes to, within the "
        "load bound: several routers agree without talking)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.balance > 100:
            raise SettingsError(f"--prefix-balance: expected a value from 0 to 100, got {self.balance}")

    @property
    def min_chunks(self) -> int:
        """The minimum match in whole chunks (at least one)."""
        return max(1, math.ceil(self.min_match_chars / self.chunk_chars))

    def chunks_for(self, tokens: int) -> int:
        """Index chunks for an engine rank that holds ``tokens`` tokens of KV."""
        return max(1, min(MAX_INDEX_CHUNKS, int(tokens * self.chars_per_token / self.chunk_chars)))


def load_bound(total: int, slots: int, balance: float) -> int:
    """``ceil((1 + ε) x mean)``, the mean counting the request being placed: a slot may take it
    while its load plus one stays within this."""
    return math.ceil(round((1 + balance) * (total + 1) / slots, 9))


@dataclass(frozen=True)
class Placement:
    position: int  # in the flat order given to place()
    how: str


def place(
    order: Sequence[str],
    depths: Mapping[str, int],
    loads: Sequence[int],
    balance: float,
    min_chunks: int,
    spread: Sequence[int] | None = None,
) -> Placement:
    """The choice of the module doc, pure: ``order`` the live slots' keys in the flat order from
    the request's turn, ``depths`` each slot's match in chunks, ``loads`` their loads (in
    ``order``'s order); ``spread`` (rendezvous) the positions to try, best first, for a prompt
    placed by no match (None: the flat order). ``loads`` is read only when a match or ``spread``
    needs it."""
    best_anywhere = max(depths.values(), default=0)
    if best_anywhere < min_chunks and spread is None:
        return Placement(0, FLAT)
    bound = load_bound(sum(loads), len(order), balance)
    if best_anywhere >= min_chunks:
        best, chosen = 0, -1
        for position, key in enumerate(order):
            depth = depths.get(key, 0)
            if depth > best and loads[position] + 1 <= bound:
                best, chosen = depth, position
        if best >= min_chunks:
            return Placement(chosen, AFFINITY)
    how = SPREAD if best_anywhere >= min_chunks else RENDEZVOUS
    for position in spread if spread is not None else range(len(order)):
        if loads[position] + 1 <= bound:
            return Placement(position, how)
    return Placement(0, how)  # unreachable: the least loaded slot is always within the bound


class PrefixAffinity:
    name: ClassVar[str] = "prefix-affinity"
    reads_requests = True

    def __init__(
        self,
        counters: Counters | None = None,
        options: PrefixOptions | None = None,
        log: PrefixLog | None = None,
        metrics: PrefixMetrics | None = None,
    ) -> None:
        self._counters = counters or LocalCounters()
        self.options = options or PrefixOptions()
        self.index = PrefixIndex(self.options.index_chunks or DEFAULT_INDEX_CHUNKS)
        self._log = log  # worker processes: one index, a copy in each (prefix_log.py)
        self._metrics = metrics
        self._by_hash: dict[int, str] = {}  # stable hash of a slot key -> the key (log records)
        self._sizes_from: dict[str, str] = {}  # slot key -> "engine" when sized from its KV
        self._masks: tuple[Sequence[Slot], int, dict[int, str]] | None = None
        self._table_keys: list[str] = []  # the prefill slots of the table served

    # --- the protocol -------------------------------------------------------------------------

    def turn(self, role: Role, group: str = "") -> int:
        """A decode's turn as any policy's; a prefill's is taken in :meth:`candidates`, once per
        request and only by the placement that needs it (:data:`LAZY`)."""
        if role is Role.PREFILL:
            return LAZY
        return self._counters.take(role.value, group)

    def view(self, endpoint: str, body: Mapping[str, Any]) -> Chunked:
        return chunk_prompt(endpoint, body, self.options.chunk_chars, self.options.min_chunks)

    def candidates(
        self, role: Role, slots: Sequence[Slot], book: SlotBook, turn: int, request: RequestView | None = None
    ) -> list[Slot]:
        live, ejected = live_and_ejected(role, slots, book)
        if role is not Role.PREFILL or not isinstance(request, Chunked):
            return [*rotation(live, turn if turn != LAZY else self._take(FLAT_GROUP)), *ejected]
        if not request.hashes or not live:
            request.how = UNCHUNKABLE if request.reason else FLAT
            return [*rotation(live, self._flat_turn(request)), *ejected]
        self._catch_up()
        mask, keys_by_bit = self._live_mask(live)
        depths = {keys_by_bit[bit]: depth for bit, depth in self.index.depths(request.hashes, mask).items()}
        request.depths = depths
        opts = self.options
        rendezvous = opts.unmatched == RENDEZVOUS
        if max(depths.values(), default=0) < opts.min_chunks and not rendezvous:
            request.how = FLAT
            return [*rotation(live, self._flat_turn(request)), *ejected]  # exactly flat-interleaved
        # Placed by its prefix: ties and spreading follow a turn of a counter of their own, so that
        # these requests never shift the flat interleave of the others.
        if request.tie_turn is None:
            request.tie_turn = self._take(TIE_GROUP)
        order = rotation(live, request.tie_turn)
        keys = [s.key for s in order]
        spread = _rendezvous(keys, stable_hash(request.head)) if rendezvous else None
        loads = [book.in_flight(Role.PREFILL, key) for key in keys]
        choice = place(keys, depths, loads, opts.balance, opts.min_chunks, spread)
        request.how = choice.how
        chosen = order[choice.position]
        return [chosen, *order[: choice.position], *order[choice.position + 1 :], *ejected]

    def _take(self, group: str) -> int:
        return self._counters.take(Role.PREFILL.value, group)

    def _flat_turn(self, request: Chunked) -> int:
        """The request's turn of the flat interleave's counter, taken the first time it is asked."""
        if request.turn is None:
            request.turn = self._take(FLAT_GROUP)
        return request.turn

    def sent(self, role: Role, slot: Slot, request: RequestView) -> None:
        if role is not Role.PREFILL or not isinstance(request, Chunked):
            return
        key = slot.key
        metrics = self._metrics
        if request.hashes:
            self.index.record(key, request.hashes)
            if self._log is not None:
                self._log.publish(_slot_hash(key), request.hashes)
        if metrics is None:
            return
        how = request.how or FLAT
        if request.reason:
            metrics.unchunkable.labels(request.reason).inc()
            how = UNCHUNKABLE
        metrics.routed.labels(key, how).inc()
        metrics.prompt_chars.labels(key).inc(request.chars)
        matched = request.depths.get(key, 0) * self.options.chunk_chars
        if matched:
            metrics.matched_chars.labels(key).inc(min(matched, request.chars))
        metrics.index_chunks.labels(key).set(self.index.size(key))

    def table_changed(self, slots: SlotTable) -> None:
        """A slot that left the table (removed, or draining) leaves the index; a new one starts
        empty (it is made on its first use)."""
        keys = [s.key for s in slots.prefill]
        self._catch_up()
        for key in self.index.keep_only(keys):
            self._sizes_from.pop(key, None)
            if self._metrics is not None:
                self._metrics.index_chunks.labels(key).set(0)
        self._by_hash = {_slot_hash(key): key for key in keys}
        self._table_keys = keys
        self._masks = None

    def describe(self) -> dict[str, Any]:
        opts = self.options
        return {
            "policy": self.name,
            "chunk_chars": opts.chunk_chars,
            "min_match_chars": opts.min_match_chars,
            "balance": opts.balance,
            "unmatched": opts.unmatched,
            "index_chunks": self.index.total(),
            "log_records_lost": self._log.lost if self._log is not None else 0,
            "slots": {
                key: {
                    "chunks": self.index.size(key),
                    "capacity": self.index.capacity(key),
                    "sized_from": self._sizes_from.get(key, "flag" if opts.index_chunks else "default"),
                }
                for key in dict.fromkeys([*self._table_keys, *self.index.slot_keys()])
            },
        }

    # --- sizing -------------------------------------------------------------------------------

    def engine_capacity(self, slot_keys: Sequence[str], tokens: int) -> None:
        """The engine behind ``slot_keys`` holds ``tokens`` tokens of KV per rank
        (``num_gpu_blocks x block_size``): their indexes are sized to match, unless a size was
        given."""
        if self.options.index_chunks:
            return
        chunks = self.options.chunks_for(tokens)
        for key in slot_keys:
            self.index.resize(key, chunks)
            self._sizes_from[key] = "engine"

    # --- internals ----------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Apply what the other workers sent (their records in the shared log)."""
        log = self._log
        if log is None or not log.pending():
            return
        by_hash = self._by_hash
        for slot_hash, chunks in log.read():
            key = by_hash.get(slot_hash)
            if key is not None:  # a slot this worker's table has (not yet, or no more: dropped)
                self.index.record(key, chunks)

    def _live_mask(self, live: Sequence[Slot]) -> tuple[int, dict[int, str]]:
        """The index bits of the live slots, and each bit's key (cached while ``live`` is the
        table's own tuple, the common case)."""
        cached = self._masks
        if cached is not None and cached[0] is live:
            return cached[1], cached[2]
        keys_by_bit = {self.index.bit(s.key): s.key for s in live}
        mask = 0
        for bit in keys_by_bit:
            mask |= bit
        self._masks = (live, mask, keys_by_bit)
        return mask, keys_by_bit


@functools.lru_cache(maxsize=4096)
def _slot_hash(key: str) -> int:
    """A slot key's hash, the same in every worker and router (log records, rendezvous)."""
    return stable_hash(key.encode(), "slot")


_MASK64 = (1 << 64) - 1


def _rendezvous(keys: Sequence[str], head: int) -> list[int]:
    """Positions of ``keys`` ranked by rendezvous (highest random weight) hashing on ``head``:
    every router ranks the same slots alike, and a slot's leaving moves only its own prompts."""
    scores = [(_mix(head ^ _slot_hash(key)), position) for position, key in enumerate(keys)]
    scores.sort(reverse=True)
    return [position for _, position in scores]


def _mix(value: int) -> int:
    """SplitMix64's finalizer: a well-spread 64-bit function of ``value``."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)
