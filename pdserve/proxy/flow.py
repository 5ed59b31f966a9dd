"""One client request through the proxy: choose slots, run the legs, retry, relay the stream.

An *attempt* is one prefill leg plus one decode leg. A failure before anything reached the
client ejects the failed slot and starts a new attempt on the next candidate of that role
(bounded by ``max_retries``); the decode never receives a handoff that failed validation.
Once the first byte has reached the client, a failure ends the stream with an OpenAI-style
error event instead. The client's disconnect cancels every upstream leg at once (closing a
connection is how vLLM learns to free the request's KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.proxy import codec
from pdserve.proxy.connectors import Connector, LegIds, LegPlan
from pdserve.proxy.health import SlotBook
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import Policy
from pdserve.proxy.served import RoutingState, ServedTable
from pdserve.proxy.upstream import Answer, BackendRefusal, LegError, OpenStream, Upstream
from pdserve.routing import Role, Slot
from pdserve.wire.headers import AUTHORIZATION, DP_RANK, REQUEST_ID
from pdserve.wire.openai import error_body

log = logging.getLogger("pdserve.proxy.request")

JSON = "application/json"


@dataclass(frozen=True)
class Deadlines:
    prefill_ttfb: float  # whole prefill answer (it is one token)
    decode_ttfb: float  # first chunk of a stream; the whole answer when not streaming
    stream_idle: float  # between two chunks of a stream


@dataclass
class Reply:
    """What the HTTP layer sends back: a buffered body or a relay of the decode's stream."""

    status: int
    body: bytes | RelayStream
    content_type: str = JSON


class LegFailure(Exception):
    def __init__(self, role: Role, slot: Slot, error: LegError) -> None:
        super().__init__(f"{role.value} {slot.key}: {error.detail}")
        self.role = role
        self.slot = slot
        self.error = error


@dataclass
class Trace:
    """Everything the one log line and the request metrics of a request need."""

    request_id: str
    endpoint: str
    stream: bool
    started: float = field(default_factory=time.monotonic)
    attempts: int = 0
    prefill: str = "-"
    decode: str = "-"
    first_byte: float | None = None
    closed: bool = False


def error_reply(status: int, message: str, type_: str, code: str) -> Reply:
    return Reply(status, codec.dumps(error_body(message, type_, code)))


def sse_error_event(message: str, code: str) -> bytes:
    event = codec.dumps(error_body(message, "upstream_error", code))
    return b"data: " + event + b"\n\ndata: [DONE]\n\n"


