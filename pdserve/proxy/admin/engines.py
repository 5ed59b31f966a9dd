"""What the admin endpoints ask of the engines: the model list, and the profiler broadcast.

Neither is on the hot path: both go through the aiohttp session of pdserve.proxy.engine.upstream,
each request bounded by :data:`ADMIN_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from pdserve.routing import Instance, RoutingTable, Slot
from pdserve.wire.headers import AUTHORIZATION

log = logging.getLogger("pdserve.proxy")

ADMIN_TIMEOUT_S = 10.0


def admin_headers(backend_api_key: str | None, client_auth: str | None) -> dict[str, str]:
    """The engines' key when the router has one, else the client's Authorization header."""
    if backend_api_key:
        return {AUTHORIZATION: f"Bearer {backend_api_key}"}
    return {AUTHORIZATION: client_auth} if client_auth else {}


async def model_list(
    session: aiohttp.ClientSession, decodes: Sequence[Slot], headers: dict[str, str]
) -> tuple[bytes, str] | None:
    """The first decode instance's ``/v1/models`` answer (body, content type); None if none answers."""
    for inst in _instances(decodes):
        try:
            async with asyncio.timeout(ADMIN_TIMEOUT_S):
                async with session.get(inst.url + "/v1/models", headers=headers) as resp:
                    body = await resp.read()
                    if resp.status == 200:
                        return body, resp.content_type or "application/json"
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("GET /v1/models from %s failed: %s", inst.name, exc)
    return None


async def broadcast(
    session: aiohttp.ClientSession, table: RoutingTable | None, path: str, headers: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], bool]:
    """POST ``path`` to every API server of the table (one per instance, one per node of a
    multi-node instance: ``name/nodeN``); each server's answer, and whether all answered 200."""
    instances = [*table.prefill, *table.decode] if table else []

    async def one(name: str, url: str) -> tuple[str, dict[str, Any]]:
        try:
            async with asyncio.timeout(ADMIN_TIMEOUT_S):
                async with session.post(url + path, headers=headers) as resp:
                    await resp.read()
                    return name, {"status": resp.status}
        except (TimeoutError, aiohttp.ClientError) as exc:
            return name, {"error": str(exc) or type(exc).__name__}

    targets = [
        (inst.name if len(inst.api_urls()) == 1 else f"{inst.name}/node{n}", url)
        for inst in instances
        for n, url in enumerate(inst.api_urls())
    ]
    results = dict(await asyncio.gather(*(one(name, url) for name, url in targets)))
    ok = bool(results) and all(r.get("status") == 200 for r in results.values())
    return results, ok


def _instances(slots: Sequence[Slot]) -> list[Instance]:
    seen: dict[str, Instance] = {}
    for slot in slots:
        seen.setdefault(slot.instance.name, slot.instance)
    return list(seen.values())
