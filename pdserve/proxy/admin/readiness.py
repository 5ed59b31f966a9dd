"""Readiness (``/ready``): whether this router may take new requests, and why not.

Readiness is what keeps a Service from sending requests the router cannot serve. A standalone
router is ready while it serves a table with a routable prefill and decode, until SIGTERM.

In decode-sidecar mode (``pdserve proxy --local-decode URL``) the router runs inside a decode
pod (its slots: :func:`pdserve.routing.sidecar.build_sidecar_slot_table`; the dispatcher,
retries and deadlines are the standalone router's). It is not ready while the local engine's
``/health`` does not answer 200, while the served table has no routable prefill of the local
revision, and from the moment the operator marks this pod ``draining`` in the table (the
Service then stops sending to it; what is in flight finishes, and the operator deletes the pod
once it is unready and this sidecar reports it idle).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

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


async def readiness(
    served: ServedTable,
    local: LocalDecode | None,
    session: aiohttp.ClientSession,
    stopping: Callable[[], bool],
) -> tuple[dict[str, Any], int]:
    """The ``/ready`` answer: its body and status (200 ready, 503 with the reason)."""
    state = served.current
    if local is None:
        reason = served.not_ready_reason()
    else:  # decode sidecar: its own engine, and a prefill of its revision
        reason = sidecar_not_ready_reason(served, local)
        if reason is None:
            reason = await local_engine_problem(session, local)
    if stopping():
        reason = "shutting down (SIGTERM): finishing in-flight requests, taking no new ones"
    payload: dict[str, Any] = {
        "ready": reason is None,
        "generation": state.generation if state else None,
        "prefill_slots": len(state.slots.prefill) if state else 0,
        "decode_slots": len(state.slots.decode) if state else 0,
    }
    if local is not None:
        payload["local_decode"] = local.url
    if reason is not None:
        payload["reason"] = reason
    return payload, 200 if reason is None else 503
