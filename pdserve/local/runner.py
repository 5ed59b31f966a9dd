"""Supervision of a local run: engine processes, the routing file, the routers, a clean stop.

The loop is the operator's reconcile loop with processes in place of pods: poll every
engine's ``/health`` (the pod's readiness probe), turn the answers into
:class:`ObservedInstance` values, build the table with the operator's
:func:`build_routing_table`, and write it (atomically: temp file + rename) only when its
content changed, for the routers' ``--routing-file`` watcher. With ``placement: decode-sidecar``
there is one router per decode instance and the front (:mod:`pdserve.local.front`) on the user's
port; the runner polls every sidecar's ``/ready`` (the kubelet's readiness probe) and tells the
front which ones it may send to.

Every engine runs in its own session, and everything it starts is stopped with it, whatever
stops it: vLLM's API server, engine cores and workers outlive a killed `vllm serve` (they
are re-parented to init and keep answering /health), so the runner tracks each engine's
processes (:mod:`pdserve.local.proctree`: its session plus every descendant seen) and stops
them all when the main process exits, before the restart, and at the end. A restart waits
until the engine's ports are free. An engine counts as healthy only while its main process
runs and, the first time, only if the process listening on its port is one of its own.
On Linux children also get a parent-death signal, so a SIGKILL of `pdserve up` reaches every
main process (and vLLM stops its children on that SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from pdserve.deployment.plan.autoscale import ROLES, RoleState
from pdserve.deployment.plan.drain import read_served
from pdserve.deployment.plan.signals import read_signals
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table
from pdserve.local.child import Child, describe_exit
from pdserve.local.front import Front, SidecarEndpoint
from pdserve.local.observe import observed_instances
from pdserve.local.plan import LOOPBACK, EngineProcess, LocalPlan, RouterProcess
from pdserve.local.proctree import (
    listening_inodes,
    port_free,
    port_holders,
    scan,
    socket_holders,
)
from pdserve.local.scaler import Instance, LocalScaler, session_get
from pdserve.routing import Instance as TableInstance
from pdserve.routing import Role, RoutingTable

#: How often engines' /health is polled (a pod readiness probe is 2-5 s; locally we can be quicker).
POLL_SECONDS = 0.25
#: Failed /health answers in a row that take a ready engine out of the table (the engine pods'
#: readinessProbe failureThreshold); an engine whose process exits leaves at once.
READINESS_FAILURES = 3
#: An engine that exits this many times in a row without ever answering /health fails the run.
MAX_FAILED_STARTS = 3
MAX_RESTART_DELAY = 30.0
#: Processes an exited engine left behind get SIGTERM, then SIGKILL after this long.
LEFTOVER_GRACE = 2.0
#: How often each running engine's process tree is re-read (to see processes that leave its session).
TREE_REFRESH_SECONDS = 1.0
#: After this long waiting for an engine's ports, the runner says who holds them.
PORT_WAIT_WARNING = 5.0


def readiness(ready: bool, failures: int, answered: bool) -> tuple[bool, int]:
    """(ready, failed answers in a row) after one /health answer of a running engine: an answer
    makes it ready; a ready engine leaves at the READINESS_FAILURES-th failure in a row; one that
    was not ready stays out until it answers."""
    if answered:
        return True, 0
    failures += 1
    return ready and failures < READINESS_FAILURES, failures


class Reporter:
    """Where the runner's events go; the live view overrides this to show them in its frame."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self.scaling_lines: list[str] = []

    def event(self, text: str) -> None:
        print(f"[pdserve up {time.monotonic() - self._t0:6.1f}s] {text}", flush=True)

    def scaling(self, lines: Sequence[str]) -> None:
        """The autoscaler's state after a decision (the live view shows it above the slots, the
        summary lines after their figures)."""
        self.scaling_lines = list(lines)

    def final(self, text: str) -> None:
        """The last word, once nothing is drawn any more (the live view prints it under its frame)."""
        self.event(text)


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
        self.engines = {
            e.name: Child(e.name, e.argv, e.env, self.log_dir / f"{e.name}.log", e.ports or (e.port,), e.cpus)
            for e in self.plan.engines
        }
        self.routers = {
            r.name: Child(r.name, r.argv, r.env, self.log_dir / f"{r.name}.log") for r in self.plan.routers
        }
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
        self._tree_refreshed = 0.0
        self._pending: set[str] = set()  # children to start once their ports are free
        self._sidecar_of = {
            r.name: _instance_of(self.plan, r.instance) for r in self.plan.routers if r.instance
        }

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
                engines = [c for e, c in self._engine_children() if self._runs(e)]
                routers = [c for c in self.routers.values() if self._router_runs(c)]
                for child in [*engines, *routers]:
                    child.start()
                self.reporter.event(
                    f"started {len(engines)} {self.plan.deployment.spec.engine} engine process(es) and "
                    f"{describe_routers(self.plan, len(routers))}; logs in {self.log_dir}"
                )
                if self.scaler is not None:
                    self.reporter.event(
                        f"autoscaling between {_bounds(self.scaler)}; deciding every "
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
        for router in self.routers.values():
            if not router.running and self._router_runs(router) and router.name not in self._pending:
                code = router.popen.returncode if router.popen else None
                self._fail(f"{router.name} {describe_exit(code)}:\n{router.log_tail()}")
                return
        self._start_pending()
        self._restart_exited_engines()
        if self.stopping.is_set():
            return
        self._refresh_trees()
        health = await asyncio.gather(*(self._healthy(session, e) for e in self.plan.engines))
        observed = observed_instances(self.plan.deployment, self.plan.engines, health)
        for e, ok in zip(self.plan.engines, health, strict=True):
            if ok:
                child = self.engines[e.name]
                child.healthy_once = True
                child.failed_starts = 0
        if self.scaler is not None:
            observed = self._scaled(observed)
        self._write_table(observed)
        if self.scaler is not None:
            await self._autoscale(session, health)
        routers = [r for r in self.plan.routers if self._router_runs(self.routers[r.name])]
        routers_ready: list[bool] = []
        if self.front is not None or not self._announced:
            routers_ready = await asyncio.gather(*(self._router_ready(session, r) for r in routers))
        if self.front is not None:  # the kubelet's readiness probes, for the Service's endpoints
            self.front.set_ready([r.instance for r, ok in zip(routers, routers_ready, strict=True) if ok])
        running = [ok for e, ok in zip(self.plan.engines, health, strict=True) if self._runs(e)]
        if not self._announced and all(running) and all(routers_ready):
            self._announced = True
            assert self.table is not None
            if self.on_ready is not None:
                self.on_ready(self.table)

    def _refresh_trees(self) -> None:
        """Re-read the running engines' process trees now and then: a process that leaves its
        engine's session must have been seen before its parent dies."""
        now = time.monotonic()
        if now - self._tree_refreshed < TREE_REFRESH_SECONDS:
            return
        self._tree_refreshed = now
        table = scan()
        for child in self.engines.values():
            if child.running and child.tree is not None:
                child.tree.refresh(table)

    def _restart_exited_engines(self) -> None:
        now = time.monotonic()
        for engine, child in self._engine_children():
            if child.running or not self._runs(engine) or child.popen is None or child.name in self._pending:
                continue
            if child.exited_at is None:  # just noticed the exit
                assert child.popen is not None
                code = child.popen.returncode
                child.exited_at = now
                left = child.signal_tree(signal.SIGTERM)  # everything it started goes with it
                child.failed_starts = 0 if child.healthy_once else child.failed_starts + 1
                if child.failed_starts >= MAX_FAILED_STARTS:
                    self._fail(
                        f"{child.name} {describe_exit(code)}, {child.failed_starts} times without becoming "
                        f"healthy; last lines of {child.log_path}:\n{child.log_tail()}"
                    )
                    return
                delay = min(MAX_RESTART_DELAY, 2.0**child.restarts)
                child.restart_at = now + delay
                leftovers = f"; stopping the {len(left)} process(es) it left running" if left else ""
                self.reporter.event(
                    f"{child.name} {describe_exit(code)}{leftovers}; restarting in {delay:.0f}s "
                    f"(log: {child.log_path})"
                )
                continue
            if child.tree_alive():
                if now - child.exited_at >= LEFTOVER_GRACE:
                    child.signal_tree(signal.SIGKILL)
                continue
            busy = [port for port in child.ports if not port_free(port)]
            if busy:
                if not child.port_warned and now - child.exited_at >= PORT_WAIT_WARNING:
                    child.port_warned = True
                    holders = sorted({pid for port in busy for pid in port_holders(port)})
                    self.reporter.event(
                        f"{child.name}: waiting for port(s) {', '.join(map(str, busy))} to be free before "
                        f"the restart (held by pid(s) {', '.join(map(str, holders)) or 'unknown'})"
                    )
                continue
            if now >= child.restart_at:
                child.restarts += 1
                child.start()

    async def _healthy(self, session: aiohttp.ClientSession, engine: EngineProcess) -> bool:
        """Whether the engine is ready: its main process runs and /health answers 200 from one of its
        own processes. A ready engine stays ready through fewer than :data:`READINESS_FAILURES` failed
        answers in a row, as a pod's readiness probe does: real vLLM on a busy core can be late with
        one answer, and leaving the table for it turns requests away (503) for nothing."""
        child = self.engines[engine.name]
        if not child.running or child.exited_at is not None or not self._runs(engine):
            child.ready, child.failed_probes = False, 0
            return False
        if not engine.serves_http:
            return True  # a --headless node answers no HTTP; its leader's /health covers the group
        answered = await self._answers_health(session, engine, child)
        child.ready, child.failed_probes = readiness(child.ready, child.failed_probes, answered)
        return child.ready

    async def _answers_health(
        self, session: aiohttp.ClientSession, engine: EngineProcess, child: Child
    ) -> bool:
        try:
            async with session.get(engine.url + "/health") as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        if not ok or not child.running:
            return False
        if not child.owner_checked:
            child.owner_checked = self._listener_is_own(child, engine.port)
        return child.owner_checked

    def _listener_is_own(self, child: Child, port: int) -> bool:
        """Whether the process listening on ``port`` is one of ``child``'s (not a leftover of
        another start, nor a stranger); said once when it is not."""
        if not sys.platform.startswith("linux") or child.tree is None:
            return True
        inodes = listening_inodes(port)
        if not inodes or socket_holders(inodes, child.tree.pids()):
            return True
        if not child.port_warned:
            child.port_warned = True
            holders = ", ".join(map(str, sorted(port_holders(port)))) or "unknown"
            self.reporter.event(
                f"{child.name}: port {port} answers /health but is held by pid(s) {holders}, not by "
                f"{child.name}'s processes; not routing to it"
            )
        return False

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

    def _engine_children(self) -> list[tuple[EngineProcess, Child]]:
        return [(e, self.engines[e.name]) for e in self.plan.engines]

    def _runs(self, engine: EngineProcess) -> bool:
        return self.scaler is None or self.scaler.runs((engine.role, engine.index))

    def _router_runs(self, router: Child) -> bool:
        """A decode sidecar runs while its decode instance does; the router always."""
        instance = self._sidecar_of.get(router.name)
        return self.scaler is None or instance is None or self.scaler.runs(instance)

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
        routers = [(r.name, r.url) for r in self.plan.routers if self.routers[r.name].running]
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
                    self._stop_instance(instance)
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
            if ok and e.serves_http and self._runs(e)
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
            self._start_instance(instance)
        if decision.changed:
            self.reporter.event(f"autoscaler: {decision.reason}")
        self.reporter.scaling(scaler.lines())

    def _start_instance(self, instance: Instance) -> None:
        """Its engine processes (and a decode's sidecar router), once their ports are free."""
        for engine, child in self._engine_children():
            if (engine.role, engine.index) == instance:
                child.failed_starts = child.restarts = 0
                self._pending.add(child.name)
        for name, of in self._sidecar_of.items():
            if of == instance:
                self._pending.add(name)

    def _start_pending(self) -> None:
        if not self._pending:
            return
        table = scan()
        for name in sorted(self._pending):
            child = self.engines.get(name) or self.routers[name]
            if child.running or child.tree_alive(table):
                continue
            if all(port_free(port) for port in child.ports):
                child.start()
                self._pending.discard(name)

    def _stop_instance(self, instance: Instance) -> None:
        """SIGTERM to every process of the instance (and its sidecar); they are not restarted."""
        for engine, child in self._engine_children():
            if (engine.role, engine.index) == instance:
                self._pending.discard(child.name)
                child.signal_tree(signal.SIGTERM)
        for name, of in self._sidecar_of.items():
            if of == instance:
                self._pending.discard(name)
                self.routers[name].signal_tree(signal.SIGTERM)

    # --- stopping --------------------------------------------------------------------------------

    async def stop_all(self) -> str:
        """SIGTERM to every process of every child (the front and the routers first, so they stop
        taking requests), SIGKILL to what is left after the grace period; returns once none is left,
        with what it stopped, in a sentence."""
        if self.front is not None:
            await self.front.stop()
        children = [*self.routers.values(), *self.engines.values()]
        terminated = sum(len(child.signal_tree(signal.SIGTERM)) for child in children)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and _any_alive(children, running_too=True):
            await asyncio.sleep(0.05)
        killed = 0
        for child in children:
            killed += len(child.signal_tree(signal.SIGKILL))
            if child.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _any_alive(children):
            await asyncio.sleep(0.05)
        left = sum(1 for child in children if child.tree_alive())
        why = " after the error above" if self.failure else ""
        why = f" on {self.stop_cause}" if self.stop_cause else why
        routers = f"{len(self.routers)} sidecar router(s)" if self.plan.sidecars else "the router"
        how = f"{terminated} process(es) got SIGTERM"
        if killed:
            how += f", {killed} still running after {self.stop_grace:g}s got SIGKILL"
        gone = "every process exited" if not left else f"{left} process tree(s) could not be stopped"
        return f"stopped{why}: {len(self.engines)} engine(s) and {routers}; {how}; {gone}"


def _any_alive(children: Sequence[Child], running_too: bool = False) -> bool:
    """One /proc scan for all children: whether any of their processes still runs."""
    if running_too and any(c.running for c in children):
        return True
    table = scan()
    return any(c.tree_alive(table) for c in children)


def _instance_of(plan: LocalPlan, engine_name: str) -> Instance:
    engine = next(e for e in plan.engines if e.name == engine_name)
    return (engine.role, engine.index)


def _name_of(plan: LocalPlan, instance: Instance) -> str:
    """An instance's name in the table: its process's, or its group's (the leader's)."""
    engine = next(e for e in plan.engines if (e.role, e.index) == instance)
    return engine.group or engine.name


def _bounds(scaler: LocalScaler) -> str:
    return ", ".join(
        f"{role} {scaler.spec.bounds(role).min_instances}-{scaler.spec.bounds(role).max_instances}"
        for role in ROLES
    )


def describe_routers(plan: LocalPlan, running: int | None = None) -> str:
    """Which placement runs, in a few words (the first lines of output say it); ``running``: the
    sidecars started (with spec.autoscaling, those of the decode instances it runs)."""
    if plan.sidecars:
        count = len(plan.routers) if running is None else running
        return (
            f"{count} sidecar router(s), one per decode instance (placement decode-sidecar; "
            f"{plan.url} spreads requests over them in turn)"
        )
    return "the router (placement deployment)"


def describe_table(table: RoutingTable) -> str:
    def role(instances: Sequence[TableInstance]) -> str:
        ready = sum(i.dp_size for i in instances if i.routable)
        total = sum(i.dp_size for i in instances)
        return f"{ready}/{total} slots ready"

    return f"prefill {role(table.prefill)}, decode {role(table.decode)}"
