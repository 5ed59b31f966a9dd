"""The legs' HTTP/1.1 client: keep-alive connections per engine, httptools' parser, one write per
request.

Why not aiohttp's client here: a py-spy profile of the proxy under load put a large share of
its CPU in aiohttp's request path (request and response objects, header multidicts, payload
registry, a writer task per request, the connector's bookkeeping), for legs that are always
the same: a POST of a body already encoded, to an engine the proxy keeps connections to, whose
answer is read whole or relayed chunk by chunk. This client does only that, on the parser
uvicorn uses (httptools, llhttp); bench/results/latest.md has the figures before and after.
aiohttp stays the client of everything else (profiler broadcast, model listing, the ConfigMap watch).

What it keeps of aiohttp's behaviour: a pool of idle connections per origin, kept
``keepalive`` seconds; a connect timeout; a closed response (``close``) closes its connection
so the engine sees the cancel; back-pressure on a stream (reading pauses while the relay has
not taken what came); failures as :class:`ConnectFailed` (the request never left) or
:class:`Disconnected` (the connection broke or the answer was malformed). Like aiohttp for a
POST, a request is never sent twice.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httptools

#: A stream's unread bytes above which reading from the engine pauses (the client is slower).
HIGH_WATER = 1 << 18


class HTTPError(Exception):
    """Base of the client's failures."""


