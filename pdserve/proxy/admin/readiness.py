"""Decode-sidecar mode (``pdserve proxy --local-decode URL``): the router inside a decode pod.

The slots come from :func:`pdserve.routing.sidecar.build_sidecar_slot_table` (every prefill of
the local engine's revision, rotated to this sidecar's offset; the decode leg always on the
local engine, its DP ranks walked here). The dispatcher, connectors, retries, deadlines and
metrics are the standalone router's: with one decode instance, a retry after a failed prefill
goes to another prefill, a decode that fails is retried on another local rank after a new
prefill, and a local engine that refuses connections gets 503 before any prefill is spent.

Readiness (``/ready``) is what keeps a Service from sending requests this pod cannot serve:
503 while the local engine's ``/health`` does not answer 200, while the served table has no
routable prefill of the local revision, and from the moment the operator marks this pod
``draining`` in the table (the Service then stops sending to it; what is in flight finishes,
and the operator deletes the pod once it is unready and this sidecar reports it idle).
"""

from __future__ import annotations

import asyncio

import aiohttp

from pdserve.proxy.table.served import ServedTable
from pdserve.routing.sidecar import LocalDecode, draining_self

#: The local engine must answer its /health within this (a kubelet probe's own timeout is longer).
LOCAL_HEALTH_TIMEOUT_S = 1.0


def sidecar_not_ready_reason(served: ServedTable, local: LocalDecode) -> str | None:
    """Why this sidecar must not take new requests, judged from its table alone (None: it may)."""
    state = served.current
    causes = [c for c in (served.problem, served.rejected) if c]
    if state is None:
        return "; ".join([f"no routing table loaded yet from {served.source}", *causes])
    table = state.slots.table
    if draining_self(table, local):
        return (
            f"this decode pod ({local.name}) is draining in generation {state.generation}: finishing "
            "in-flight requests, taking no new ones"
        )
    if not state.slots.prefill:
        revision = f"revision {local.revision!r}" if local.revision else "the unversioned revision"
        routable = [i for i in table.prefill if i.routable]
        head = (
            f"generation {state.generation} has no routable prefill instance"
            if not routable
            else f"generation {state.generation} has no routable prefill of the local engine's {revision} "
            f"(routable prefills are of {sorted({i.revision for i in routable})})"
        )
        return "; ".join([head, *causes])
    return None


async def local_engine_problem(
    session: aiohttp.ClientSession, local: LocalDecode, timeout: float = LOCAL_HEALTH_TIMEOUT_S
) -> str | None:
    """None when the local engine's ``/health`` answers 200, else what went wrong."""
    url = f"{local.url.rstrip('/')}/health"
    try:
        async with asyncio.timeout(timeout):
            async with session.get(url) as resp:
                await resp.read()
                if resp.status == 200:
                    return None
                return f"local engine {url} answered {resp.status}"
    except TimeoutError:
        return f"local engine {url} did not answer within {timeout:g} s"
    except aiohttp.ClientError as exc:
        return f"local engine {url} unreachable: {type(exc).__name__} {exc}".rstrip()
