"""The proxy process's HTTP clients to the engines, and how upstream failures are classified.

A session per request (what vLLM's toy proxies do) pays a TCP handshake per leg and caps
throughput; one pool keeps connections to every instance alive across requests and carries
thousands of concurrent streams. The legs go through the lean client of pdserve.proxy.engine.h1;
the admin requests (model listing, profiler broadcast, the sidecar's engine check) through one
aiohttp session.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from pdserve.proxy.engine import h1
from pdserve.wire.openai import normalize_error_body

# Idle pooled connections are kept this long; a connection the
# engine closed meanwhile is seen closed when taken from the pool and not used.
POOL_KEEPALIVE_SECONDS = 30.0


class LegError(Exception):
    """A leg that failed in a way another slot may not: retry elsewhere, eject this slot.

    ``outcome`` is the metrics label: connect_error, http_5xx, dropped, timeout, bad_handoff, or
    busy (the engine answered 503 or 429: saturated, not broken; retried elsewhere, not ejected).
    """

    def __init__(
        self, outcome: str, detail: str, problems: tuple[str, ...] = (), status: int | None = None
    ) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.problems = problems
        self.status = status  # the engine's HTTP status, when it answered one


@dataclass(frozen=True)
class BackendRefusal(Exception):
    """A 4xx from a backend: the client's mistake (bad params, DP rank out of range), passed back."""

    status: int
    body: bytes
    content_type: str

    @property
    def outcome(self) -> str:
        """The leg's outcome in the metrics: ``http_4xx``."""
        return f"http_{self.status // 100}xx"


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str


@dataclass
class OpenStream:
    """A decode response whose first chunk has arrived; the rest is read by the relay."""

    response: h1.Response
    first_chunk: bytes


class Upstream:
    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._pool = h1.Pool(connect_timeout, POOL_KEEPALIVE_SECONDS)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # no pool cap: the client's concurrency is the only bound
            limit_per_host=0,
            keepalive_timeout=POOL_KEEPALIVE_SECONDS,
            ttl_dns_cache=60,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            auto_decompress=False,
            # Bytes are relayed as they come, so the backends must not compress them; and one
            # client's cookies must never ride on another client's requests.
            skip_auto_headers=("Accept-Encoding",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        self._pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    async def health_problem(self, url: str) -> str | None:
        """What is wrong with the engine at ``url`` now, judged by its ``/health`` (None: it
        answered 200 within the connect timeout). A real request, not a TCP connect: a process
        that is being killed can still complete a handshake from its listen backlog."""
        try:
            async with asyncio.timeout(self.connect_timeout):
                async with self.session.get(url + "/health") as resp:
                    await resp.read()
                    return None if resp.status == 200 else f"/health answered HTTP {resp.status}"
        except TimeoutError:
            return f"/health did not answer within {self.connect_timeout:g} s"
        except aiohttp.ClientError as exc:
            return f"/health failed: {exc or type(exc).__name__}"

    async def post(self, url: str, payload: bytes, headers: dict[str, str], deadline: float) -> Answer:
        """One buffered request; the deadline covers the whole answer."""
        resp: h1.Response | None = None
        try:
            resp = await self._pool.post(url, payload, headers, deadline)
            body = await resp.read()
            resp.release()
            return _checked(Answer(resp.status, body, resp.content_type))
        except h1.HTTPError as exc:  # first: the connect timeout is not the answer's deadline
            if resp is not None:
                resp.close()
            raise classify(exc) from None
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise LegError("timeout", f"no answer within {deadline:g} s") from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise

    async def open_stream(
        self, url: str, payload: bytes, headers: dict[str, str], deadline: float
    ) -> OpenStream:
        """Send a streaming request and wait for its first chunk; the deadline covers both."""
        resp: h1.Response | None = None
        try:
            resp = await self._pool.post(url, payload, headers, deadline)
            if resp.status >= 400:
                body = await resp.read()
                _checked(Answer(resp.status, body, resp.content_type))
            first = await resp.readany()
            resp.disarm()  # from here the relay's stream-idle deadline applies
            if not first:
                raise LegError("dropped", "the stream ended before its first byte")
            return OpenStream(resp, first)
        except BaseException as exc:
            if resp is not None:
                resp.close()  # closes the connection: the backend sees the cancel and frees its KV
            if isinstance(exc, h1.HTTPError):  # first: the connect timeout is a TimeoutError too
                raise classify(exc) from None
            if isinstance(exc, TimeoutError):
                raise LegError("timeout", f"no first byte within {deadline:g} s") from None
            raise


#: What a saturated engine answers (vLLM: 503 while it cannot take more, 429 from a rate limiter).
BUSY_STATUSES = frozenset({429, 503})


def _checked(answer: Answer) -> Answer:
    if answer.status in BUSY_STATUSES:
        raise LegError("busy", f"HTTP {answer.status} (busy): {_snippet(answer.body)}", status=answer.status)
    if answer.status >= 500:
        raise LegError("http_5xx", f"HTTP {answer.status}: {_snippet(answer.body)}", status=answer.status)
    if answer.status >= 400:
        # vLLM's refusal, passed back to the client in the router's vocabulary (one error type per status).
        raise BackendRefusal(answer.status, normalize_error_body(answer.body), answer.content_type)
    return answer


def classify(exc: h1.HTTPError) -> LegError:
    if isinstance(exc, h1.ConnectFailed):
        return LegError("connect_error", f"cannot connect: {exc}")
    return LegError("dropped", f"connection lost: {exc}")


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
