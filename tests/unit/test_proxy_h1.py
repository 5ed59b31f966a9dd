"""The legs' HTTP/1.1 client (pdserve.proxy.engine.h1) against real servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from pdserve.proxy.engine import h1


def test_origin_parse_keeps_port_path_and_query() -> None:
    o = h1.Origin.parse("http://127.0.0.1:8100/v1/completions?x=1")
    assert (o.host, o.port, o.tls, o.path, o.host_header) == (
        "127.0.0.1",
        8100,
        False,
        b"/v1/completions?x=1",
        b"127.0.0.1:8100",
    )
    assert h1.Origin.parse("https://engine/v1/chat/completions").host_header == b"engine"
    assert h1.Origin.parse("http://[::1]:9000/v1").host_header == b"[::1]:9000"
    with pytest.raises(ValueError, match="not an http"):
        h1.Origin.parse("ftp://engine/x")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def _engine(path: str, handler: Handler) -> AsyncIterator[tuple[str, h1.Pool]]:
    """``handler`` answering POST ``path`` on loopback, and a pool of the legs' client: the URL
    and the pool; the pool's connections are closed, then the server."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = h1.Pool(connect_timeout=2, keepalive=30)
    try:
        yield f"http://127.0.0.1:{port}{path}", pool
    finally:
        pool.close()
        await runner.cleanup()


def test_keep_alive_reuses_one_connection_and_reads_bodies() -> None:
    peers: list[object] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        body = await request.read()
        if request.headers.get("X-Stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for part in (b"data: 1\n\n", b"data: 2\n\n"):
                await resp.write(part)
            await resp.write_eof()
            return resp
        return web.Response(body=body, content_type="application/json")

    async def run() -> None:
        async with _engine("/v1/completions", echo) as (url, pool):
            for n in range(3):
                resp = await pool.post(url, b'{"n": %d}' % n, {"X-Request-Id": "r"})
                assert (resp.status, resp.content_type) == (200, "application/json")
                assert await resp.read() == b'{"n": %d}' % n
                resp.release()
            resp = await pool.post(url, b"{}", {"X-Stream": "1"})
            assert resp.content_type == "text/event-stream"
            assert await resp.read() == b"data: 1\n\ndata: 2\n\n"  # chunked framing removed
            resp.release()
        assert len(peers) == 4 and len(set(peers)) == 1  # one connection for all four

    asyncio.run(run())


def test_closed_answer_is_not_reused_and_refused_connect_is_connect_failed() -> None:
    peers: list[object] = []

    async def slow(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"first")
        await asyncio.sleep(5)
        return resp

    async def run() -> None:
        async with _engine("/s", slow) as (url, pool):
            for _ in range(2):
                resp = await pool.post(url, b"", {})
                assert await resp.readany() == b"first"
                resp.close()  # mid-answer: the connection goes, the next request opens another
        assert len(set(peers)) == 2
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(h1.ConnectFailed):
            await h1.Pool(connect_timeout=2, keepalive=30).post(f"http://127.0.0.1:{port}/x", b"", {})

    asyncio.run(run())


def test_server_that_breaks_mid_answer_is_disconnected() -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"part")
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def run() -> None:
        async with _engine("/b", broken) as (url, pool):
            resp = await pool.post(url, b"", {})
            with pytest.raises(h1.Disconnected):
                await resp.read()
            resp.close()

    asyncio.run(run())


def test_deadline_fails_a_late_answer_and_a_lingering_release_reuses_the_connection() -> None:
    peers: list[object] = []
    tail_sent = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        await request.read()
        if request.headers.get("X-Late"):
            await asyncio.sleep(1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        if request.headers.get("X-Never-Ends"):
            await asyncio.sleep(1)
            return resp
        await asyncio.sleep(0.2)  # the end of body comes well after the last event, as vLLM's may
        await resp.write_eof()
        tail_sent.set()
        return resp

    async def run() -> None:
        async with _engine("/v1/completions", handler) as (url, pool):
            with pytest.raises(h1.DeadlineExceeded):
                await pool.post(url, b"{}", {"X-Late": "1"}, deadline=0.3)
            resp = await pool.post(url, b"{}", {}, deadline=5)
            assert await resp.readany() == b"data: [DONE]\n\n"
            resp.release(linger=5)  # its end is not in yet: the connection waits for it
            await asyncio.wait_for(tail_sent.wait(), 5)
            await asyncio.sleep(0.05)
            resp = await pool.post(url, b"{}", {})
            assert await resp.read() == b"data: [DONE]\n\n"
            resp.release()
            lingering = await pool.post(url, b"{}", {"X-Never-Ends": "1"})
            assert await lingering.readany() == b"data: [DONE]\n\n"
            lingering.release(linger=0.3)  # no end within 0.3 s: the connection is closed
            await asyncio.sleep(0.5)
            resp = await pool.post(url, b"{}", {})
            resp.close()
        # The late answer's connection was closed (a new one for the next); the linger kept the
        # second connection for the third and fourth requests; the fourth never ended within its
        # linger, so its connection was closed and the last request needed a new one.
        assert len(peers) == 5
        assert peers[1] == peers[2] == peers[3] and len({peers[0], peers[1], peers[4]}) == 3

    asyncio.run(run())


def test_a_sink_takes_only_what_arrives_while_the_reader_waits_with_nothing_buffered() -> None:
    """The order of a relayed stream rests on this: a chunk goes to the sink only when every
    earlier chunk has been read; a chunk the sink refuses goes to the reader."""
    release: list[asyncio.Event] = []
    parts = (b"data: a\n\n", b"data: b\n\n", b"data: c\n\n")
    taken: list[bytes] = []
    refusing = [False]

    def sink(chunk: bytes) -> bool:
        taken.append(chunk)
        return not refusing[0]

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part, go in zip(parts, release, strict=False):
            await go.wait()
            await resp.write(part)
        await release[-1].wait()
        await resp.write_eof()
        return resp

    async def run() -> None:
        release.extend(asyncio.Event() for _ in range(len(parts) + 1))  # the parts, then the end
        async with _engine("/v1/completions", handler) as (url, pool):
            resp = await pool.post(url, b"{}", {})
            resp.sink = sink
            release[0].set()  # arrives while nobody reads: buffered for the reader
            await asyncio.sleep(0.2)
            assert taken == []
            assert await resp.readany() == parts[0]
            reading = asyncio.ensure_future(resp.readany())
            await asyncio.sleep(0.05)
            release[1].set()  # arrives while the reader waits with nothing buffered: the sink's
            await asyncio.sleep(0.2)
            assert taken == [parts[1]] and not reading.done()
            refusing[0] = True
            release[2].set()  # offered to the sink, refused: the reader gets it
            assert await asyncio.wait_for(reading, 2) == parts[2]
            assert taken == [parts[1], parts[2]]
            release[3].set()
            assert await resp.readany() == b""  # the end still reaches the reader
            resp.release()

    asyncio.run(run())
