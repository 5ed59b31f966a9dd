"""The operator asks its router pods what they serve, and lets drains end on their answer.

Each Ready router pod of a deployment is asked ``GET http://<pod IP>:<adminPort>/routing/served``
(all at once, :data:`FETCH_TIMEOUT` each); the answers go into the pure
:func:`pdserve.deployment.plan.drain.drain_verdict` for every draining pod and into the status
(``servedGeneration``, ``routers``). The routers are asked only when it matters: while a pod
drains, on a full pass, and about every second (:data:`POLL_SECONDS`) while a router that
answers is behind the table just written. A router that does not answer only keeps a drain
waiting until ``drainSeconds``; it is not asked again early for the status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from pdserve.deployment.plan.drain import (
    DrainVerdict,
    RouterReport,
    RoutersSummary,
    drain_verdict,
    read_served,
    summarize,
)
from pdserve.deployment.plan.fetch import Get, GetError
from pdserve.deployment.render.router import router_pod_selector
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.operator import metrics
from pdserve.operator.cluster.kube import Kube, KubeError
from pdserve.operator.dataplane.memory import PerDeployment
from pdserve.routing.table import RoutingTable

log = logging.getLogger("pdserve.operator")

#: Seconds between passes while a drain waits for the routers (or a router catches up).
POLL_SECONDS = 1.0
#: Per router and request; a router on the pod network answers in milliseconds.
FETCH_TIMEOUT = 0.5


@dataclass(frozen=True)
class Draining:
    """One draining pod as the verdict needs it."""

    name: str
    since: float


@dataclass
class _State:
    reports: list[RouterReport] | None = None  # the last answers (None: never asked)
    left: dict[str, int] = field(default_factory=dict)  # pod -> first generation written without it
    due: bool = False  # ask on the next pass even without a drain


class Routers(PerDeployment[_State]):
    """Per-deployment memory of what the routers said; the fetches are the only I/O."""

    def __init__(self, kube: Kube, timeout: float = FETCH_TIMEOUT) -> None:
        super().__init__(kube)
        self._timeout = timeout

    def verdicts(
        self,
        pdd: PDDeployment,
        draining: Sequence[Draining],
        full: bool,
        now: float,
        available: int | None = None,
    ) -> dict[str, DrainVerdict]:
        """Asks the routers when a pod drains, on a full pass, when a poll is due, or when the
        router Deployment's ``available`` count is not the number of Ready routers last seen
        (a router pod came or went); one verdict per draining pod."""
        state = self._state((pdd.namespace, pdd.name), _State)
        moved = available is not None and (state.reports is None or len(state.reports) != available)
        if not (draining or full or state.due or moved):
            return {}
        state.due = False
        state.reports = self.ask(pdd, {d.name for d in draining})
        return {
            d.name: drain_verdict(
                d.name,
                state.left.get(d.name),
                d.since,
                now,
                pdd.spec.rollout.drain_seconds,
                state.reports,
            )
            for d in draining
        }

    def table_written(
        self, pdd: PDDeployment, table: RoutingTable, draining: Sequence[str], written: bool
    ) -> bool:
        """Records where each draining pod left the table; True when the routers should be asked
        again in :data:`POLL_SECONDS` (a table was written and some router answers)."""
        state = self._state((pdd.namespace, pdd.name), _State)
        state.left = {name: state.left.get(name, table.generation) for name in draining}
        summary = self.summary(pdd, table.generation)
        again = summary is not None and (
            summary.behind > 0 or (written and summary.served_generation is not None)
        )
        state.due = state.due or again
        return again

    def summary(self, pdd: PDDeployment, written: int | None) -> RoutersSummary | None:
        state = self._known((pdd.namespace, pdd.name))
        if state is None or state.reports is None:
            return None
        return summarize(state.reports, written)

    def left_generation(self, pdd: PDDeployment, pod: str) -> int | None:
        state = self._known((pdd.namespace, pdd.name))
        return state.left.get(pod) if state else None

    # --- the edge ----------------------------------------------------------------------------

    def ask(self, pdd: PDDeployment, draining: Collection[str] = ()) -> list[RouterReport]:
        """One report per Ready router pod; a failed listing is one error report (drains wait).

        With the routers in the decode pods (``placement: decode-sidecar``), a draining decode pod
        is asked too, Ready or not: its own sidecar holds its in-flight streams. While it is still
        Ready the client Service may still send it requests, so its report counts it as routed to
        (its sidecar turns unready as soon as it serves the table that marks it draining).
        """
        try:
            pods = self._kube.list_objects("Pod", pdd.namespace, router_pod_selector(pdd))
        except KubeError as exc:
            log.warning("cannot list the router pods of %s/%s: %s", pdd.namespace, pdd.name, exc)
            return [RouterReport("router pods", error=f"cannot list them: {exc}")]
        targets = ready_router_addresses(pods)
        still_ready: set[str] = set()
        if pdd.spec.router.decode_sidecar and draining:
            ready = {name for name, _ in targets}
            still_ready = ready & set(draining)
            targets += [t for t in running_addresses(pods, draining) if t[0] not in ready]
        if not targets:
            return []
        reports = asyncio.run(fetch_reports(targets, pdd.spec.router.admin_port, pdd.name, self._timeout))
        for report in reports:
            metrics.ROUTER_QUERIES.labels("answered" if report.answered else "error").inc()
        return [
            replace(r, routable=r.routable | {r.pod}) if r.pod in still_ready and r.answered else r
            for r in reports
        ]


def ready_router_addresses(pods: Sequence[Mapping[str, object]]) -> list[tuple[str, str]]:
    """(name, IP) of the pods that are Ready, not terminating and have an IP."""
    out = []
    for pod in pods:
        meta = pod.get("metadata")
        status = pod.get("status")
        if not isinstance(meta, Mapping) or not isinstance(status, Mapping) or meta.get("deletionTimestamp"):
            continue
        conditions = status.get("conditions")
        ready = isinstance(conditions, list) and any(
            isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
            for c in conditions
        )
        ip = status.get("podIP")
        if ready and isinstance(ip, str) and ip:
            out.append((str(meta.get("name", "")), ip))
    return out


def running_addresses(pods: Sequence[Mapping[str, object]], names: Collection[str]) -> list[tuple[str, str]]:
    """(name, IP) of the pods named ``names`` that are not terminating and have an IP, Ready or not."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata"), pod.get("status")
        if not isinstance(meta, Mapping) or not isinstance(status, Mapping) or meta.get("deletionTimestamp"):
            continue
        ip = status.get("podIP")
        if meta.get("name") in names and isinstance(ip, str) and ip:
            out.append((str(meta["name"]), ip))
    return out


async def fetch_reports(
    targets: Sequence[tuple[str, str]], port: int, deployment: str, timeout: float
) -> list[RouterReport]:
    """``GET /routing/served`` of every router at once."""
    async with aiohttp.ClientSession() as session:
        return await read_served(session_get(session, timeout), deployment, base_urls(targets, port))


def base_urls(targets: Sequence[tuple[str, str]], port: int) -> list[tuple[str, str]]:
    """(name, ``http://<IP>:<port>``) of (name, IP) pairs."""
    return [(name, f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}") for name, ip in targets]


def session_get(session: aiohttp.ClientSession, timeout: float) -> Get:
    """The readers' GET (pdserve.deployment.plan.fetch) through ``session``, ``timeout`` each."""
    limit = aiohttp.ClientTimeout(total=timeout)

    async def get(url: str) -> tuple[int, str]:
        try:
            async with session.get(url, timeout=limit) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            raise GetError(f"{type(exc).__name__} {exc}".rstrip()) from None

    return get