class ConnectFailed(HTTPError):
    """No connection could be made: the request was not sent."""

    def __init__(self, detail: str, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.timed_out = timed_out


class Disconnected(HTTPError):
    """The connection broke, or the answer was not valid HTTP, before the answer was complete."""


class DeadlineExceeded(TimeoutError):
    """The answer (or the part of it the caller waited for) did not come within the deadline."""


@dataclass(frozen=True)
class Origin:
    """What a request URL is parsed into once (the same few URLs carry every leg)."""

    host: str
    port: int
    tls: bool
    path: bytes  # path and query, as sent on the request line
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parsed = httptools.parse_url(url.encode())
        scheme = (parsed.schema or b"http").decode().lower()
        if scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = scheme == "https"
        host = parsed.host.decode()
        port = parsed.port or (443 if tls else 80)
        path = parsed.path or b"/"
        if parsed.query:
            path += b"?" + parsed.query
        default = port == (443 if tls else 80)
        bracketed = f"[{host}]" if ":" in host else host
        host_header = (bracketed if default else f"{bracketed}:{port}").encode()
        return cls(host, port, tls, path, host_header)


class Response:
    """One answer: status and content type once the headers are in, then the body."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = 0
        self.content_type = "application/octet-stream"
        self._headers_in = asyncio.get_running_loop().create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering = False  # released before its end: give the connection back at the end
        #: Takes a chunk as it arrives while the reader waits with nothing buffered; True when it
        #: took it (the reader is not woken), False to buffer it for the reader as usual.
        self.sink: Callable[[bytes], bool] | None = None

    def expire_in(self, seconds: float) -> None:
        """Fail the pending and later reads with :class:`DeadlineExceeded` unless the answer is
        complete (or :meth:`disarm` is called) within ``seconds``. One timer per answer: cheaper
        than ``asyncio.timeout`` around each await, a visible share of the CPU per leg."""
        self._deadline = asyncio.get_running_loop().call_later(seconds, self._expire, seconds)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, seconds: float) -> None:
        self._deadline = None
        self._failed(DeadlineExceeded(f"no answer within {seconds:g} s"))

    async def headers(self) -> None:
        await self._headers_in

    async def readany(self) -> bytes:
        """What has arrived since the last read (waiting for some), or b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > HIGH_WATER and self._conn is not None:
            self._conn.transport.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def set_exception(self, exc: BaseException) -> None:
        """Fail the pending and later reads with ``exc`` (a deadline outside the client)."""
        self._error = exc
        self._wake()

    def release(self, linger: float = 0.0) -> None:
        """Done with the answer: a complete one gives its connection back to the pool. With
        ``linger``, an answer whose end has not arrived yet (an engine writes the end of its
        body after its last event) waits up to that many seconds for it, then gives the
        connection back, or closes it if the end does not come."""
        if linger > 0 and not self._complete and self._error is None and self._conn is not None:
            self._lingering = True
            if self._deadline is None:
                self.expire_in(linger)
            return
        self.disarm()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done(reusable=self._complete and self._error is None)

    def close(self) -> None:
        """Drop the answer and its connection (the engine sees the disconnect)."""
        self.disarm()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done(reusable=False)

    # --- fed by the connection --------------------------------------------------------------

    def _got_headers(self, status: int, content_type: str | None) -> None:
        self.status = status
        if content_type:
            self.content_type = content_type.partition(";")[0].strip().lower() or self.content_type
        if not self._headers_in.done():
            self._headers_in.set_result(None)

    def _got_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and self._conn is not None:
            self._conn.transport.pause_reading()
        if self.sink is None:
            self._wake()
        # else: _arrived, once the connection's bytes are parsed, offers them to the sink at once

    def _arrived(self) -> None:
        """The end of one read from the connection: what it brought goes to the sink in one
        piece if the reader waits with nothing else buffered, else to the reader."""
        if not self._chunks:
            return
        waiter = self._waiter
        if self.sink is not None and waiter is not None and not waiter.done():
            data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            if self.sink(data):
                if self._buffered > HIGH_WATER and self._conn is not None:
                    self._conn.transport.resume_reading()
                self._buffered = 0
                return
            self._chunks.append(data)
        self._wake()

    def _got_end(self) -> None:
        self._complete = True
        self.disarm()
        self._wake()
        if self._lingering:
            self.release()

    def _failed(self, exc: BaseException) -> None:
        if not self._headers_in.done():
            self._headers_in.set_exception(exc)
        if self._error is None:
            self._error = exc
        self._wake()
        if self._lingering:
            self.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls the ``on_*`` methods as it parses."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set on connect
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.lost = False
        self.idle_since = 0.0
        self._content_type: str | None = None
        self._header_name = b""
        self._framed = False  # Content-Length or chunked: the end is in the message, not the close
        self._message_done = False
        self._keep_alive = False  # read with the headers: the parser forgets it once the message ends

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is not reusable
            self.transport.close()
            return
        response = self.response
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.transport.close()
            if self.response is not None:
                self.response._failed(Disconnected(f"malformed answer: {exc}"))
            return
        if response.sink is not None:
            response._arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        response = self.response
        if response is None or self._message_done:
            return
        if response.status and not self._framed:  # the body runs until the close (HTTP/1.0 style)
            self._message_done = True
            response._got_end()
            return
        reason = f": {exc}" if exc else ""
        response._failed(Disconnected(f"server disconnected{reason}"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self._content_type = value.decode("latin-1")
        elif lower in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()
        if self.response is not None:
            self.response._got_headers(self.parser.get_status_code(), self._content_type)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._got_body(body)

    def on_message_complete(self) -> None:
        self._message_done = True
        if self.response is not None:
            self.response._got_end()

    # the pool's side

    def send(self, head: bytes, payload: bytes) -> Response:
        self._content_type = None
        self._framed = self._message_done = self._keep_alive = False
        self.response = Response(self)
        self.transport.write(head + payload)
        return self.response

    def done(self, reusable: bool) -> None:
        keep = reusable and self._message_done and self._keep_alive and not self.lost
        self.response = None
        if keep:
            self.pool._idle_again(self)
        else:
            self.transport.close()


class Pool:
    """Connections per origin, idle ones reused newest first and closed after ``keepalive`` s."""

    def __init__(self, connect_timeout: float, keepalive: float) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._swept = time.monotonic()
        self._tls: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        found = self._origins.get(url)
        if found is None:
            if len(self._origins) > 4096:  # slots x endpoints; cleared after many table changes
                self._origins.clear()
            found = self._origins[url] = Origin.parse(url)
        return found

    async def post(
        self, url: str, payload: bytes, headers: dict[str, str], deadline: float | None = None
    ) -> Response:
        """Send the request; the answer once its status line and headers are in. ``deadline``:
        seconds from the send (after the connect, which has its own timeout) until the answer
        is complete, or until the caller disarms it (:meth:`Response.disarm`)."""
        origin = self.origin(url)
        conn = await self._connection(origin)
        lines = [b"POST ", origin.path, b" HTTP/1.1\r\nHost: ", origin.host_header]
        lines.append(b"\r\nContent-Length: %d\r\n" % len(payload))
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        response = conn.send(b"".join(lines), payload)
        if deadline is not None:
            response.expire_in(deadline)
        try:
            await response.headers()
        except BaseException:
            response.close()
            raise
        return response

    async def _connection(self, origin: Origin) -> _Connection:
        key = (origin.host, origin.port, origin.tls)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and not conn.transport.is_closing() and now - conn.idle_since < self.keepalive:
                return conn
            conn.transport.close()
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), origin.host, origin.port, ssl=tls
                )
        except TimeoutError:
            raise ConnectFailed("connect timed out", timed_out=True) from None
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _idle_again(self, conn: _Connection) -> None:
        now = conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        if now - self._swept > self.keepalive:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close connections idle past the keep-alive (engines that left the table keep none)."""
        self._swept = now
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if now - c.idle_since < self.keepalive and not c.lost]
            for conn in idle:
                if conn not in keep:
                    conn.transport.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()
