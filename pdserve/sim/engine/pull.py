"""The simulator's stand-in for NIXL's notification from decode to prefill: "I pulled the KV of
your request R". A prefill simulator with an engine listens on its side-channel address (the
``remote_host``/``remote_port`` its kv_transfer_params advertise, as NIXL's side channel does);
a decode simulator tells it once its pull is done, and the prefill frees the blocks it held for
that request (until then they count against its KV pool; without the notice they go when the
lease ends, as in vLLM).

One small HTTP endpoint, ``POST /pdserve-sim/pulled`` with ``{"remote_engine_id",
"remote_request_id"}``; answers ``{"released": bool}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

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

    def send(self, params: Mapping[str, Any]) -> None:
        """Tell the prefill named by a decode leg's kv_transfer_params (in the background)."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            return
        task = asyncio.get_running_loop().create_task(self._send(f"http://{host}:{port}{PATH}", params))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, url: str, params: Mapping[str, Any]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        body = {
            "remote_engine_id": params.get("remote_engine_id"),
            "remote_request_id": params.get("remote_request_id"),
        }
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
