"""The loop of a local run: the routing file, the routers, the sidecars' front, spec.autoscaling
and a clean stop, over the processes the supervisor (:mod:`pdserve.local.supervisor`) keeps.

The loop is the operator's reconcile loop with processes in place of pods: poll every
engine's ``/health`` (the pod's readiness probe), turn the answers into
:class:`ObservedInstance` values, build the table with the operator's
:func:`build_routing_table`, and write it (atomically: temp file + rename) only when its
content changed, for the routers' ``--routing-file`` watcher. With ``placement: decode-sidecar``
there is one router per decode instance and the front (:mod:`pdserve.local.front`) on the user's
port; the runner polls every sidecar's ``/ready`` (the kubelet's readiness probe) and tells the
front which ones it may send to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from pdserve.deployment.plan.autoscale import ROLES, RoleState
from pdserve.deployment.plan.drain import read_served
from pdserve.deployment.plan.signals import read_signals
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table
from pdserve.local.front import Front, SidecarEndpoint
from pdserve.local.observe import observed_instances
from pdserve.local.plan import LOOPBACK, LocalPlan, RouterProcess
from pdserve.local.report import Reporter, describe_bounds, describe_routers, describe_table
from pdserve.local.scaler import Instance, LocalScaler, session_get
from pdserve.local.supervisor import Supervisor
from pdserve.routing import Role, RoutingTable

#: How often engines' /health is polled (a pod readiness probe is 2-5 s; locally we can be quicker).
POLL_SECONDS = 0.25


@dataclass
class LocalRunner:
    plan: LocalPlan
    routing_file: Path
    log_dir: Path
    reporter: Reporter = field(default_factory=Reporter)
    stop_grace: float = 10.0
    on_ready: Callable[[RoutingTable], None] | None = None
    #: spec.autoscaling: the plan has maxInstances of each role, this says which run (scaler.py).
    scaler: LocalScaler | None = None

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.plan, self.log_dir, self.reporter, self.scaler)
        self.front: Front | None = None
        if self.plan.sidecars:
            sidecars = [SidecarEndpoint(r.instance, r.url) for r in self.plan.routers]
            self.front = Front(sidecars, LOOPBACK, self.plan.port)
        self.table: RoutingTable | None = None
        self.stopping = asyncio.Event()
        self.failure: str | None = None
        self.stop_cause: str | None = None  # the signal that stopped the run, said in the stop report
        self.stop_report = ""  # what was stopped, and how: set once every process is gone
        self._announced = False

    # --- the run ---------------------------------------------------------------------------------

    async def run(self) -> int:
        """Start everything, keep the table in step with health until a stop signal, stop all."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            self._write_table(
                observed_instances(self.plan.deployment, self.plan.engines, [False] * len(self.plan.engines))
            )
            if self.front is not None:
                try:
                    await self.front.start()
                except OSError as exc:
                    self._fail(f"could not listen on {self.plan.url}: {exc}")
            if not self.stopping.is_set():
                engines, routers = self.supervisor.start_all()
                self.reporter.event(
                    f"started {engines} {self.plan.deployment.spec.engine} engine process(es) and "
                    f"{describe_routers(self.plan, routers)}; logs in {self.log_dir}"
                )
                if self.scaler is not None:
                    self.reporter.event(
                        f"autoscaling between {describe_bounds(self.scaler)}; deciding every "
                        f"{self.scaler.spec.sync_period_seconds} s"
                    )
            timeout = aiohttp.ClientTimeout(total=2)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                while not self.stopping.is_set():
                    await self._tick(session)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), POLL_SECONDS)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self.stop_report = await self.stop_all()
        if self.failure:
            self.reporter.event(f"error: {self.failure}")
            return 1
        return 0

    def _on_signal(self, sig: int) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()  # first: saying so may fail (stdout gone: a closed pipe)
        name = signal.Signals(sig).name
        self.stop_cause = f"{name} (Ctrl-C)" if sig == signal.SIGINT else name
        with contextlib.suppress(OSError):
            self.reporter.event(f"{name}: stopping every process")

    async def _tick(self, session: aiohttp.ClientSession) -> None:
        supervisor = self.supervisor
        if (failure := supervisor.router_failure()) is not None:
            self._fail(failure)
            return
        supervisor.start_pending()
        if (failure := supervisor.restart_exited_engines()) is not None:
            self._fail(failure)
        if self.stopping.is_set():
            return
        supervisor.refresh_trees()
        health = await supervisor.probe(session)
        observed = observed_instances(self.plan.deployment, self.plan.engines, health)
        if self.scaler is not None:
            observed = self._scaled(observed)
        self._write_table(observed)
        if self.scaler is not None:
            await self._autoscale(session, health)
        routers = [r for r in self.plan.routers if supervisor.router_runs(supervisor.routers[r.name])]
        routers_ready: list[bool] = []
        if self.front is not None or not self._announced:
            routers_ready = await asyncio.gather(*(self._router_ready(session, r) for r in routers))
        if self.front is not None:  # the kubelet's readiness probes, for the Service's endpoints
            self.front.set_ready([r.instance for r, ok in zip(routers, routers_ready, strict=True) if ok])
        running = [ok for e, ok in zip(self.plan.engines, health, strict=True) if supervisor.runs(e)]
        if not self._announced and all(running) and all(routers_ready):
            self._announced = True
            assert self.table is not None
            if self.on_ready is not None:
                self.on_ready(self.table)

    async def _router_ready(self, session: aiohttp.ClientSession, router: RouterProcess) -> bool:
        try:
            async with session.get(router.url + "/ready") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _write_table(self, observed: Sequence[ObservedInstance]) -> None:
        table = build_routing_table(self.plan.deployment, observed, self.table)
        if self.table is not None and table.generation == self.table.generation:
            return
        tmp = self.routing_file.with_name(self.routing_file.name + ".tmp")
        tmp.write_text(table.to_json(), encoding="utf-8")
        os.replace(tmp, self.routing_file)
        if self.table is not None:
            self.reporter.event(f"routing table generation {table.generation}: {describe_table(table)}")
        self.table = table

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        self.stopping.set()

    # --- spec.autoscaling (scaler.py) ----------------------------------------------------------------

    def _scaled(self, observed: Sequence[ObservedInstance]) -> list[ObservedInstance]:
        """The table's instances: those that run, the draining ones marked so."""
        assert self.scaler is not None
        out = []
        for obs in observed:
            instance = (obs.role, obs.index)
            if self.scaler.runs(instance):
                out.append(replace(obs, draining=instance in self.scaler.draining))
        return out

    async def _autoscale(self, session: aiohttp.ClientSession, health: Sequence[bool]) -> None:
        """Finish the drains that are over, then decide when a decision is due."""
        scaler = self.scaler
        assert scaler is not None and self.table is not None
        deployment = self.plan.deployment.name
        routers = [(r.name, r.url) for r in self.plan.routers if self.supervisor.routers[r.name].running]
        for state in scaler.draining.values():
            if state.left is None:
                state.left = self.table.generation
        if scaler.draining:
            reports = await read_served(session_get(session), deployment, routers)
            drain_seconds = self.plan.deployment.spec.rollout.drain_seconds
            for instance in list(scaler.draining):
                name = _name_of(self.plan, instance)
                if scaler.drained(name, instance, reports, time.time(), drain_seconds):
                    del scaler.draining[instance]
                    self.supervisor.stop_instance(instance)
                    self.reporter.event(f"{name} drained and stopped")
        now = time.monotonic()
        if not scaler.due(now):
            return
        # an instance is healthy when every process of it is (a group's nodes)
        healthy: dict[Instance, bool] = {}
        for e, ok in zip(self.plan.engines, health, strict=True):
            healthy[(e.role, e.index)] = healthy.get((e.role, e.index), True) and ok
        engines = [
            (_name_of(self.plan, (e.role, e.index)), e.role.value, e.url)
            for e, ok in zip(self.plan.engines, health, strict=True)
            if ok and e.serves_http and self.supervisor.runs(e)
        ]
        window = scaler.spec.objectives.window_seconds
        signals = await read_signals(session_get(session), deployment, routers, engines, window)
        roles = {}
        for role in ROLES:
            wanted = [i for i in healthy if i[0].value == role and scaler.wanted(i)]
            ready = [i for i in wanted if healthy[i]]
            dp = self.plan.deployment.spec.role(Role(role)).data_parallel
            roles[role] = RoleState(
                scaler.desired[role], len(ready), len(wanted) - len(ready), slots=len(ready) * dp
            )
        decision = scaler.decide(now, roles, signals)
        before = {i for i in healthy if scaler.runs(i)}
        scaler.apply(decision, now, time.time(), before)
        for instance in sorted(i for i in healthy if scaler.runs(i) and i not in before):
            self.supervisor.start_instance(instance)
        if decision.changed:
            self.reporter.event(f"autoscaler: {decision.reason}")
        self.reporter.scaling(scaler.lines())

    # --- stopping --------------------------------------------------------------------------------

    async def stop_all(self) -> str:
        """Stop the front and then every process (:meth:`Supervisor.stop_all`: the routers first,
        so they stop taking requests); returns once none is left, with what it stopped, in a
        sentence."""
        if self.front is not None:
            await self.front.stop()
        terminated, killed, left = await self.supervisor.stop_all(self.stop_grace)
        why = " after the error above" if self.failure else ""
        why = f" on {self.stop_cause}" if self.stop_cause else why
        supervisor = self.supervisor
        routers = f"{len(supervisor.routers)} sidecar router(s)" if self.plan.sidecars else "the router"
        how = f"{terminated} process(es) got SIGTERM"
        if killed:
            how += f", {killed} still running after {self.stop_grace:g}s got SIGKILL"
        gone = "every process exited" if not left else f"{left} process tree(s) could not be stopped"
        return f"stopped{why}: {len(supervisor.engines)} engine(s) and {routers}; {how}; {gone}"


def _name_of(plan: LocalPlan, instance: Instance) -> str:
    """An instance's name in the table: its process's, or its group's (the leader's)."""
    engine = next(e for e in plan.engines if (e.role, e.index) == instance)
    return engine.group or engine.name
