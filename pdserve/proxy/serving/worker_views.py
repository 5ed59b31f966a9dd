"""Admin answers for the whole router when it runs as several worker processes.

The kernel hands a connection to any worker (SO_REUSEPORT), and each worker only knows its own
requests. So every worker also listens on a Unix socket of its own in the router's run
directory, where it answers one word (``served``, ``debug``) with its local view as JSON; the
worker that took an admin request asks every other worker and merges the views
(pdserve.proxy.admin.merge). Only admin requests take this path, never a generation request.

A worker that does not answer within :data:`VIEWS_TIMEOUT_S` fails the admin request (503):
``/routing/served`` decides drains, and a partial count of in-flight requests must never look
like an idle instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.proxy.state.shared import SharedState

log = logging.getLogger("pdserve.proxy.workers")

VIEWS_TIMEOUT_S = 5.0
MAX_VIEW_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class WorkerInfo:
    """This process as one of ``count`` workers of the router: which one, where the workers'
    sockets live, and the memory they share (pdserve.proxy.state.shared)."""

    index: int
    count: int
    rundir: Path
    shared: SharedState = field(repr=False, compare=False)

    def socket_path(self, index: int) -> Path:
        return self.rundir / f"worker-{index}.sock"


class WorkerViewsError(Exception):
    """A worker did not answer for its share of an admin view."""


Views = dict[str, Callable[[], dict[str, Any]]]


async def serve_views(worker: WorkerInfo, views: Views) -> asyncio.AbstractServer:
    """Answer ``<name>\\n`` with the JSON of ``views[name]()`` on this worker's socket."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            name = (await reader.readline()).decode().strip()
            view = views.get(name)
            payload = {"worker": worker.index, "view": view() if view else None}
            writer.write(json.dumps(payload).encode())
            await writer.drain()
        except Exception:  # an admin view must never take the worker down
            log.exception("worker %d: answering %r for another worker failed", worker.index, name)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    path = worker.socket_path(worker.index)
    path.unlink(missing_ok=True)
    return await asyncio.start_unix_server(answer, path=str(path), limit=MAX_VIEW_BYTES)


async def _ask(path: Path, name: str) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_VIEW_BYTES)
    try:
        writer.write(name.encode() + b"\n")
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    payload = json.loads(raw)
    view = payload.get("view") if isinstance(payload, dict) else None
    if not isinstance(view, dict):
        raise WorkerViewsError(f"worker answered no {name} view")
    return view


async def gather_views(
    worker: WorkerInfo, name: str, local: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every worker's ``name`` view, this one's first; WorkerViewsError if one does not answer."""
    others = [i for i in range(worker.count) if i != worker.index]
    own = local()

    async def one(i: int) -> dict[str, Any]:
        try:
            async with asyncio.timeout(VIEWS_TIMEOUT_S):
                return await _ask(worker.socket_path(i), name)
        except (OSError, TimeoutError, ValueError, WorkerViewsError) as exc:
            raise WorkerViewsError(
                f"worker {i} did not answer for {name}: {exc or type(exc).__name__}"
            ) from None

    return [own, *await asyncio.gather(*(one(i) for i in others))]
