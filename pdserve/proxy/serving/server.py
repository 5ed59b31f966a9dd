"""Serving: uvicorn (default) or Hypercorn on uvloop, sized for bursts and multi-minute streams,
graceful on SIGTERM.

Quart's debug server listens with a backlog of 100 and reset part of a 512-connection burst
in vLLM's MoRIIO proxy; either server here listens with a deep backlog and queues them.
uvicorn runs with httptools (never h11): its HTTP parsing and framing cost well under
Hypercorn's per request, and on a shared machine CPU per request is what decides throughput.
Both get the same app, the same backlog, keep-alive and grace period, and no access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import uvicorn
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from pdserve.proxy.serving.generation import PUSH_BODY, GenerationApp
from pdserve.proxy.serving.worker_views import WorkerInfo
from pdserve.proxy.settings import ProxySettings
from pdserve.proxy.state.shared import SharedConnections, SharedState

log = logging.getLogger("pdserve.proxy")


@dataclass
class Lifecycle:
    """Set by the server on SIGTERM: /ready turns 503 at once, before connections stop."""

    stopping: bool = False


#: Builds the app a process serves (pdserve.proxy.app.create_app): the server knows how to serve,
#: not what.
AppFactory = Callable[[ProxySettings, Lifecycle, WorkerInfo | None], GenerationApp]


@dataclass(frozen=True)
class Serving:
    """What a server (one function per name in :data:`SERVERS`) serves, and until when."""

    app: GenerationApp
    settings: ProxySettings
    stop: asyncio.Event  # set: stop accepting, let in-flight requests finish (grace period)
    sockets: Sequence[socket.socket]  # a worker's own SO_REUSEPORT sockets; empty: bind binds(settings)
    shared: SharedState | None  # with worker processes


def hypercorn_config(settings: ProxySettings) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in binds(settings)]
    config.backlog = settings.listen.backlog
    config.keep_alive_timeout = settings.server.keep_alive_seconds  # idle client connections between requests
    config.graceful_timeout = settings.server.grace_seconds
    config.read_timeout = None
    config.accesslog = None  # one structured line per request comes from the dispatcher instead
    config.errorlog = logging.getLogger("hypercorn.error")  # through our handler, not a second one
    config.use_reloader = False
    return config


async def _serve_hypercorn(serving: Serving) -> None:
    """Hypercorn: connections stay where the kernel put them (no :class:`SharedConnections`)."""
    config = hypercorn_config(serving.settings)
    if serving.sockets:  # a worker's own SO_REUSEPORT sockets (pdserve.proxy.serving.workers)
        config.bind = [f"fd://{sock.fileno()}" for sock in serving.sockets]
    await hypercorn_serve(serving.app, config, shutdown_trigger=serving.stop.wait)  # type: ignore[arg-type]


class _HeadWithBody:
    """A client connection's transport, as uvicorn's protocol sees it: a response's head leaves
    in one send with the start of its body.

    uvicorn writes the status line and headers as soon as the app starts a response and the
    body in a second write: two sends, each a wake-up of a client that waits, where one would
    do. The proxy starts a response only when its first bytes are at hand, so the body's first
    write follows in the same loop step; the head is held until then (or until the step ends:
    a ``100 Continue``, or an app that starts a response and waits, is not delayed further).
    """

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.writelines((held, data))
        elif data.startswith(b"HTTP/1.1 "):
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)


class _HttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on :class:`_HeadWithBody`, offering :data:`PUSH_BODY`; with
    worker processes, counting this worker's connections and closing one, after its response,
    while the worker holds more than its share (:class:`SharedConnections`)."""

    worker_connections: SharedConnections | None = None  # set by protocol_class

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadWithBody(transport))  # type: ignore[arg-type]
        if self.worker_connections is not None:
            self.worker_connections.add(1)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.worker_connections is not None:
            self.worker_connections.add(-1)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # this request's (not an upgrade)
            extensions: dict[str, object] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[PUSH_BODY] = functools.partial(_push_body, cycle)
            counted = self.worker_connections
            if cycle.keep_alive and counted is not None and counted.over_share():
                cycle.keep_alive = False  # "Connection: close" on the response, then closed


def protocol_class(connections: SharedConnections | None) -> type[HttpToolsProtocol]:
    """The protocol uvicorn runs, counting its connections in ``connections`` (with workers)."""
    if connections is None:
        return _HttpToolsProtocol
    return type("_WorkerHttpToolsProtocol", (_HttpToolsProtocol,), {"worker_connections": connections})


def _push_body(cycle: RequestResponseCycle, chunk: bytes) -> bool:
    """Write ``chunk`` of a started chunked response now, framed as uvicorn's ``send`` frames it.

    A relayed stream's chunks arrive in the decode connection's callback; handing each to the
    serving task costs a future, a wake-up and an ASGI message per chunk, the largest share of
    the CPU per streamed chunk. False (nothing written) whenever ``send`` must decide: the
    response not started or not chunked, or complete, or the client gone or going, or slow
    (uvicorn's flow control then holds the task in ``send`` until the client catches up).
    """
    if (
        cycle.disconnected
        or cycle.flow.write_paused
        or cycle.transport.is_closing()
        or not cycle.chunked_encoding
        or not cycle.response_started
        or cycle.response_complete
    ):
        return False
    cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    return True


