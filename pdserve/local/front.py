"""The user's entry point of `pdserve up` with ``placement: decode-sidecar``.

In a cluster the client Service selects the decode pods, so a request reaches one decode pod's
sidecar router, which runs the whole P/D flow (``pdserve proxy --local-decode``). Locally this
front stands in for that Service, and for nothing more: it takes every request on the user's
port and passes it unchanged to the next Ready sidecar in turn (round robin per request, so a
steady client gives every sidecar equal traffic), streams the answer back as it comes, and adds
``X-PDServe-Sidecar: <decode instance>`` saying which sidecar served it. It knows nothing of
prefill, decode or slots; retries, deadlines and errors are the sidecar's.

Its own paths:

* ``/health``: 200 while it runs;
* ``/ready``: 200 while at least one sidecar is Ready (a Service with endpoints), with every
  sidecar's state;
* ``/debug/routing``: every sidecar's ``/debug/routing`` merged (:func:`merge_debug`) for the
  live view and the demo: prefill slots summed over the sidecars (each walks every prefill),
  decode slots each sidecar's own, plus a ``sidecars`` list.

Which sidecars are Ready is the runner's to say (:meth:`Front.set_ready`): it polls their
``/ready`` as the kubelet would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.wire.headers import ERROR_REASON, SIDECAR
from pdserve.wire.openai import error_body

#: Never copied between the client and a sidecar (they describe one connection, not the message).
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "proxy-connection"}
)
#: Counters of one slot that add up across sidecars.
SUMMED = ("requests", "in_flight", "errors", "ejections", "pinned")
DEBUG_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SidecarEndpoint:
    instance: str  # the decode instance (pod name) the sidecar runs next to
    url: str


class Front:
    """Round robin over the Ready sidecars, on ``host:port``."""

    def __init__(self, sidecars: Sequence[SidecarEndpoint], host: str, port: int) -> None:
        self.sidecars = tuple(sidecars)
        self.host = host
        self.port = port
        self.ready: frozenset[str] = frozenset()
        self.served: dict[str, int] = {s.instance: 0 for s in self.sidecars}
        self._next = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    def set_ready(self, instances: Sequence[str]) -> None:
        self.ready = frozenset(instances)

    def pick(self) -> SidecarEndpoint | None:
        """The next Ready sidecar in turn (None when none is Ready)."""
        ready = [s for s in self.sidecars if s.instance in self.ready]
        if not ready:
            return None
        chosen = ready[self._next % len(ready)]
        self._next += 1
        return chosen

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/debug/routing", self._debug)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, backlog=4096).start()

    async def stop(self) -> None:
        """Stop taking requests; what is in flight is cut (the sidecars are stopped next anyway)."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # --- handlers --------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        states = {s.instance: s.instance in self.ready for s in self.sidecars}
        ok = any(states.values())
        return web.json_response({"ready": ok, "sidecars": states}, status=200 if ok else 503)

    async def _debug(self, request: web.Request) -> web.Response:
        docs = await asyncio.gather(*(self._sidecar_debug(s) for s in self.sidecars))
        merged = merge_debug(list(zip(self.sidecars, docs, strict=True)), self.ready, self.served)
        return web.json_response(merged)

    async def _sidecar_debug(self, sidecar: SidecarEndpoint) -> dict[str, Any] | None:
        assert self._session is not None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with asyncio.timeout(DEBUG_TIMEOUT_S):
                async with self._session.get(sidecar.url + "/debug/routing") as resp:
                    if resp.status == 200:
                        data = json.loads(await resp.read())
                        return data if isinstance(data, dict) else None
        return None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        sidecar = self.pick()
        if sidecar is None:
            return _error(503, "no sidecar router is ready", "no_ready_sidecar")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        try:
            async with self._session.request(
                request.method, sidecar.url + request.rel_url.raw_path_qs, headers=headers, data=body
            ) as upstream:
                self.served[sidecar.instance] += 1
                out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        out.headers.add(name, value)
                out.headers[SIDECAR] = sidecar.instance
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientConnectionError as exc:
            if request.transport is None or request.transport.is_closing():
                raise  # the client left; nothing to answer
            return _error(502, f"sidecar of {sidecar.instance} failed: {exc}", "sidecar_unreachable")


def _error(status: int, message: str, reason: str) -> web.Response:
    response = web.json_response(error_body(status, message), status=status)
    response.headers[ERROR_REASON] = reason
    return response


def merge_debug(
    docs: Sequence[tuple[SidecarEndpoint, Mapping[str, Any] | None]],
    ready: frozenset[str] | set[str] = frozenset(),
    served: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """One ``/debug/routing`` document for every sidecar: the table and policy of the first that
    answered, the lowest generation among them, prefill slots summed in the first sidecar's
    order (instance index 0 starts at offset 0: the flat order), decode slots each sidecar's own
    in sidecar order, and per sidecar its state and requests (``sent``: by the front)."""
    answered = [doc for _, doc in docs if doc is not None]
    first: Mapping[str, Any] = answered[0] if answered else {}
    generations = [doc.get("generation") for doc in answered]
    generation = None if not generations or None in generations else min(int(g) for g in generations if g)
    prefill: dict[str, dict[str, Any]] = {}
    decode: list[dict[str, Any]] = []
    sidecars: list[dict[str, Any]] = []
    requests: dict[str, int] = {}  # client requests by outcome: every request went to one sidecar
    for sidecar, doc in docs:
        for outcome, n in ((doc or {}).get("requests") or {}).items():
            requests[outcome] = requests.get(outcome, 0) + int(n)
        slots = (doc or {}).get("slots") or {}
        for row in slots.get("prefill", []):
            merged = prefill.setdefault(str(row["slot"]), {**row, **{k: 0 for k in SUMMED if k in row}})
            for key in SUMMED:
                if key in row:
                    merged[key] += int(row[key])
        mine = list(slots.get("decode", []))
        decode += mine
        sidecars.append(
            {
                "instance": sidecar.instance,
                "url": sidecar.url,
                "ready": sidecar.instance in ready,
                "answered": doc is not None,
                "generation": None if doc is None else doc.get("generation"),
                "requests": sum(int(r.get("requests", 0)) for r in mine),
                "sent": (served or {}).get(sidecar.instance, 0),
            }
        )
    return {
        "placement": "decode-sidecar",
        "source": first.get("source"),
        "policy": first.get("policy"),
        "prefill_policy": first.get("prefill_policy"),
        "last_reload_error": next(
            (d["last_reload_error"] for d in answered if d.get("last_reload_error")), None
        ),
        "generation": generation,
        "table": first.get("table"),
        "requests": requests,
        "slots": {"prefill": list(prefill.values()), "decode": decode},
        "sidecars": sidecars,
    }
