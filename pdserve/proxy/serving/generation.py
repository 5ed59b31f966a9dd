"""The generation endpoints as a plain ASGI handler in front of the Quart app.

Why not Quart routes: these two endpoints carry all of the traffic, and Quart's per-request
machinery (request and app contexts, werkzeug routing and header structures, response
wrappers) cost more CPU than the proxying itself. Everything else (probes, metrics, debug,
admin) stays in Quart, where speed does not matter. Behaviour is the same either way:
OpenAI-style errors, the request id on every answer, the API key, the body limit, and a
client disconnect cancelling the request (and so both upstream legs).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from pdserve.proxy.engine import codec
from pdserve.proxy.flow.dispatcher import Dispatcher
from pdserve.proxy.flow.reply import Reply
from pdserve.proxy.flow.sequences import plan_split
from pdserve.proxy.flow.trace import logged_trace_id
from pdserve.proxy.serving.ports import refused_here
from pdserve.proxy.settings import RequestSettings
from pdserve.tracing.context import TRACEPARENT, TRACESTATE
from pdserve.wire.headers import ERROR_REASON
from pdserve.wire.openai import (
    Endpoint,
    RequestError,
    check_generation_request,
    error_body,
    invalid_json,
)

if TYPE_CHECKING:  # loaded only when the router traces
    from pdserve.proxy.flow.spans import RequestSpans, RequestTracer

log = logging.getLogger("pdserve.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # Quart types its ASGI events precisely

ERROR_REASON_HEADER = ERROR_REASON.lower().encode()

#: The client headers the generation path reads (the trace context is passed on to the engines).
WANTED_HEADERS = frozenset({"x-request-id", "content-length", "authorization", TRACEPARENT, TRACESTATE})

ENDPOINTS: dict[str, Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

#: ASGI scope extension of a server that can write body chunks of a started response outside
#: ``send``: ``scope["extensions"][PUSH_BODY](chunk)`` writes the chunk now and returns True, or
#: returns False when it must go through ``send`` (pdserve.proxy.serving.server offers it on uvicorn).
PUSH_BODY = "pdserve.push_body"


def client_key_problem(api_key: str | None, authorization: str | None) -> RequestError | None:
    """401 unless the client presents ``Bearer <api_key>`` (constant-time comparison)."""
    if not api_key:
        return None
    presented = (authorization or "").encode()
    if hmac.compare_digest(presented, f"Bearer {api_key}".encode()):
        return None
    return RequestError(
        401, "missing or wrong API key (send 'Authorization: Bearer <key>')", reason="invalid_api_key"
    )


def request_id_of(header: str | None) -> str:
    """The client's id, or a new random one (128 bits, as uuid4's hex, without a system call)."""
    return header or f"{random.getrandbits(128):032x}"


class GenerationApp:
    """Serves POST /v1/completions and /v1/chat/completions; passes everything else to ``fallback``."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        fallback: ASGIApp,
        requests: RequestSettings,
        admin_port: int | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        """``tracer``: the request spans' source when the router traces (None: it does not)."""
        self.dispatcher = dispatcher
        self.tracer = tracer
        self.fallback = fallback
        self.api_key = requests.api_key
        self.max_body_bytes = requests.max_body_bytes
        self.max_sequences = requests.max_sequences
        self.admin_port = admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if refused_here(scope, self.admin_port):
            await self._drain(receive)
            await _send_reply(send, _error_reply(_not_on_this_port(scope["path"])), request_id_of(None))
            return
        if scope["type"] != "http" or scope["path"] not in ENDPOINTS:
            await self.fallback(scope, receive, send)
            return
        headers = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key in WANTED_HEADERS:  # the rest is never read: no decoding per header
                headers[key] = value.decode("latin-1")
        client_id = headers.get("x-request-id")
        request_id = request_id_of(client_id)
        spans = None
        if self.tracer is not None:
            spans = self.tracer.request(
                scope["method"], scope["path"], request_id, headers.get(TRACEPARENT), headers.get(TRACESTATE)
            )
        problem = self._refusal(scope, headers)
        if problem is not None:
            self._refused(request_id, scope["path"], problem, headers, spans)
            await self._drain(receive)
            await _send_reply(send, _error_reply(problem), request_id)
            return
        body = await self._read_body(receive, headers)
        if body is None:
            if spans is not None:  # the client went away while sending
                spans.end(499, "cancelled", {})
            return
        if isinstance(body, RequestError):
            self._refused(request_id, scope["path"], body, headers, spans)
            await _send_reply(send, _error_reply(body), request_id)
            return
        # Serve in this task and watch for the client's disconnect in one other: a disconnect
        # cancels this task, which closes both upstream legs. (One extra task per request, not
        # two plus an asyncio.wait: this is the hot path.)
        serving = asyncio.current_task()
        assert serving is not None
        disconnected = finished = False

        def hang_up(_: object) -> None:
            nonlocal disconnected
            if finished or watching.cancelled():
                return  # the answer is complete (the callback may run after remove_done_callback)
            disconnected = True
            serving.cancel()

        watching = asyncio.ensure_future(_wait_disconnect(receive))
        watching.add_done_callback(hang_up)
        try:
            path = scope["path"]
            push = scope["extensions"].get(PUSH_BODY) if "extensions" in scope else None
            await self._serve(
                send, push, ENDPOINTS[path], path, body, request_id, headers, client_id is not None, spans
            )
        except asyncio.CancelledError:
            if not disconnected:
                raise  # the server's own cancel (shutdown), not the client's
            if serving.cancelling():
                serving.uncancel()
        except Exception:
            log.exception("generation request %s failed%s", request_id, _trace_note(headers, spans))
        finally:
            finished = True
            watching.remove_done_callback(hang_up)
            watching.cancel()  # not awaited: it ends in its next step, and this task need not wait

    def _refused(
        self,
        request_id: str,
        path: str,
        exc: RequestError,
        headers: Mapping[str, str],
        spans: RequestSpans | None,
    ) -> None:
        """A request refused before routing: logged (its span ended), and counted with the client
        requests (``pdserve_proxy_requests_total``; the dispatcher counts every other one)."""
        _log_refusal(request_id, path, exc, headers, spans)
        metrics = self.dispatcher.metrics
        endpoint = "chat" if path.endswith("chat/completions") else "completions"
        outcome = "client_error" if exc.status < 500 else "upstream_error"
        metrics.child(metrics.requests, endpoint, outcome).inc()

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> RequestError | None:
        if scope["method"] != "POST":
            return RequestError(
                405,
                f"method {scope['method']} is not allowed on {scope['path']}",
                reason="method_not_allowed",
            )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return client_key_problem(self.api_key, headers.get("authorization"))

    async def _read_body(self, receive: Receive, headers: dict[str, str]) -> bytes | RequestError | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._drain(receive, message)
                return _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _drain(receive: Receive, last: Message | None = None) -> None:
        """Read what the client still sends, so the refusal is not a connection reset."""
        while last is None or (last["type"] == "http.request" and last.get("more_body", False)):
            last = await receive()

    async def _serve(
        self,
        send: Send,
        push: Callable[[bytes], bool] | None,
        endpoint: Endpoint,
        path: str,
        raw: bytes,
        request_id: str,
        headers: dict[str, str],
        client_id: bool,
        spans: RequestSpans | None,
    ) -> None:
        try:
            checked = parse_request(raw, endpoint)
            split = plan_split(checked, endpoint, self.max_sequences)
        except RequestError as exc:
            self._refused(request_id, path, exc, headers, spans)
            await _send_reply(send, _error_reply(exc), request_id)
            return
        if spans is not None and spans.recording and isinstance(checked.get("model"), str):
            spans.span.set_attribute("gen_ai.request.model", checked["model"])
        try:
            reply = await self.dispatcher.generate(
                path,
                checked,
                request_id,
                headers.get("authorization"),
                split,
                client_id=client_id,
                traceparent=headers.get(TRACEPARENT),
                tracestate=headers.get(TRACESTATE),
                spans=spans,
            )
        except Exception:
            log.exception("unexpected error serving request %s%s", request_id, _trace_note(headers, spans))
            reply = Reply(500, codec.dumps(error_body(500, "internal proxy error")), reason="internal_error")
        await _send_reply(send, reply, request_id, push)


