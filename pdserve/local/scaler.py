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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from pdserve.deployment.plan.autoscale import ROLES, Decision, Memory, RoleState, decide
from pdserve.deployment.plan.drain import RouterReport, drain_verdict
from pdserve.deployment.plan.fetch import Get, GetError
from pdserve.deployment.plan.signals import Signals
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


def session_get(session: aiohttp.ClientSession) -> Get:
    """The readers' GET (pdserve.deployment.plan.fetch) through the runner's session."""

    async def get(url: str) -> tuple[int, str]:
        try:
            async with session.get(url) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, OSError) as exc:
            raise GetError(type(exc).__name__) from None

    return get


def _ms(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"
