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

from pdserve.deployment.plan.signals import (
    EngineLoad,
    RouterLoad,
    Signals,
    combine,
    parse_engine_metrics,
    parse_load,
)
from pdserve.deployment.render.objects import router_pod_selector
from pdserve.deployment.spec.pddeployment import ENGINE_PORT, PDDeployment
from pdserve.operator.kube import Kube, KubeError
from pdserve.operator.routers import ready_router_addresses
from pdserve.operator.views import PodView

#: Per request: a router or an engine on the pod network answers in milliseconds.
ROUTER_TIMEOUT = 0.5
ENGINE_TIMEOUT = 1.0


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
    routers = ready_router_addresses(pods)
    engines = engine_targets(units)
    port = pdd.spec.router.admin_port
    loads, metrics = asyncio.run(_fetch_all(routers, port, engines, pdd.name, window))
    return combine(window, loads, metrics)


async def _fetch_all(
    routers: Sequence[tuple[str, str]], port: int, engines: Sequence[Engine], deployment: str, window: float
) -> tuple[list[RouterLoad], list[EngineLoad]]:
    async with aiohttp.ClientSession() as session:
        loads = [_load(session, name, ip, port, deployment, window) for name, ip in routers]
        metrics = [_metrics(session, engine) for engine in engines]
        answers = await asyncio.gather(*loads, *metrics)
    return list(answers[: len(loads)]), list(answers[len(loads) :])  # type: ignore[arg-type]


async def _load(
    session: aiohttp.ClientSession, name: str, ip: str, port: int, deployment: str, window: float
) -> RouterLoad:
    url = f"http://{_host(ip)}:{port}/load?window={window:g}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=ROUTER_TIMEOUT)) as response:
            if response.status != 200:
                return RouterLoad(name, error=f"{url} answered {response.status}")
            doc = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return RouterLoad(name, error=f"{url} unreachable: {type(exc).__name__} {exc}".rstrip())
    return parse_load(name, doc, deployment)


async def _metrics(session: aiohttp.ClientSession, engine: Engine) -> EngineLoad:
    url = f"{engine.url}/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=ENGINE_TIMEOUT)) as response:
            if response.status != 200:
                return EngineLoad(engine.instance, engine.role, error=f"{url} answered {response.status}")
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
        return EngineLoad(engine.instance, engine.role, error=f"{url} unreachable: {type(exc).__name__}")
    return parse_engine_metrics(engine.instance, engine.role, text)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
