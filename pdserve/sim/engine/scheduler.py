"""One engine rank's scheduler as a pure state machine over steps (vLLM V1's
vllm/v1/core/sched/scheduler.py, reduced to what shapes latency and KV use).

Each step gets a token budget (``max_num_batched_tokens``). Running requests come first, in
order: a decoding one takes 1 token, one still prefilling takes what is left of its prompt
(chunked prefill: as much as the budget allows). A running request that cannot get KV blocks
preempts the most recently admitted running request (its blocks are freed and it is recomputed
later, vLLM V1's preemption by recompute), itself if it is the last. Then, if nothing was
preempted, waiting requests are admitted first come first served while the budget lasts and
fewer than ``max_num_seqs`` run; a prefix-cache hit counts as computed and costs no budget; the
first request that does not fit stops admission (head-of-line, as vLLM). A decode leg of P/D
allocates blocks for its whole prompt and waits for the pull (``pulls`` of the step); once
:meth:`Scheduler.remote_kv_loaded` is called it computes only the prompt's last token.

No clock here: times are passed in, so tests drive it step by step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.sim.engine.kvcache import KVCacheManager
from pdserve.sim.engine.request import Kind, Request, Status


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    enable_prefix_caching: bool = True
    #: NIXL's kv_lease_duration: how long a prefill holds a finished leg's blocks for its decode.
    kv_lease_seconds: float = 30.0


@dataclass
class Step:
    """What one step computes: (request, tokens) pairs, and what it changed."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    pulls: list[Request] = field(default_factory=list)  # decode legs whose KV pull starts now
    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class Counters:
    """Cumulative, as vLLM's counters: prefix-cache lookups in tokens, preemptions."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    preemptions: int = 0
    expired_leases: int = 0


@dataclass
class Held:
    """A finished prefill leg's blocks, kept until its decode pulls them or the lease ends."""

    request: Request
    expires: float


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_gpu_blocks, config.block_size, config.max_model_len, config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Held] = {}
        self.counters = Counters()

    # --- requests in and out ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """The client went away: the request leaves wherever it is and frees its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = Status.ABORTED

    def remote_kv_loaded(self, request: Request) -> None:
        """A decode leg's pull finished: its prompt counts as computed but for the last token."""
        if request.status is not Status.WAITING_FOR_REMOTE_KVS:
            return
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.cache(request, request.num_computed_tokens)
        request.status = Status.WAITING

    def release_held(self, request_id: str) -> bool:
        """The decode pulled a finished prefill leg's blocks: they may go (and stay cached)."""
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self.kv.free(held.request)
        return True

    def expire_leases(self, now: float) -> int:
        expired = [rid for rid, h in self.held.items() if h.expires <= now]
        for rid in expired:
            self.release_held(rid)
        self.counters.expired_leases += len(expired)
        return len(expired)

    def next_lease_expiry(self) -> float | None:
        return min((h.expires for h in self.held.values()), default=None)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(r.status is not Status.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    # --- one step ---------------------------------------------------------------------------

    def schedule(self, now: float) -> Step:
        step = Step()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            new = min(request.num_tokens - request.num_computed_tokens, budget)
            if new <= 0:
                i += 1
                continue
            while not self.kv.allocate(request, new):
                victim = self.running.pop()
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                step.scheduled.append((request, new))
                budget -= new
                i += 1
                continue
            break  # the request itself was preempted: nothing more runs
        if not step.preempted:
            budget = self._admit(step, budget, now)
        for request, new in step.scheduled:
            decoding = request.num_output_tokens > 0 and new == 1
            step.decode_seqs += decoding
            step.prefill_tokens += 0 if decoding else new
            request.num_computed_tokens += new
            step.context_tokens += request.num_computed_tokens
            if request.first_scheduled is None:
                request.first_scheduled = now
        return step

    def _admit(self, step: Step, budget: int, now: float) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status is Status.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())
                continue
            preempted = request.num_preemptions > 0
            computed: list[int] = []
            external = 0
            if request.num_computed_tokens == 0:
                computed, local = self.kv.computed_blocks(request)
                if request.kind is Kind.DECODE and request.num_external_tokens == 0 and not preempted:
                    external = request.num_tokens - local  # NIXL pulls what is not cached here
                num_computed = local + external
            else:
                local, num_computed = 0, request.num_computed_tokens
            if external:
                if not self.kv.allocate(request, 0, computed, external, delay_caching=True):
                    break
                self.waiting.popleft()
                self._record_lookup(request, local)
                self.counters.external_queries += request.num_tokens - local
                self.counters.external_hits += external
                request.num_external_tokens = external
                request.num_computed_tokens = num_computed
                request.status = Status.WAITING_FOR_REMOTE_KVS
                step.pulls.append(request)
                skipped.append(request)
                continue
            new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate(request, new, computed):
                break
            self.waiting.popleft()
            if request.num_computed_tokens == 0:
                self._record_lookup(request, local)
            self.running.append(request)
            request.status = Status.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            step.scheduled.append((request, new))
            budget -= new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _record_lookup(self, request: Request, hits: int) -> None:
        """vLLM counts a lookup at admission, in tokens, and not for a preempted request again."""
        if self.config.enable_prefix_caching and request.num_preemptions == 0:
            self.counters.prefix_queries += request.num_tokens
            self.counters.prefix_hits += hits

    def _preempt(self, request: Request, step: Step) -> None:
        if any(r is request for r, _ in step.scheduled):  # already given tokens this step
            step.scheduled = [(r, n) for r, n in step.scheduled if r is not request]
        self.kv.free(request)
        request.status = Status.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
        step.preempted.append(request)

    def finish_step(self, step: Step, now: float) -> list[Request]:
        """The step's results at time ``now``: a request that computed all its tokens samples one
        more; those that reached max_tokens finish (a prefill leg's blocks stay held). Returns the
        requests that got a token."""
        out = []
        for request, _ in step.scheduled:
            if request.status is not Status.RUNNING or request.num_computed_tokens < request.num_tokens:
                continue
            request.append_output()
            if request.first_token is None:
                request.first_token = now
            request.last_token = now
            out.append(request)
            if request.num_output_tokens >= request.max_tokens:
                self._finish(request, now)
        return out

    def _finish(self, request: Request, now: float) -> None:
        self.running.remove(request)
        request.status = Status.FINISHED
        request.finished = now
        request.blocks_at_finish = self.kv.block_ids(request)
        if request.kind is Kind.PREFILL:
            self.held[request.request_id] = Held(request, now + self.config.kv_lease_seconds)
        else:
            self.kv.free(request)
