"""The simulator's stand-in for a KV connector's word from decode to prefill: "I have the KV of
your request R" (NIXL's notification, Mooncake's transfer request). A prefill simulator with an
engine listens on its side-channel address (``--kv-host``/``--kv-port``: where its connector's
peer reaches it, pdserve.kv); a decode simulator tells it once its pull is done, at the address
its kv_transfer_params name (the connector's ``Simulate.pull_notice``), and the prefill frees
the blocks it held for that request (until then they count against its KV pool; without the
notice they go when the lease ends, as in vLLM).

One small HTTP endpoint, ``POST /pdserve-sim/pulled`` with ``{"remote_engine_id",
"remote_request_id"}``; answers ``{"released": bool}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
from aiohttp import web

from pdserve.kv.base import PullNotice

PATH = "/pdserve-sim/pulled"


class PullNotices:
    """Both ends: the prefill's listener and the decode's sender."""

    def __init__(self, release: Callable[[str, str], bool]) -> None:
        self._release = release  # (remote_engine_id, remote_request_id) -> released?
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.received = 0
        self.sent = 0
        self.failed = 0

    async def listen(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_post(PATH, self._receive)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_address=True).start()

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _receive(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            released = self._release(str(body["remote_engine_id"]), str(body["remote_request_id"]))
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected remote_engine_id and remote_request_id"}, status=400)
        self.received += 1
        return web.json_response({"released": released})

    def send(self, notice: PullNotice) -> None:
        """Tell the prefill a decode leg's kv_transfer_params named (in the background)."""
        task = asyncio.get_running_loop().create_task(self._send(notice.url.rstrip("/") + PATH, notice))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, url: str, notice: PullNotice) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        body = {"remote_engine_id": notice.engine_id, "remote_request_id": notice.key}
        try:
            async with self._session.post(url, json=body) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            ok = False
        if ok:
            self.sent += 1
        else:
            self.failed += 1  # a prefill that is not a simulator with an engine: its lease ends