def parse_request(raw: bytes, endpoint: Endpoint) -> Mapping[str, Any]:
    """The body of a generation request, or the refusal vLLM would answer (its status and param)."""
    try:
        body = codec.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise invalid_json(exc) from None
    return check_generation_request(body, endpoint)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"request body is larger than {limit} bytes", reason="request_too_large")


def _not_on_this_port(path: str) -> RequestError:
    return RequestError(404, f"no such endpoint on this port: {path}", reason="not_found")


def _error_reply(exc: RequestError) -> Reply:
    return Reply(exc.status, codec.dumps(exc.body()), reason=exc.reason)


def _log_refusal(
    request_id: str, path: str, exc: RequestError, headers: Mapping[str, str], spans: RequestSpans | None
) -> None:
    """The one log line (and the span) of a request refused before routing (the dispatcher logs
    and ends all others)."""
    if spans is not None:
        spans.end(exc.status, "refused", {"pdserve.reason": exc.reason or ""})
    log.info(
        "request id=%s endpoint=%s status=%d outcome=refused reason=%s%s",
        request_id,
        path,
        exc.status,
        exc.reason,
        _trace_note(headers, spans),
    )


def _trace_note(headers: Mapping[str, str], spans: RequestSpans | None) -> str:
    """`` trace_id=...`` for a log line: the request's trace (the client's when not tracing), if any."""
    trace_id = logged_trace_id(spans, headers.get(TRACEPARENT))
    return f" trace_id={trace_id}" if trace_id is not None else ""


async def _send_reply(
    send: Send, reply: Reply, request_id: str, push: Callable[[bytes], bool] | None = None
) -> None:
    """``push``: the server's writer of body chunks between sends (:data:`PUSH_BODY`), if any."""
    headers = [
        (b"content-type", reply.content_type.encode()),
        (b"x-request-id", request_id.encode("latin-1")),
        *reply.headers,
    ]
    if reply.reason is not None:
        headers.append((ERROR_REASON_HEADER, reply.reason.encode("latin-1")))
    if isinstance(reply.body, bytes):
        headers.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})
        return
    relay = reply.body
    try:
        headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        if push is not None:
            relay.push_to(push)
        async for chunk in relay:
            if relay.complete:  # the [DONE] event ends the response, in the same write
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                relay.delivered()
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await relay.aclose()  # a no-op after a clean end; closes the upstream on a cancel