def uvicorn_config(
    app: GenerationApp, settings: ProxySettings, connections: SharedConnections | None = None
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.listen.host,
        port=settings.listen.port,
        http=protocol_class(connections),
        ws="none",
        loop="none",  # the caller's loop (uvloop) is the one served on
        lifespan="on",  # Quart's before_serving/after_serving start and stop the upstream client
        backlog=settings.listen.backlog,
        timeout_keep_alive=math.ceil(settings.server.keep_alive_seconds),
        # uvicorn's shutdown: stop accepting, close idle connections, let in-flight requests
        # finish within the grace period, then cancel them (Hypercorn's graceful_timeout).
        timeout_graceful_shutdown=math.ceil(settings.server.grace_seconds),
        access_log=False,
        log_config=None,  # our logging.basicConfig, not uvicorn's handlers
        proxy_headers=False,
        server_header=False,
    )


class _UvicornServer(uvicorn.Server):
    """Signals stay ours: uvicorn's own handlers would re-raise SIGTERM after a clean shutdown
    (exit status -15 instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def binds(settings: ProxySettings) -> list[tuple[str, int]]:
    """The client address and port, then the admin ones when there is an admin port (ports.py
    decides what each serves)."""
    binds = [(settings.listen.host, settings.listen.port)]
    if settings.listen.admin_port is not None:
        binds.append((settings.listen.admin_host or settings.listen.host, settings.listen.admin_port))
    return binds


def listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket; with ``reuse_port`` one of several on the same address, among which
    the kernel spreads new connections (SO_REUSEPORT: one per worker)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


async def _serve_uvicorn(serving: Serving) -> None:
    settings, shared = serving.settings, serving.shared
    server = _UvicornServer(uvicorn_config(serving.app, settings, shared.connections if shared else None))
    # One server on every port (one lifespan, one app); uvicorn binds a single host:port itself.
    sockets = list(serving.sockets) or [
        listen(host, port, settings.listen.backlog) for host, port in binds(settings)
    ]

    async def relay_stop() -> None:
        await serving.stop.wait()
        server.should_exit = True

    relay = asyncio.create_task(relay_stop())
    try:
        await server.serve(sockets=sockets)
    finally:
        relay.cancel()
        for sock in sockets:
            sock.close()


Serve = Callable[[Serving], Awaitable[None]]
SERVERS: dict[str, Serve] = {
    "hypercorn": _serve_hypercorn,
    "uvicorn": _serve_uvicorn,
}


async def serve_until_signalled(
    settings: ProxySettings,
    build: AppFactory,
    sockets: Sequence[socket.socket] = (),
    worker: WorkerInfo | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; then /ready turns 503 at once, connections are still accepted
    for ``shutdown_delay_seconds``, then the server stops accepting and in-flight requests get
    ``grace_seconds`` to finish. A second signal skips what is left of the delay."""
    serve = SERVERS[settings.server.http_server]
    lifecycle = Lifecycle()
    app = build(settings, lifecycle, worker)
    # What exists now (the modules, the app) lives as long as the process: a full collection
    # need not walk it again (a pause in the middle of requests, each time). Requests' objects
    # are still collected as before.
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    delayed: list[asyncio.TimerHandle] = []

    def signalled(sig: signal.Signals) -> None:
        if lifecycle.stopping:
            stop.set()
            return
        lifecycle.stopping = True
        log.info(
            "%s: not ready from now on; stop accepting in %g s, then let in-flight requests finish "
            "for up to %g s",
            sig.name,
            settings.server.shutdown_delay_seconds,
            settings.server.grace_seconds,
        )
        if settings.server.shutdown_delay_seconds > 0:
            delayed.append(loop.call_later(settings.server.shutdown_delay_seconds, stop.set))
        else:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled, sig)
    log.info(
        "pdserve proxy listening on %s:%d%s (http server %s, policy=%s, backlog=%d, routing table from %s)",
        settings.listen.host,
        settings.listen.port,
        f", admin port {settings.listen.admin_host or settings.listen.host}:{settings.listen.admin_port}"
        if settings.listen.admin_port is not None
        else "",
        settings.server.http_server,
        settings.policy,
        settings.listen.backlog,
        settings.table.source,
    )
    try:
        await serve(Serving(app, settings, stop, sockets, worker.shared if worker else None))
    finally:
        for handle in delayed:
            handle.cancel()
    log.info("pdserve proxy stopped")


def run_server(
    settings: ProxySettings,
    build: AppFactory,
    sockets: Sequence[socket.socket] = (),
    worker: WorkerInfo | None = None,
) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        asyncio.run(serve_until_signalled(settings, build, sockets, worker))
        return
    uvloop.run(serve_until_signalled(settings, build, sockets, worker))
