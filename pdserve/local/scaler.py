"""``spec.autoscaling`` in local mode: the operator's decision, with processes in place of pods.

The run is planned for ``maxInstances`` of each role (every port reserved up front); the runner
starts only the instances the autoscaler wants. Every ``syncPeriodSeconds`` this reads the same
signals the operator reads, from whoever is closest, which here is `pdserve up` itself: the
routers' ``GET /load`` and the running engines' ``/metrics``. It then makes the same decision
(pdserve.deployment.plan.autoscale). A new instance is started and enters the routing table
once its ``/health`` answers; a removed one is marked draining in the table, and its processes
are stopped once every router serves a table without it and has no request on it (the
operator's drain rule, pdserve.deployment.plan.drain), or after ``rollout.drainSeconds``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from pdserve.deployment.plan.autoscale import ROLES, Decision, Memory, RoleState, decide
from pdserve.deployment.plan.drain import RouterReport, drain_verdict, parse_served
from pdserve.deployment.plan.signals import (
    EngineLoad,
    RouterLoad,
    Signals,
    combine,
    parse_engine_metrics,
    parse_load,
)
from pdserve.deployment.spec.autoscaling import AutoscalingSpec
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.routing import Role

Instance = tuple[Role, int]


@dataclass
class Draining:
    since: float  # wall clock, as the drain rule counts
    left: int | None = None  # the first table generation written without it


@dataclass
class LocalScaler:
    """The counts, the decisions' memory and the drains of one local run."""

    spec: AutoscalingSpec
    desired: dict[str, int]
    next_at: float = 0.0
    memory: Memory = field(default_factory=Memory)
    draining: dict[Instance, Draining] = field(default_factory=dict)
    last: Decision | None = None
    signals: Signals | None = None

    @classmethod
    def of(cls, pdd: PDDeployment) -> LocalScaler | None:
        spec = pdd.spec.autoscaling
        if spec is None:
            return None
        start = {role: spec.bounds(role).clamp(pdd.spec.role(Role(role)).instances) for role in ROLES}
        return cls(spec, start)

    def wanted(self, instance: Instance) -> bool:
        role, index = instance
        return index < self.desired[role.value]

    def runs(self, instance: Instance) -> bool:
        """Whether its processes should be running: wanted, or draining."""
        return self.wanted(instance) or instance in self.draining

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def apply(self, decision: Decision, now: float, wall: float, running: Iterable[Instance]) -> None:
        """The new counts: running instances past them start draining; wanted ones stop draining."""
        self.last = decision
        self.memory = decision.memory
        self.next_at = now + self.spec.sync_period_seconds
        self.desired = dict(decision.counts)
        for instance in running:
            if self.wanted(instance):
                self.draining.pop(instance, None)
            elif instance not in self.draining:
                self.draining[instance] = Draining(wall)

    def decide(self, now: float, roles: Mapping[str, RoleState], signals: Signals) -> Decision:
        self.signals = signals
        return decide(self.spec, now, roles, signals, self.memory)

    def drained(
        self,
        name: str,
        instance: Instance,
        reports: Sequence[RouterReport],
        wall: float,
        drain_seconds: float,
    ) -> bool:
        state = self.draining[instance]
        return drain_verdict(name, state.left, state.since, wall, drain_seconds, reports).done

    def lines(self) -> list[str]:
        """The live view's lines: desired/current per role, measured against the objectives."""
        o = self.spec.objectives
        d = self.last
        head = "autoscaling: " + "  ".join(
            f"{role} {self.desired[role]} wanted ({self.spec.bounds(role).min_instances}-"
            f"{self.spec.bounds(role).max_instances})"
            for role in ROLES
        )
        if d is None:
            return [head, "  no decision yet"]
        ttft, itl = d.measured["ttft_ms"], d.measured["itl_ms"]
        measured = (
            f"  p{o.percentile:g} TTFT {_ms(ttft)} / {_ms(o.ttft_milliseconds)}   "
            f"ITL {_ms(itl)} / {_ms(o.itl_milliseconds)}"
        )
        if self.signals is not None and self.signals.known:
            measured += f"   {self.signals.rate:.1f} req/s over {self.signals.window_seconds:g} s"
        return [head, measured, f"  last decision: {d.reason}"]


async def gather(
    session: aiohttp.ClientSession,
    deployment: str,
    routers: Sequence[tuple[str, str]],
    engines: Sequence[tuple[str, str, str]],
    window: float,
) -> Signals:
    """``routers``: (name, base URL); ``engines``: (instance, role, base URL) of running API servers."""

    async def load(name: str, url: str) -> RouterLoad:
        try:
            async with session.get(f"{url}/load?window={window:g}") as resp:
                if resp.status != 200:
                    return RouterLoad(name, error=f"/load answered {resp.status}")
                return parse_load(name, await resp.json(content_type=None), deployment)
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
            return RouterLoad(name, error=f"/load unreachable: {type(exc).__name__}")

    async def metrics(instance: str, role: str, url: str) -> EngineLoad:
        try:
            async with session.get(f"{url}/metrics") as resp:
                if resp.status != 200:
                    return EngineLoad(instance, role, error=f"/metrics answered {resp.status}")
                return parse_engine_metrics(instance, role, await resp.text())
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, OSError) as exc:
            return EngineLoad(instance, role, error=f"/metrics unreachable: {type(exc).__name__}")

    loads = await asyncio.gather(*(load(n, u) for n, u in routers))
    gauges = await asyncio.gather(*(metrics(i, r, u) for i, r, u in engines))
    return combine(window, loads, gauges)


async def served_reports(
    session: aiohttp.ClientSession, deployment: str, routers: Sequence[tuple[str, str]]
) -> list[RouterReport]:
    """Every router's ``/routing/served``, as the drain rule reads them."""

    async def one(name: str, url: str) -> RouterReport:
        try:
            async with session.get(f"{url}/routing/served") as resp:
                if resp.status != 200:
                    return RouterReport(name, error=f"/routing/served answered {resp.status}")
                return parse_served(name, await resp.json(content_type=None), deployment)
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
            return RouterReport(name, error=f"/routing/served unreachable: {type(exc).__name__}")

    return list(await asyncio.gather(*(one(n, u) for n, u in routers)))


def _ms(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"
