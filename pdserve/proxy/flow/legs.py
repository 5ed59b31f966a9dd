"""The legs of one attempt: a prefill and a decode (one after the other, or at once), each with
its bookkeeping (in-flight counts, outcome metrics) and the ejection of what failed.

Every leg carries its own X-Request-Id: the connector makes them from the request's stem and
the leg's number (NIXL: ``<stem>-p1``, ``<stem>-d1``, ``<stem>-d2`` for a second decode; pdserve.kv).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.kv.base import LegPlan, Route
from pdserve.proxy.engine import codec
from pdserve.proxy.engine.upstream import Answer, BackendRefusal, LegError, Upstream
from pdserve.proxy.flow.admission import AdmissionGate
from pdserve.proxy.flow.attempts import (
    BUSY_OUTCOME,
    TRANSPORT_OUTCOMES,
    UNREACHABLE_OUTCOME,
    Handoff,
    LegFailure,
)
from pdserve.proxy.flow.relay import RelayStream
from pdserve.proxy.flow.reply import JSON, Reply
from pdserve.proxy.flow.trace import Trace
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.settings import DeadlineSettings
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.load import LoadWindow
from pdserve.proxy.table.served import RoutingState
from pdserve.routing import Role, Slot
from pdserve.tracing.context import TRACEPARENT, TRACESTATE
from pdserve.wire.headers import AUTHORIZATION, DP_RANK, REQUEST_ID

log = logging.getLogger("pdserve.proxy.request")

T = TypeVar("T")


@dataclass(frozen=True)
class Engines:
    """How a leg reaches an engine: the client, the deadlines, and the key the engines expect
    (None: the client's Authorization header is forwarded)."""

    upstream: Upstream
    deadlines: DeadlineSettings
    backend_api_key: str | None = None


@dataclass(slots=True, eq=False)
class _Leg:
    """One leg: where it goes and what it sends; once sent, what its end reports."""

    role: Role
    slot: Slot
    plan: LegPlan
    request_id: str
    span: Any = None  # while sent, when the request is traced
    sent: float = 0.0  # time.monotonic() when the leg was sent
    outcome: str = "cancelled"  # until the leg says otherwise
    status: int | None = None


class LegRunner:
    """Runs legs against the upstreams; the dispatcher (pdserve.proxy.flow.dispatcher) decides which."""

    def __init__(
        self,
        book: SlotBook,
        engines: Engines,
        metrics: ProxyMetrics,
        admission: AdmissionGate | None = None,
    ) -> None:
        self.book = book
        self.admission = admission or AdmissionGate(0, 0, 0.0, metrics)
        self.upstream = engines.upstream
        self.metrics = metrics
        self.deadlines = engines.deadlines
        self.backend_api_key = engines.backend_api_key
        self.unreachable = book.unreachable
        #: The latencies and outcomes of the last minutes, for ``GET /load`` (the autoscaler's window).
        self.load = LoadWindow()

    def _close(self, trace: Trace, status: int, outcome: str) -> None:
        """The end of a request (the dispatcher counts and logs it)."""
        raise NotImplementedError

    async def _attempt(
        self,
        state: RoutingState,
        path: str,
        body: Mapping[str, Any],
        prefill: Slot,
        decode: Slot,
        trace: Trace,
        auth: str | None,
    ) -> Reply:
        connector = state.connector
        handoff = trace.handoff
        next_prefill = trace.prefill_legs + (0 if handoff is not None else 1)
        ids = connector.ids(trace.engine_base, next_prefill, trace.decode_legs + 1, prefill, decode, _uid())
        if not connector.concurrent:
            reused = handoff is not None
            if handoff is None:
                trace.prefill_legs += 1
                prefill_plan = connector.prefill_leg(body, prefill, decode, ids)
                prefill_leg = _Leg(Role.PREFILL, prefill, prefill_plan, ids.prefill)
                params = await self._prefill(connector, prefill_leg, path, auth, trace)
                handoff = trace.handoff = Handoff(params, prefill, time.monotonic())
            decode_plan = connector.decode_leg(body, prefill, decode, ids, handoff.params)
            decode_leg = _Leg(Role.DECODE, decode, decode_plan, ids.decode)
            trace.decode_legs += 1
            if trace.spans is not None:
                trace.kv_span = trace.spans.kv_handoff(handoff.prefill, decode, handoff.params, reused)
            # The decode pulls the KV from the prefill before its first byte: until then the
            # prefill instance is still in use (a drain must not delete it yet).
            self.book.pin(Role.PREFILL, handoff.prefill.key)
            try:
                return await self._decode(decode_leg, path, auth, trace, background=None)
            finally:
                self.book.unpin(Role.PREFILL, handoff.prefill.key)
        trace.prefill_legs += 1
        trace.decode_legs += 1
        prefill_plan = connector.prefill_leg(body, prefill, decode, ids)
        decode_plan = connector.decode_leg(body, prefill, decode, ids, None)
        prefill_leg = _Leg(Role.PREFILL, prefill, prefill_plan, ids.prefill)
        decode_leg = _Leg(Role.DECODE, decode, decode_plan, ids.decode)
        prefill_task = asyncio.create_task(self._prefill(connector, prefill_leg, path, auth, trace))
        decode_task = asyncio.create_task(
            self._decode(decode_leg, path, auth, trace, background=prefill_task)
        )
        try:
            await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.exception() is not None and not decode_task.done():
                raise prefill_task.exception()  # type: ignore[misc]  # decode not streaming yet: fail
            return await decode_task
        except BaseException:
            for task in (prefill_task, decode_task):
                task.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)
            raise

    # --- the legs -------------------------------------------------------------------------------

    def _headers(self, leg: _Leg, auth: str | None, trace: Trace) -> dict[str, str]:
        headers = {"Content-Type": JSON, REQUEST_ID: leg.request_id}
        if leg.plan.dp_rank is not None:
            headers[DP_RANK] = str(leg.plan.dp_rank)
        if self.backend_api_key:
            headers[AUTHORIZATION] = f"Bearer {self.backend_api_key}"
        elif auth:
            headers[AUTHORIZATION] = auth
        if trace.spans is not None:  # the leg's own context: the engine's span is its child
            trace.spans.inject(headers, leg.span)
        elif trace.traceparent is not None:  # not tracing here: the client's context passes through
            headers[TRACEPARENT] = trace.traceparent
            if trace.tracestate:
                headers[TRACESTATE] = trace.tracestate
        return headers

    async def _prefill(
        self, connector: Route, leg: _Leg, path: str, auth: str | None, trace: Trace
    ) -> Mapping[str, Any] | None:
        """Run the prefill leg; the handoff it returns has passed the connector's validation."""
        slot = leg.slot
        self._leg_begins(leg, trace)
        try:
            answer = await self._send(leg, self.upstream.post, path, auth, trace)
            leg.status = answer.status
            handoff = _kv_transfer_params(answer)
            problems = connector.handoff_problems(handoff)
            if problems:
                leg.outcome = "bad_handoff"
                self.metrics.handoff_failures.labels(slot.key).inc()
                detail = (
                    f"prefill answered without usable kv_transfer_params: missing or malformed "
                    f"{', '.join(problems)}"
                )
                raise LegFailure(Role.PREFILL, slot, LegError("bad_handoff", detail, tuple(problems)))
            leg.outcome = "ok"
            self._first_byte(Role.PREFILL, time.monotonic() - leg.sent)
            return handoff
        finally:
            self._leg_ends(leg, trace)

    async def _decode(
        self, leg: _Leg, path: str, auth: str | None, trace: Trace, background: asyncio.Task[Any] | None
    ) -> Reply:
        streaming = leg.plan.body.get("stream") is True
        self._leg_begins(leg, trace)
        try:
            if streaming:
                opened = await self._send(leg, self.upstream.open_stream, path, auth, trace)
            else:
                answer = await self._send(leg, self.upstream.post, path, auth, trace)
            trace.first_byte = time.monotonic()
            trace.decode_sent = leg.sent
            self._first_byte(Role.DECODE, trace.first_byte - leg.sent)
            if trace.spans is not None:
                trace.spans.first_token(trace.kv_span, trace.part)
                trace.kv_span = None
            if background is not None:
                background.add_done_callback(self._observe_background_prefill)
            if not streaming:
                leg.outcome, leg.status = "ok", answer.status
                return Reply(answer.status, answer.body, answer.content_type or JSON)
            leg.outcome = "streaming"  # the relay owns the leg from here
            trace.stream_span = leg.span
            return Reply(200, RelayStream(self, leg.slot, opened, trace, background), "text/event-stream")
        finally:
            if leg.outcome != "streaming":
                self._leg_ends(leg, trace)
                if trace.spans is not None:
                    trace.spans.end_handoff(trace.kv_span, leg.outcome)
                    trace.kv_span = None

    async def _send(
        self,
        leg: _Leg,
        send: Callable[[str, bytes, dict[str, str], float], Awaitable[T]],
        path: str,
        auth: str | None,
        trace: Trace,
    ) -> T:
        """Send the leg's request with ``send`` (a post, or a stream's opening) under its role's
        time-to-first-byte deadline; a failure is noted on the leg and raised as
        :meth:`_leg_failure` says."""
        deadlines = self.deadlines
        deadline = deadlines.prefill_ttfb if leg.role is Role.PREFILL else deadlines.decode_ttfb
        payload = codec.dumps(leg.plan.body)
        headers = self._headers(leg, auth, trace)
        try:
            return await send(leg.slot.url + path, payload, headers, deadline)
        except (LegError, BackendRefusal) as exc:
            leg.outcome, leg.status = exc.outcome, exc.status
            raise self._leg_failure(leg.role, leg.slot, exc) from None

    def _leg_failure(self, role: Role, slot: Slot, exc: LegError | BackendRefusal) -> Exception:
        """What a failed leg raises: the engine's own refusal (a 4xx, passed to the client), or a
        LegFailure the dispatcher may retry elsewhere, its deadline counted when it expired."""
        if isinstance(exc, BackendRefusal):
            return exc
        if exc.outcome == "timeout":
            self.metrics.deadline_expiries.labels(role.value, f"{role.value}_ttfb").inc()
        return LegFailure(role, slot, exc)

    def _observe_background_prefill(self, task: asyncio.Task[Any]) -> None:
        """Concurrent legs (MoRIIO WRITE): a prefill that fails after its decode started cannot fail
        the request."""
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, LegFailure):
            self.metrics.background_prefill_failures.labels(exc.slot.key).inc()
            log.warning("prefill failed while its decode was already streaming: %s", exc)
        elif exc is not None:
            log.warning("prefill failed while its decode was already streaming: %r", exc)

    # --- bookkeeping ----------------------------------------------------------------------------

    def _first_byte(self, role: Role, seconds: float) -> None:
        self.metrics.child(self.metrics.leg_ttfb, role.value).observe(seconds)
        self.load.observe("prefill" if role is Role.PREFILL else "decode_first", seconds)

    def _leg_begins(self, leg: _Leg, trace: Trace) -> None:
        """A leg is sent now: it counts in flight, and gets its span when the router traces
        this request."""
        self._leg_started(leg.role, leg.slot)
        spans = trace.spans
        if spans is not None:
            leg.span = spans.leg(
                leg.role.value, leg.slot, leg.request_id, trace.attempts, trace.retry_reason, trace.part
            )
        leg.sent = time.monotonic()

    def _leg_ends(self, leg: _Leg, trace: Trace) -> None:
        """A leg is over (not one the relay streams: it ends that one itself)."""
        self._leg_finished(leg.role, leg.slot, leg.outcome)
        if trace.spans is not None:
            trace.spans.end_leg(leg.span, leg.outcome, leg.status)

    def _leg_started(self, role: Role, slot: Slot) -> None:
        self.book.started(role, slot.key)
        self.metrics.child(self.metrics.slot_in_flight, role.value, slot.key).inc()

    def _leg_finished(self, role: Role, slot: Slot, outcome: str) -> None:
        ok = outcome in ("ok", "cancelled", BUSY_OUTCOME) or outcome.startswith("http_4")
        self.book.finished(role, slot.key, ok)
        self.admission.release()
        self.metrics.child(self.metrics.slot_in_flight, role.value, slot.key).dec()
        self.metrics.child(self.metrics.upstream, role.value, slot.key, outcome).inc()

    def _eject(self, role: Role, slot: Slot, outcome: str = "") -> None:
        """A connection failure ejects every slot of the instance; a busy engine nothing; any other
        failure, the slot.

        A multi-node instance whose node's API server cannot be reached is ejected whole, every
        rank on every node, and marked unreachable: vLLM cannot lose a DP (or TP/PP) member and
        go on, the other nodes' engines stall in their collectives until the group is replaced,
        so slots on the surviving nodes would only fail later and slower."""
        if outcome == BUSY_OUTCOME:
            return
        if outcome not in TRANSPORT_OUTCOMES:
            if self.book.eject(role, slot.key):
                self.metrics.ejections.labels(role.value, slot.key).inc()
                log.warning(
                    "slot ejected: role=%s slot=%s cool_down_s=%g",
                    role.value,
                    slot.key,
                    self.book.eject_seconds,
                )
            return
        instance = slot.instance
        newly = 0
        for rank in range(instance.dp_size):
            key = Slot(instance, rank).key
            if self.book.eject(role, key):
                newly += 1
                self.metrics.ejections.labels(role.value, key).inc()
        if outcome == UNREACHABLE_OUTCOME:
            self.unreachable.mark(role, instance.name)
        if newly:
            log.warning(
                "instance ejected: role=%s instance=%s slots=%d reason=%s routable=%s cool_down_s=%g",
                role.value,
                instance.name,
                instance.dp_size,
                outcome,
                "no" if outcome == UNREACHABLE_OUTCOME else "last-resort",
                self.book.eject_seconds,
            )


def _uid() -> str:
    """A transfer id (for a connector that makes one per attempt): 128 random bits as uuid4's hex,
    without a system call per attempt."""
    return f"{random.getrandbits(128):032x}"


def _kv_transfer_params(answer: Answer) -> Mapping[str, Any] | None:
    try:
        data = codec.loads(answer.body)
    except (ValueError, UnicodeDecodeError):
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, Mapping) else None