class Dispatcher:
    def __init__(
        self,
        served: ServedTable,
        policy: Policy,
        book: SlotBook,
        upstream: Upstream,
        metrics: ProxyMetrics,
        deadlines: Deadlines,
        max_retries: int,
        backend_api_key: str | None,
    ) -> None:
        self.served = served
        self.policy = policy
        self.book = book
        self.upstream = upstream
        self.metrics = metrics
        self.deadlines = deadlines
        self.max_retries = max_retries
        self.backend_api_key = backend_api_key

    # --- the request ----------------------------------------------------------------------------

    async def generate(
        self, path: str, body: Mapping[str, Any], request_id: str, client_auth: str | None
    ) -> Reply:
        trace = Trace(request_id, path, stream=body.get("stream") is True)
        self.metrics.in_flight.inc()
        try:
            reply = await self._generate(path, body, trace, client_auth)
        except asyncio.CancelledError:
            self._close(trace, 499, "cancelled")
            raise
        except Exception:
            self._close(trace, 500, "proxy_error")
            raise
        if not isinstance(reply.body, RelayStream):
            outcome = (
                "ok" if reply.status < 400 else "client_error" if reply.status < 500 else "upstream_error"
            )
            self._close(trace, reply.status, "no_slot" if reply.status == 503 else outcome)
        return reply

    async def _generate(self, path: str, body: Mapping[str, Any], trace: Trace, auth: str | None) -> Reply:
        state = self.served.current  # this request's table, whatever reloads happen meanwhile
        if state is None or not state.slots.prefill or not state.slots.decode:
            role = "prefill" if state is None or not state.slots.prefill else "decode"
            return error_reply(
                503,
                f"no routable {role} instance (none ready in the routing table)",
                "service_unavailable",
                f"no_{role}_slot",
            )
        prefill_candidates = iter(self.policy.candidates(Role.PREFILL, state.slots.prefill, self.book))
        decode_candidates = iter(self.policy.candidates(Role.DECODE, state.slots.decode, self.book))
        prefill, decode = next(prefill_candidates), next(decode_candidates)
        failure: LegFailure | None = None
        for attempt in range(self.max_retries + 1):
            if failure is not None:
                self.metrics.retries.labels(failure.role.value, failure.error.outcome).inc()
            trace.attempts = attempt + 1
            trace.prefill, trace.decode = prefill.key, decode.key
            try:
                return await self._attempt(state, path, body, prefill, decode, trace, auth)
            except BackendRefusal as refusal:
                return Reply(refusal.status, refusal.body, refusal.content_type or JSON)
            except LegFailure as exc:
                failure = exc
                self._eject(exc.role, exc.slot)
                candidates = prefill_candidates if exc.role is Role.PREFILL else decode_candidates
                replacement = next(candidates, None)
                if replacement is None:
                    break
                if exc.role is Role.PREFILL:
                    prefill = replacement
                else:
                    decode = replacement
        assert failure is not None
        return self._failure_reply(failure, trace.attempts)

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
        ids = connector.ids(trace.request_id, prefill, decode, uuid.uuid4().hex)
        prefill_plan = connector.prefill_leg(body, prefill, decode, ids)
        if not connector.concurrent:
            handoff = await self._prefill(connector, prefill, path, prefill_plan, ids, auth)
            # The decode pulls the KV from the prefill before its first byte: until then the
            # prefill instance is still in use (a drain must not delete it yet).
            self.book.pin(Role.PREFILL, prefill.key)
            try:
                decode_plan = connector.decode_leg(body, prefill, decode, ids, handoff)
                return await self._decode(decode, path, decode_plan, ids, auth, trace, background=None)
            finally:
                self.book.unpin(Role.PREFILL, prefill.key)
        decode_plan = connector.decode_leg(body, prefill, decode, ids, None)
        prefill_task = asyncio.create_task(self._prefill(connector, prefill, path, prefill_plan, ids, auth))
        decode_task = asyncio.create_task(
            self._decode(decode, path, decode_plan, ids, auth, trace, background=prefill_task)
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

    def _headers(self, ids: LegIds, plan: LegPlan, auth: str | None) -> dict[str, str]:
        headers = {"Content-Type": JSON, REQUEST_ID: ids.request_id}
        if plan.dp_rank is not None:
            headers[DP_RANK] = str(plan.dp_rank)
        if self.backend_api_key:
            headers[AUTHORIZATION] = f"Bearer {self.backend_api_key}"
        elif auth:
            headers[AUTHORIZATION] = auth
        return headers

    async def _prefill(
        self, connector: Connector, slot: Slot, path: str, plan: LegPlan, ids: LegIds, auth: str | None
    ) -> Mapping[str, Any] | None:
        """Run the prefill leg; the handoff it returns has passed the connector's validation."""
        outcome = "cancelled"
        self._leg_started(Role.PREFILL, slot)
        try:
            payload = codec.dumps(plan.body)
            headers = self._headers(ids, plan, auth)
            try:
                answer = await self.upstream.post(
                    slot.url + path, payload, headers, self.deadlines.prefill_ttfb
                )
            except LegError as exc:
                outcome = exc.outcome
                if exc.outcome == "timeout":
                    self.metrics.deadline_expiries.labels("prefill", "prefill_ttfb").inc()
                raise LegFailure(Role.PREFILL, slot, exc) from None
            except BackendRefusal as refusal:
                outcome = f"http_{refusal.status // 100}xx"
                raise
            handoff = _kv_transfer_params(answer)
            problems = connector.handoff_problems(handoff)
            if problems:
                outcome = "bad_handoff"
                self.metrics.handoff_failures.labels(slot.key).inc()
                detail = (
                    f"prefill answered without usable kv_transfer_params: missing or malformed "
                    f"{', '.join(problems)}"
                )
                raise LegFailure(Role.PREFILL, slot, LegError("bad_handoff", detail, tuple(problems)))
            outcome = "ok"
            return handoff
        finally:
            self._leg_finished(Role.PREFILL, slot, outcome)

    async def _decode(
        self,
        slot: Slot,
        path: str,
        plan: LegPlan,
        ids: LegIds,
        auth: str | None,
        trace: Trace,
        background: asyncio.Task[Any] | None,
    ) -> Reply:
        outcome = "cancelled"
        self._leg_started(Role.DECODE, slot)
        try:
            payload = codec.dumps(plan.body)
            headers = self._headers(ids, plan, auth)
            url = slot.url + path
            try:
                if plan.body.get("stream") is True:
                    opened = await self.upstream.open_stream(
                        url, payload, headers, self.deadlines.decode_ttfb
                    )
                else:
                    answer = await self.upstream.post(url, payload, headers, self.deadlines.decode_ttfb)
            except LegError as exc:
                outcome = exc.outcome
                if exc.outcome == "timeout":
                    self.metrics.deadline_expiries.labels("decode", "decode_ttfb").inc()
                raise LegFailure(Role.DECODE, slot, exc) from None
            except BackendRefusal as refusal:
                outcome = f"http_{refusal.status // 100}xx"
                raise
            trace.first_byte = time.monotonic()
            if background is not None:
                background.add_done_callback(self._observe_background_prefill)
            if plan.body.get("stream") is not True:
                outcome = "ok"
                return Reply(answer.status, answer.body, answer.content_type or JSON)
            outcome = "streaming"  # the relay owns the leg from here
            return Reply(200, RelayStream(self, slot, opened, trace, background), "text/event-stream")
        finally:
            if outcome != "streaming":
                self._leg_finished(Role.DECODE, slot, outcome)

    def _observe_background_prefill(self, task: asyncio.Task[Any]) -> None:
        """MoRIIO WRITE: a prefill that fails after its decode started cannot fail the request."""
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, LegFailure):
            self.metrics.background_prefill_failures.labels(exc.slot.key).inc()
            log.warning("prefill failed while its decode was already streaming: %s", exc)
        elif exc is not None:
            log.warning("prefill failed while its decode was already streaming: %r", exc)

    # --- bookkeeping ----------------------------------------------------------------------------

    def _leg_started(self, role: Role, slot: Slot) -> None:
        self.book.started(role, slot.key)
        self.metrics.child(self.metrics.slot_in_flight, role.value, slot.key).inc()

    def _leg_finished(self, role: Role, slot: Slot, outcome: str) -> None:
        ok = outcome in ("ok", "cancelled") or outcome.startswith("http_4")
        self.book.finished(role, slot.key, ok)
        self.metrics.child(self.metrics.slot_in_flight, role.value, slot.key).dec()
        self.metrics.child(self.metrics.upstream, role.value, slot.key, outcome).inc()

    def _eject(self, role: Role, slot: Slot) -> None:
        if self.book.eject(role, slot.key):
            self.metrics.ejections.labels(role.value, slot.key).inc()
            log.warning(
                "slot ejected: role=%s slot=%s cool_down_s=%g", role.value, slot.key, self.book.eject_seconds
            )

    def _failure_reply(self, failure: LegFailure, attempts: int) -> Reply:
        error = failure.error
        message = (
            f"{failure.role.value} {failure.slot.key} failed after {attempts} attempt(s): {error.detail}"
        )
        if error.outcome == "bad_handoff":
            return error_reply(502, message, "upstream_error", "bad_kv_handoff")
        if error.outcome == "timeout":
            return error_reply(504, message, "upstream_timeout", f"{failure.role.value}_timeout")
        return error_reply(502, message, "upstream_error", f"{failure.role.value}_unavailable")

    def _close(self, trace: Trace, status: int, outcome: str) -> None:
        if trace.closed:
            return
        trace.closed = True
        now = time.monotonic()
        endpoint = "chat" if trace.endpoint.endswith("chat/completions") else "completions"
        self.metrics.in_flight.dec()
        self.metrics.child(self.metrics.requests, endpoint, outcome).inc()
        self.metrics.child(self.metrics.total, endpoint).observe(now - trace.started)
        if trace.first_byte is not None:
            self.metrics.child(self.metrics.ttft, endpoint).observe(trace.first_byte - trace.started)
        if not log.isEnabledFor(logging.INFO):
            return
        ttft_ms = "-" if trace.first_byte is None else f"{(trace.first_byte - trace.started) * 1000:.1f}"
        log.info(
            "request id=%s endpoint=%s stream=%s status=%d outcome=%s prefill=%s decode=%s attempts=%d "
            "ttfb_ms=%s total_ms=%.1f",
            trace.request_id,
            trace.endpoint,
            trace.stream,
            status,
            outcome,
            trace.prefill,
            trace.decode,
            trace.attempts,
            ttft_ms,
            (now - trace.started) * 1000,
        )


