"""One client request through the proxy: its parts, their attempts, and its one log line.

A request that makes one sequence is served as one *part*; one that makes several (a batched
prompt, ``n > 1``) as independent parts merged in OpenAI's shape (pdserve.proxy.flow.sequences). A
part is a series of *attempts*: a prefill leg plus a decode leg, or a decode leg alone that
reuses the previous attempt's KV handoff. The legs are run by pdserve.proxy.flow.legs, and the
retry policy (which instances an attempt may use, when a handoff may be reused, what the
client sees when the attempts run out) is pdserve.proxy.flow.attempts's; this module walks the
candidates the routing policy gives, under that retry policy.

Prefill and decode are paired by revision: the prefill slot comes from the flat order over
every paired prefill slot, then the decode from that revision's decode slots, walked by the
revision's own counter (see pdserve.routing.slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.proxy.engine.upstream import BackendRefusal
from pdserve.proxy.flow.admission import (
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    AdmissionGate,
    has_room,
    room_first,
    shed_reply,
)
from pdserve.proxy.flow.attempts import (
    UNREACHABLE_OUTCOME,
    Handoff,
    LegFailure,
    Walk,
    failure_reply,
    handoff_reusable,
    no_slot_detail,
    no_slot_reply,
)
from pdserve.proxy.flow.legs import Engines, LegRunner
from pdserve.proxy.flow.reply import JSON, Reply, ReplyStream, error_reply
from pdserve.proxy.flow.sequences import MergedStream, Split, merge_answers
from pdserve.proxy.flow.trace import Trace, logged_trace_id
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import Policy
from pdserve.proxy.settings import RetrySettings
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.shared import SharedState
from pdserve.proxy.table.served import RoutingState, ServedTable
from pdserve.routing import Role, Slot, SlotTable

if TYPE_CHECKING:  # loaded only when the router traces
    from pdserve.proxy.flow.spans import RequestSpans

log = logging.getLogger("pdserve.proxy.request")

SHED_REASONS = frozenset({SHED_QUEUE_FULL, SHED_QUEUE_TIMEOUT})
#: Request outcomes that are no failure of the deployment's (the load view counts the others).
NOT_FAILED = frozenset({"ok", "cancelled", "client_error"})


@dataclass(frozen=True)
class Slots:
    """Which slots a request may use: the table being served, the policy that orders its slots,
    and the book of what each slot is doing (in flight, ejected)."""

    served: ServedTable
    policy: Policy
    book: SlotBook


class Dispatcher(LegRunner):
    """Serves generation requests: for each, the slots to try and the attempts, under the retry
    rules; ``shared``: the state of worker processes (None when this process serves alone)."""

    def __init__(
        self,
        slots: Slots,
        engines: Engines,
        retries: RetrySettings,
        admission: AdmissionGate,
        metrics: ProxyMetrics,
        shared: SharedState | None = None,
    ) -> None:
        super().__init__(slots.book, engines, metrics, admission)
        self.served = slots.served
        self.policy = slots.policy
        self.max_retries = retries.max_retries
        self.kv_lease_seconds = retries.kv_lease_seconds
        self._ids_in_flight: dict[str, int] = {}
        self._renamed = 0
        self._claims = shared.claims if shared is not None else None  # worker processes
        self.served_requests = 0  # generation requests this process took (admin views)

    # --- the request ----------------------------------------------------------------------------

    async def generate(
        self,
        path: str,
        body: Mapping[str, Any],
        request_id: str,
        client_auth: str | None,
        split: Split | None = None,
        client_id: bool = True,
        traceparent: str | None = None,
        tracestate: str | None = None,
        spans: RequestSpans | None = None,
    ) -> Reply:
        """``client_id``: the id came from the client (X-Request-Id), so another request may carry
        it too; the router's own ids are unique by construction and claim nothing.
        ``traceparent``/``tracestate``: the client's trace context, passed on to the engines;
        ``spans``: the request's spans when the router traces (they end with the request)."""
        engine_base = self._claim(request_id) if client_id else request_id
        stream = body.get("stream") is True
        trace = Trace(request_id, path, stream, engine_base=engine_base, claimed=client_id)
        if traceparent is not None or spans is not None:
            trace.traceparent, trace.tracestate, trace.spans = traceparent, tracestate, spans
        self.served_requests += 1
        self.metrics.in_flight.inc()
        self.load.started()
        state = self.served.current  # this request's table, whatever reloads happen meanwhile
        try:
            if split is None:
                reply = await self._serve(state, path, body, trace, client_auth)
            else:
                reply = await self._serve_split(state, path, split, trace, client_auth)
        except asyncio.CancelledError:
            self._close(trace, 499, "cancelled")
            raise
        except Exception:
            self._close(trace, 500, "proxy_error")
            raise
        if isinstance(reply.body, bytes):
            self._close(trace, reply.status, reply_outcome(reply))
        return reply

    async def _serve(
        self, state: RoutingState | None, path: str, body: Mapping[str, Any], trace: Trace, auth: str | None
    ) -> Reply:
        """One part: attempts until one succeeds or the retry policy says stop (attempts.py)."""
        slots = state.slots if state is not None else None
        if state is None or slots is None or not slots.prefill:
            # No prefill to pair: say which side is missing (prefills of a revision without a
            # decode are there but not routable; a decode sidecar always has its own decode).
            paired_prefill_missing = slots is not None and any(i.routable for i in slots.table.prefill)
            decode_missing = paired_prefill_missing and slots is not None and not slots.decode
            return self._no_slot(Role.DECODE if decode_missing else Role.PREFILL, slots)
        policy = self.policy
        walk = Walk(policy.turn(Role.PREFILL))
        # A policy that reads requests gets this sequence's view; for the others nothing is made.
        request = policy.view(_endpoint(path), body) if policy.reads_requests else None
        prefills = policy.candidates(Role.PREFILL, slots.prefill, self.book, walk.prefill_turn, request)
        gate = self.admission
        spans = trace.spans
        if gate.limit > 0 and prefills:
            first_slots = slots

            def room() -> bool:
                return _room_for_pair(first_slots, prefills, self.book, gate.limit)

            if not gate.free_now(room):
                queued = time.time_ns()
                shed = await gate.wait(room)
                if spans is not None:
                    spans.admission(queued, shed)
                if shed is not None:
                    return shed_reply(shed, gate.queue_size, gate.timeout)
        failure: LegFailure | None = None
        for _ in range(self.max_retries + 1):
            if failure is not None:  # a retry routes by the table served now
                state = self.served.current or state
                slots = state.slots
                prefills = policy.candidates(
                    Role.PREFILL, slots.prefill, self.book, walk.prefill_turn, request
                )
            routed = time.time_ns() if spans is not None else 0
            reused = trace.handoff is not None
            pair = await self._pair(slots, prefills, walk, trace.handoff, check=failure is not None)
            if spans is not None:
                chosen = None if isinstance(pair, Reply) else pair
                spans.route(routed, trace.attempts + 1, state.generation, chosen, reused, trace.part)
            if isinstance(pair, Reply):
                return pair
            source, decode = pair
            if failure is not None:
                self.metrics.retries.labels(failure.role.value, failure.error.outcome).inc()
                trace.retry_reason = f"{failure.role.value} {failure.error.outcome}"
            trace.attempts += 1
            trace.prefill, trace.decode = source.key, decode.key
            if request is not None and trace.handoff is None:
                policy.sent(Role.PREFILL, source, request)  # a new prefill (not a reused handoff)
            try:
                return await self._attempt(state, path, body, source, decode, trace, auth)
            except BackendRefusal as refusal:
                return Reply(refusal.status, refusal.body, refusal.content_type or JSON)
            except LegFailure as exc:
                failure = exc
                walk.failed.add((exc.role, exc.slot.key))
                self._eject(exc.role, exc.slot, exc.error.outcome)
                if exc.role is Role.PREFILL or not handoff_reusable(
                    trace.handoff,
                    exc,
                    state.connector.reusable_handoff,
                    self.kv_lease_seconds,
                    time.monotonic(),
                ):
                    trace.handoff = None  # the next attempt starts with a new prefill
        assert failure is not None
        return self._failure(failure, trace, slots)

    async def _pair(
        self, slots: SlotTable, prefills: list[Slot], walk: Walk, handoff: Handoff | None, check: bool
    ) -> tuple[Slot, Slot] | Reply:
        """The next attempt's prefill (the handoff's, when it is reused) and decode, or the 503 that
        says none can be had. ``check`` (a retry): no new prefill is spent before its decode is
        known to be alive (:meth:`_decode_for`)."""
        if handoff is not None:
            decode = await self._decode_for(slots, handoff.prefill.revision, walk, check=False)
            if decode is not None:
                return handoff.prefill, decode
            return self._no_slot(Role.DECODE, slots, slots.decode_for(handoff.prefill.revision))
        prefills = walk.tried_last(Role.PREFILL, prefills)
        limit = self.admission.limit
        if limit > 0:
            prefills = room_first(Role.PREFILL, prefills, self.book, limit)
        if not prefills:
            return self._no_slot(Role.PREFILL, slots)
        without_decode: list[str] = []
        for prefill in prefills:
            if prefill.revision in without_decode:
                continue
            decode = await self._decode_for(slots, prefill.revision, walk, check)
            if decode is not None:
                return prefill, decode
            without_decode.append(prefill.revision)
        # 503 before spending a prefill: no decode can take what any prefill would compute
        return self._no_slot(Role.DECODE, slots, [d for rev in without_decode for d in slots.decode_for(rev)])

    async def _decode_for(self, slots: SlotTable, revision: str, walk: Walk, check: bool) -> Slot | None:
        """The best decode of ``revision`` for this part (its own turn of the revision's counter).
        ``check`` (a retry, before a new prefill): a decode that failed recently (ejected, so only
        a last resort) must answer ``/health`` first; one that does not is marked unreachable and
        the next one is taken."""
        turn = walk.decode_turns.get(revision)
        if turn is None:
            turn = walk.decode_turns[revision] = self.policy.turn(Role.DECODE, revision)
        decodes = self.policy.candidates(Role.DECODE, slots.decode_for(revision), self.book, turn)
        decodes = walk.tried_last(Role.DECODE, decodes)
        limit = self.admission.limit
        if limit > 0:
            decodes = room_first(Role.DECODE, decodes, self.book, limit)
        if not check:
            return decodes[0] if decodes else None
        for decode in decodes:
            if self.book.live(Role.DECODE, decode):
                return decode
            if self.book.unreachable.reachable(Role.DECODE, decode) and await self._alive(decode):
                return decode
        return None

    async def _alive(self, slot: Slot) -> bool:
        problem = await self.upstream.health_problem(slot.url)
        if problem is None:
            return True
        self.book.unreachable.mark(Role.DECODE, slot.instance.name)
        log.warning(
            "decode instance %s failed its check before a retry's prefill (%s): not routed to for %g s",
            slot.instance.name,
            problem,
            self.book.eject_seconds,
        )
        return False

    async def _serve_split(
        self, state: RoutingState | None, path: str, split: Split, trace: Trace, auth: str | None
    ) -> Reply:
        """Every part at once; the first part that fails (after its own retries) fails the request."""
        trace.parts = [
            Trace(
                trace.request_id,
                path,
                trace.stream,
                engine_base=f"{trace.engine_base}-{k}",
                part_of=trace,
                part=k,
                traceparent=trace.traceparent,
                tracestate=trace.tracestate,
                spans=trace.spans,
            )
            for k in range(len(split.parts))
        ]
        tasks: list[asyncio.Future[Reply]] = [
            asyncio.ensure_future(self._serve(state, path, part.body, part_trace, auth))
            for part, part_trace in zip(split.parts, trace.parts, strict=True)
        ]
        replies: dict[int, Reply] = {}
        failed: Reply | None = None
        try:
            pending: set[asyncio.Future[Reply]] = set(tasks)
            while pending and failed is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    reply = replies[tasks.index(task)] = task.result()
                    if reply.status >= 300 and failed is None:
                        failed = reply
        except BaseException:
            await _close_streams(replies.values())  # parts that had started streaming
            raise
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
            trace.attempts = sum(p.attempts for p in trace.parts)
        ordered = [replies[k] for k in sorted(replies)]  # part order: MergedStream indexes by it
        streams: list[ReplyStream] = [r.body for r in ordered if not isinstance(r.body, bytes)]
        if failed is None and trace.stream and len(streams) != len(tasks):
            failed = error_reply(502, "a decode answered a stream without streaming", "upstream_error")
        if failed is not None:
            await _close_streams(replies.values())
            return failed
        trace.first_byte = time.monotonic()
        if trace.stream:
            merged = MergedStream(
                split, streams, trace.request_id, lambda outcome: self._close_merged(trace, outcome)
            )
            return Reply(200, merged, "text/event-stream")
        answers = [r.body for r in ordered if isinstance(r.body, bytes)]
        try:
            return Reply(200, merge_answers(split, answers, trace.request_id))
        except ValueError as exc:
            return error_reply(502, f"cannot merge the decodes' answers: {exc}", "upstream_error")

    def _no_slot(self, role: Role, slots: SlotTable | None, relevant: Sequence[Slot] | None = None) -> Reply:
        detail, wait = no_slot_detail(role, slots, self.unreachable, relevant)
        return no_slot_reply(role, detail, wait)

    def _failure(self, failure: LegFailure, trace: Trace, slots: SlotTable) -> Reply:
        """The reply once the attempts ran out; 503 when the failed role has no reachable slot left."""
        role = failure.role
        if failure.error.outcome == UNREACHABLE_OUTCOME:
            same = slots.prefill if role is Role.PREFILL else slots.decode_for(failure.slot.revision)
            if not any(self.unreachable.reachable(role, s) for s in same):
                return self._no_slot(role, slots, same)
        return failure_reply(failure, trace.attempts)

    def _claim(self, request_id: str) -> str:
        """The stem of the legs' request ids: the client's id, suffixed while another request
        with the same id is in flight (two clients, or one, may send the same X-Request-Id; with
        worker processes, on any worker)."""
        if self._claims is not None:
            if self._claims.claim(request_id) == 0:
                return request_id
            return f"{request_id}.{self._claims.rename()}"
        count = self._ids_in_flight.get(request_id, 0)
        self._ids_in_flight[request_id] = count + 1
        if count == 0:
            return request_id
        self._renamed += 1
        return f"{request_id}.{self._renamed}"

    def _release(self, request_id: str) -> None:
        if self._claims is not None:
            self._claims.release(request_id)
            return
        count = self._ids_in_flight.pop(request_id, 1) - 1
        if count > 0:
            self._ids_in_flight[request_id] = count

    def _close_merged(self, trace: Trace, outcome: str) -> None:
        request_outcome = outcome if outcome in ("ok", "cancelled") else "stream_error"
        self._close(trace, 499 if outcome == "cancelled" else 200, request_outcome)

    def _close(self, trace: Trace, status: int, outcome: str) -> None:
        if trace.closed:
            return
        trace.closed = True
        if trace.part_of is not None:
            trace.outcome = outcome  # the request's own close counts and logs it
            return
        if trace.claimed:
            self._release(trace.request_id)
        now = time.monotonic()
        endpoint = _endpoint(trace.endpoint)
        self.metrics.in_flight.dec()
        self.metrics.child(self.metrics.requests, endpoint, outcome).inc()
        self.metrics.child(self.metrics.total, endpoint).observe(now - trace.started)
        load = self.load
        load.ended(outcome in NOT_FAILED)
        if trace.first_byte is not None:
            self.metrics.child(self.metrics.ttft, endpoint).observe(trace.first_byte - trace.started)
            load.observe("ttft", trace.first_byte - trace.started)
        prefill, decode = trace.prefill, trace.decode
        if trace.parts:
            prefill = ",".join(p.prefill for p in trace.parts)
            decode = ",".join(p.decode for p in trace.parts)
        if trace.spans is not None:
            attributes: dict[str, Any] = {
                "pdserve.stream": trace.stream,
                "pdserve.attempts": trace.attempts,
                "pdserve.prefill.slot": prefill,
                "pdserve.decode.slot": decode,
            }
            if trace.parts:
                attributes["pdserve.parts"] = len(trace.parts)
            trace.spans.end(status, outcome, attributes)
        if not log.isEnabledFor(logging.INFO):
            return
        ttft_ms = "-" if trace.first_byte is None else f"{(trace.first_byte - trace.started) * 1000:.1f}"
        extra = f" parts={len(trace.parts)}" if trace.parts else ""
        if trace.engine_base != trace.request_id:
            extra += f" engine_id={trace.engine_base}"
        trace_id = logged_trace_id(trace.spans, trace.traceparent)
        if trace_id is not None:
            extra += f" trace_id={trace_id}"
        log.info(
            "request id=%s endpoint=%s stream=%s status=%d outcome=%s prefill=%s decode=%s attempts=%d "
            "ttfb_ms=%s total_ms=%.1f%s",
            trace.request_id,
            trace.endpoint,
            trace.stream,
            status,
            outcome,
            prefill,
            decode,
            trace.attempts,
            ttft_ms,
            (now - trace.started) * 1000,
            extra,
        )


def _endpoint(path: str) -> str:
    return "chat" if path.endswith("chat/completions") else "completions"


def reply_outcome(reply: Reply) -> str:
    """The ``requests_total`` outcome of a buffered reply."""
    if reply.reason in SHED_REASONS:
        return "shed"
    if reply.reason is not None and reply.reason.endswith("_busy"):
        return "busy"
    if reply.status == 503:
        return "no_slot"
    return "ok" if reply.status < 400 else "client_error" if reply.status < 500 else "upstream_error"


def _room_for_pair(slots: SlotTable, prefills: Sequence[Slot], book: SlotBook, limit: int) -> bool:
    """Whether some prefill candidate has room and so does a decode of its revision."""
    decode_room: dict[str, bool] = {}
    for prefill in prefills:
        if not has_room(Role.PREFILL, prefill, book, limit):
            continue
        revision = prefill.revision
        room = decode_room.get(revision)
        if room is None:
            room = decode_room[revision] = any(
                has_room(Role.DECODE, d, book, limit) for d in slots.decode_for(revision)
            )
        if room:
            return True
    return False


async def _close_streams(replies: Iterable[Reply]) -> None:
    for reply in replies:
        if not isinstance(reply.body, bytes):
            await reply.body.aclose()
