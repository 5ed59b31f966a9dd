"""The relay of a decode's SSE stream to the client, under the stream-idle deadline.

The relay owns the decode leg once its stream is open; it reports the leg's end to the leg
runner that opened it (pdserve.proxy.flow.legs) through :class:`LegOwner`, so this module does
not import the legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from pdserve.proxy.engine import codec, h1
from pdserve.proxy.engine.upstream import OpenStream
from pdserve.proxy.flow.trace import Trace
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.settings import DeadlineSettings
from pdserve.proxy.state.load import LoadWindow
from pdserve.routing import Role, Slot
from pdserve.wire.openai import error_body


class LegOwner(Protocol):
    """The leg runner that opened the stream: its deadlines and metrics, and how a leg ends."""

    deadlines: DeadlineSettings
    metrics: ProxyMetrics
    load: LoadWindow

    def _leg_finished(self, role: Role, slot: Slot, outcome: str) -> None: ...

    def _eject(self, role: Role, slot: Slot, outcome: str = "") -> None: ...

    def _close(self, trace: Trace, status: int, outcome: str) -> None: ...


SSE_DONE = b"data: [DONE]\n\n"
#: A stream with fewer gaps between its token events gives no inter-token latency sample.
MIN_ITL_GAPS = 2


def sse_error_event(status: int, message: str) -> bytes:
    """An error event in the stream, shaped as vLLM shapes its own mid-stream errors."""
    event = codec.dumps(error_body(status, message))
    return b"data: " + event + b"\n\ndata: [DONE]\n\n"


def _refuse(_: bytes) -> bool:
    return False


class StreamIdle(Exception):
    """The decode sent nothing for the whole stream-idle period."""


class IdleDeadline:
    """The stream-idle deadline with one timer per stream instead of one per chunk.

    ``asyncio.timeout`` around every read schedules and cancels a timer per chunk, a visible
    share of the proxy's CPU. Here a read only stamps the loop's clock; one timer, when it
    fires, re-arms itself for the latest stamp, or, when the current read has waited the whole
    period, fails that read by setting :class:`StreamIdle` on the response. Time spent
    waiting for the client to take a chunk does not count, as before.
    """

    def __init__(self, stream: h1.Response, seconds: float) -> None:
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

    Once ``[DONE]`` has been handed to the client (the HTTP layer asks for the next chunk only
    after sending the previous one), the answer is complete: a client that hangs up while the
    relay still waits for the decode's end of body (real vLLM writes it separately) did not
    cancel anything, and a decode that breaks or stalls after ``[DONE]`` lost the client nothing.
    """

    def __init__(
        self,
        dispatcher: LegOwner,
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
        self._tail = b""  # the end of what was relayed, to spot [DONE] split across chunks
        self._done_relayed = False  # [DONE] was returned to the HTTP layer
        self._client_has_all = False  # ... and the HTTP layer sent it (it asked for more)
        self._idle = IdleDeadline(opened.response, dispatcher.deadlines.stream_idle)
        self._push: Callable[[bytes], bool] = _refuse
        self._events = 0  # "data:" lines relayed: the stream's mean inter-token gap at its end

    def push_to(self, push: Callable[[bytes], bool]) -> None:
        """Hand each chunk that arrives while the relay waits straight to ``push`` (the client
        connection's writer, from the decode connection's callback): no wake-up of the serving
        task per chunk. ``push`` refuses (False) when the client is slow or gone; the chunk is
        then buffered and goes the usual way. ``[DONE]`` always goes the usual way: it ends the
        client's response."""
        self._push = push
        self._response.sink = self._pushed

    def _pushed(self, chunk: bytes) -> bool:
        seen = chunk if len(chunk) >= len(SSE_DONE) else self._tail + chunk
        if seen.endswith(SSE_DONE) or not self._push(chunk):
            return False
        self._ends_event = chunk.endswith(b"\n\n")
        self._tail = seen[-len(SSE_DONE) :]
        self._events += chunk.count(b"data:")
        self._idle.reading()  # the decode sent something: the idle period starts again
        return True

    @property
    def complete(self) -> bool:
        return self._done_relayed

    def delivered(self) -> None:
        self._client_has_all = True

    def __aiter__(self) -> RelayStream:
        return self

    async def __anext__(self) -> bytes:
        self._client_has_all = self._done_relayed
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            return self._relayed(chunk)
        if self._done:
            raise StopAsyncIteration
        self._idle.reading()
        try:
            chunk = await self._response.readany()
        except StreamIdle:
            if self._client_has_all:
                self._end()
            self._d.metrics.deadline_expiries.labels("decode", "stream_idle").inc()
            message = f"no data from the decode for {self._idle.seconds:g} s"
            return self._fail("timeout", "stream_idle_timeout", message)
        except h1.HTTPError as exc:
            if self._client_has_all:
                self._end()
            return self._fail("dropped", "upstream_dropped", f"the decode's stream broke: {exc or type(exc)}")
        except asyncio.CancelledError:
            self.close(self._ending())
            raise
        finally:
            self._idle.waiting_for_client()
        if not chunk:
            self._end()
        return self._relayed(chunk)

    def _relayed(self, chunk: bytes) -> bytes:
        self._ends_event = chunk.endswith(b"\n\n")
        self._events += chunk.count(b"data:")
        # The chunk is not copied: only a chunk shorter than [DONE] is joined to the tail.
        seen = chunk if len(chunk) >= len(SSE_DONE) else self._tail + chunk
        self._done_relayed = self._done_relayed or seen.endswith(SSE_DONE)
        self._tail = seen[-len(SSE_DONE) :]
        return chunk

    def _end(self) -> NoReturn:
        self.close("ok")
        raise StopAsyncIteration

    def _ending(self) -> str:
        """The outcome of a stream stopped now from outside: complete once the client has [DONE]."""
        return "ok" if self._client_has_all else "cancelled"

    def _fail(self, outcome: str, code: str, message: str) -> bytes:
        self._d.metrics.stream_errors.labels(code).inc()
        self.close(outcome)
        self._d._eject(Role.DECODE, self._slot, outcome)
        # Finish any half-sent event first so the error is an event of its own.
        prefix = b"" if self._ends_event else b"\n\n"
        status = 504 if outcome == "timeout" else 502
        return prefix + sse_error_event(status, f"decode {self._slot.key}: {message}")

    async def aclose(self) -> None:
        self.close(self._ending())

    def close(self, outcome: str) -> None:
        if self._done and self._trace.closed:
            return
        self._done = True
        self._idle.stop()
        self._response.sink = None
        if outcome == "ok":  # the engine's end of body may still be on its way: wait for it
            self._response.release(linger=self._idle.seconds)
            self._observe_itl()
        else:
            self._response.close()  # the decode sees the disconnect and frees the request's KV
            if self._background is not None and not self._background.done():
                self._background.cancel()
        self._d._leg_finished(Role.DECODE, self._slot, outcome)
        spans = self._trace.spans
        if spans is not None:
            spans.end_leg(self._trace.stream_span, outcome, 200)
            self._trace.stream_span = None
        status = 200
        request_outcome = {"ok": "ok", "cancelled": "cancelled"}.get(outcome, "stream_error")
        self._d._close(self._trace, status if request_outcome != "cancelled" else 499, request_outcome)

    def _observe_itl(self) -> None:
        """The decode leg's time, and the mean gap between the stream's token events: from the
        first chunk to now over the events between, less ``[DONE]`` (a usage-only event, when
        asked for, counts as a token)."""
        now = time.monotonic()
        if self._trace.decode_sent is not None:
            self._d.load.observe("decode", now - self._trace.decode_sent)
        first = self._trace.first_byte
        gaps = self._events - 2
        if first is None or gaps < MIN_ITL_GAPS:
            return
        itl = (now - first) / gaps
        endpoint = "chat" if self._trace.endpoint.endswith("chat/completions") else "completions"
        self._d.metrics.child(self._d.metrics.itl, endpoint).observe(itl)
        self._d.load.observe("itl", itl)

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # never raise from a finalizer
                self.close(self._ending())