def _kv_transfer_params(answer: Answer) -> Mapping[str, Any] | None:
    try:
        data = codec.loads(answer.body)
    except (ValueError, UnicodeDecodeError):
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, Mapping) else None


class StreamIdle(Exception):
    """The decode sent nothing for the whole stream-idle period."""


class IdleDeadline:
    """The stream-idle deadline with one timer per stream instead of one per chunk.

    ``asyncio.timeout`` around every read schedules and cancels a timer per chunk, a visible
    share of the proxy's CPU. Here a read only stamps the loop's clock; one timer, when it
    fires, re-arms itself for the latest stamp, or, when the current read has waited the whole
    period, fails that read by setting :class:`StreamIdle` on the response's stream. Time spent
    waiting for the client to take a chunk does not count, as before.
    """

    def __init__(self, stream: aiohttp.StreamReader, seconds: float) -> None:
        self.seconds = seconds
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the pending read started; None between reads
        self._timer: asyncio.TimerHandle | None = None

    def reading(self) -> None:
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self.seconds, self._check)

    def waiting_for_client(self) -> None:
        self._since = None

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._since = None

    def _check(self) -> None:
        now = self._loop.time()
        if self._since is not None and now - self._since >= self.seconds:
            self._timer = None
            self._stream.set_exception(StreamIdle(f"no data for {self.seconds:g} s"))
            return
        start = self._since if self._since is not None else now
        self._timer = self._loop.call_at(start + self.seconds, self._check)


