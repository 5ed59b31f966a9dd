"""The autoscaler's signals, fetched: every Ready router's ``GET /load`` and every routable
engine's ``/metrics``, all at once (pdserve.deployment.plan.signals says why these two, read by
the operator, and reads the answers).

A router or an engine that does not answer within its timeout is left out and named in the
signals' problems; with no router answering, the decision holds the counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdserve.deployment.plan.signals import RouterLoad, Signals, combine, read_signals
from pdserve.deployment.render.router import router_pod_selector
from pdserve.deployment.spec.pddeployment import ENGINE_PORT, PDDeployment
from pdserve.operator.cluster.kube import Kube, KubeError
from pdserve.operator.cluster.views import PodView
from pdserve.operator.dataplane.routers import base_urls, ready_router_addresses, session_get

#: Per request: a router or an engine on the pod network answers in milliseconds.
TIMEOUT = 1.0


@dataclass(frozen=True)
class Engine:
    instance: str
    role: str
    url: str  # one API server: its /metrics covers the DP ranks it serves


def engine_targets(units: Sequence[PodView]) -> list[Engine]:
    """The API servers of the routable instances (each node's, for a group that serves per node)."""
    out = []
    for unit in units:
        if not unit.observed.routable or not unit.ip:
            continue
        name, role = unit.observed.name, unit.role.value
        if unit.endpoints:
            out += [Engine(name, role, f"http://{_host(e.ip)}:{e.port}") for e in unit.endpoints]
        else:
            out.append(Engine(name, role, f"http://{_host(unit.ip)}:{ENGINE_PORT}"))
    return out


def gather(kube: Kube, pdd: PDDeployment, units: Sequence[PodView], window: float) -> Signals:
    """The signals of the last ``window`` seconds (blocking: runs in a reconcile thread)."""
    try:
        pods = kube.list_objects("Pod", pdd.namespace, router_pod_selector(pdd))
    except KubeError as exc:
        return combine(window, [RouterLoad("router pods", error=f"cannot list them: {exc}")], [])
    routers = base_urls(ready_router_addresses(pods), pdd.spec.router.admin_port)
    engines = [(e.instance, e.role, e.url) for e in engine_targets(units)]
    return asyncio.run(_read(pdd.name, routers, engines, window))


async def _read(
    deployment: str,
    routers: Sequence[tuple[str, str]],
    engines: Sequence[tuple[str, str, str]],
    window: float,
) -> Signals:
    async with aiohttp.ClientSession() as session:
        return await read_signals(session_get(session, TIMEOUT), deployment, routers, engines, window)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