class RelayStream:
    """Relays the decode's SSE chunks as they arrive, under the idle deadline.

    A class rather than an async generator so that cleanup (closing the upstream response,
    counters, the log line) is synchronous and happens even if the HTTP layer drops the
    response before iterating it.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        slot: Slot,
        opened: OpenStream,
        trace: Trace,
        background: asyncio.Task[Any] | None,
    ) -> None:
        self._d = dispatcher
        self._slot = slot
        self._response = opened.response
        self._pending: bytes | None = opened.first_chunk
        self._trace = trace
        self._background = background
        self._done = False
        self._ends_event = True
        self._idle = IdleDeadline(opened.response.content, dispatcher.deadlines.stream_idle)

    def __aiter__(self) -> RelayStream:
        return self

    async def __anext__(self) -> bytes:
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            self._ends_event = chunk.endswith(b"\n\n")
            return chunk
        if self._done:
            raise StopAsyncIteration
        self._idle.reading()
        try:
            chunk = await self._response.content.readany()
        except StreamIdle:
            self._d.metrics.deadline_expiries.labels("decode", "stream_idle").inc()
            message = f"no data from the decode for {self._idle.seconds:g} s"
            return self._fail("timeout", "stream_idle_timeout", message)
        except aiohttp.ClientError as exc:
            return self._fail("dropped", "upstream_dropped", f"the decode's stream broke: {exc or type(exc)}")
        except asyncio.CancelledError:
            self.close("cancelled")
            raise
        finally:
            self._idle.waiting_for_client()
        if not chunk:
            self.close("ok")
            raise StopAsyncIteration
        self._ends_event = chunk.endswith(b"\n\n")
        return chunk

    def _fail(self, outcome: str, code: str, message: str) -> bytes:
        self._d.metrics.stream_errors.labels(code).inc()
        self.close(outcome)
        self._d._eject(Role.DECODE, self._slot)
        # Finish any half-sent event first so the error is an event of its own.
        prefix = b"" if self._ends_event else b"\n\n"
        return prefix + sse_error_event(f"decode {self._slot.key}: {message}", code)

    async def aclose(self) -> None:
        self.close("cancelled")

    def close(self, outcome: str) -> None:
        if self._done and self._trace.closed:
            return
        self._done = True
        self._idle.stop()
        if outcome == "ok":
            self._response.release()
        else:
            self._response.close()  # the decode sees the disconnect and frees the request's KV
            if self._background is not None and not self._background.done():
                self._background.cancel()
        self._d._leg_finished(Role.DECODE, self._slot, outcome)
        status = 200
        request_outcome = {"ok": "ok", "cancelled": "cancelled"}.get(outcome, "stream_error")
        self._d._close(self._trace, status if request_outcome != "cancelled" else 499, request_outcome)

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # never raise from a finalizer
                self.close("cancelled")
