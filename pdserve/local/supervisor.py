"""The processes of a local run: start, health, restart and stop of every engine's process tree,
and of the routers.

Kept apart from the run's loop (:mod:`pdserve.local.runner`), which decides what the table says
and which instances run: the loop asks whether an engine is ready and which instances to start or
stop; how processes are kept alive, restarted and stopped is a job of its own, here.

Every engine runs in its own session, and everything it starts is stopped with it, whatever
stops it: vLLM's API server, engine cores and workers outlive a killed `vllm serve` (they
are re-parented to init and keep answering /health), so the supervisor tracks each engine's
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
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from pdserve.local.child import Child, describe_exit
from pdserve.local.plan import EngineProcess, LocalPlan
from pdserve.local.proctree import (
    listening_inodes,
    port_free,
    port_holders,
    scan,
    socket_holders,
)
from pdserve.local.report import Reporter
from pdserve.local.scaler import Instance, LocalScaler

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
#: After this long waiting for an engine's ports, the supervisor says who holds them.
PORT_WAIT_WARNING = 5.0


def readiness(ready: bool, failures: int, answered: bool) -> tuple[bool, int]:
    """(ready, failed answers in a row) after one /health answer of a running engine: an answer
    makes it ready; a ready engine leaves at the READINESS_FAILURES-th failure in a row; one that
    was not ready stays out until it answers."""
    if answered:
        return True, 0
    failures += 1
    return ready and failures < READINESS_FAILURES, failures


class Supervisor:
    """Every engine and router process of one run, by name. With spec.autoscaling (``scaler``) the
    plan has maxInstances of each role and only the instances the scaler runs are started."""

    def __init__(
        self, plan: LocalPlan, log_dir: Path, reporter: Reporter, scaler: LocalScaler | None
    ) -> None:
        self.plan = plan
        self.reporter = reporter
        self.scaler = scaler
        self.engines = {
            e.name: Child(e.name, e.argv, e.env, log_dir / f"{e.name}.log", e.ports or (e.port,), e.cpus)
            for e in plan.engines
        }
        self.routers = {r.name: Child(r.name, r.argv, r.env, log_dir / f"{r.name}.log") for r in plan.routers}
        self._tree_refreshed = 0.0
        self._pending: set[str] = set()  # children to start once their ports are free
        self._sidecar_of = {r.name: _instance_of(plan, r.instance) for r in plan.routers if r.instance}

    def engine_children(self) -> list[tuple[EngineProcess, Child]]:
        return [(e, self.engines[e.name]) for e in self.plan.engines]

    def runs(self, engine: EngineProcess) -> bool:
        return self.scaler is None or self.scaler.runs((engine.role, engine.index))

    def router_runs(self, router: Child) -> bool:
        """A decode sidecar runs while its decode instance does; the router always."""
        instance = self._sidecar_of.get(router.name)
        return self.scaler is None or instance is None or self.scaler.runs(instance)

    def start_all(self) -> tuple[int, int]:
        """Start every engine and router that runs; returns how many of each."""
        engines = [c for e, c in self.engine_children() if self.runs(e)]
        routers = [c for c in self.routers.values() if self.router_runs(c)]
        for child in [*engines, *routers]:
            child.start()
        return len(engines), len(routers)

    def router_failure(self) -> str | None:
        """Why the run must end if a router that runs has exited (routers are not restarted)."""
        for router in self.routers.values():
            if not router.running and self.router_runs(router) and router.name not in self._pending:
                code = router.popen.returncode if router.popen else None
                return f"{router.name} {describe_exit(code)}:\n{router.log_tail()}"
        return None

    def refresh_trees(self) -> None:
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

    def restart_exited_engines(self) -> str | None:
        """Stop what an exited engine left and restart it once its ports are free; returns why the
        run must end if an engine keeps exiting without ever becoming healthy."""
        now = time.monotonic()
        for engine, child in self.engine_children():
            if child.running or not self.runs(engine) or child.popen is None or child.name in self._pending:
                continue
            if child.exited_at is None:  # just noticed the exit
                assert child.popen is not None
                code = child.popen.returncode
                child.exited_at = now
                left = child.signal_tree(signal.SIGTERM)  # everything it started goes with it
                child.failed_starts = 0 if child.healthy_once else child.failed_starts + 1
                if child.failed_starts >= MAX_FAILED_STARTS:
                    return (
                        f"{child.name} {describe_exit(code)}, {child.failed_starts} times without becoming "
                        f"healthy; last lines of {child.log_path}:\n{child.log_tail()}"
                    )
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
        return None

    async def probe(self, session: aiohttp.ClientSession) -> list[bool]:
        """Every engine's readiness, in the plan's order; an engine that is ready has become healthy
        (its next exit is not a failed start)."""
        health = await asyncio.gather(*(self._healthy(session, e) for e in self.plan.engines))
        for e, ok in zip(self.plan.engines, health, strict=True):
            if ok:
                child = self.engines[e.name]
                child.healthy_once = True
                child.failed_starts = 0
        return list(health)

    async def _healthy(self, session: aiohttp.ClientSession, engine: EngineProcess) -> bool:
        """Whether the engine is ready: its main process runs and /health answers 200 from one of its
        own processes. A ready engine stays ready through fewer than :data:`READINESS_FAILURES` failed
        answers in a row, as a pod's readiness probe does: real vLLM on a busy core can be late with
        one answer, and leaving the table for it turns requests away (503) for nothing."""
        child = self.engines[engine.name]
        if not child.running or child.exited_at is not None or not self.runs(engine):
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

    # --- spec.autoscaling (scaler.py) ----------------------------------------------------------------

    def start_instance(self, instance: Instance) -> None:
        """Its engine processes (and a decode's sidecar router), once their ports are free."""
        for engine, child in self.engine_children():
            if (engine.role, engine.index) == instance:
                child.failed_starts = child.restarts = 0
                self._pending.add(child.name)
        for name, of in self._sidecar_of.items():
            if of == instance:
                self._pending.add(name)

    def start_pending(self) -> None:
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

    def stop_instance(self, instance: Instance) -> None:
        """SIGTERM to every process of the instance (and its sidecar); they are not restarted."""
        for engine, child in self.engine_children():
            if (engine.role, engine.index) == instance:
                self._pending.discard(child.name)
                child.signal_tree(signal.SIGTERM)
        for name, of in self._sidecar_of.items():
            if of == instance:
                self._pending.discard(name)
                self.routers[name].signal_tree(signal.SIGTERM)

    # --- stopping --------------------------------------------------------------------------------

    async def stop_all(self, grace: float) -> tuple[int, int, int]:
        """SIGTERM to every process of every child (the routers first, so they stop taking
        requests), SIGKILL to what is left after ``grace`` seconds; returns once none is left, with
        how many processes got SIGTERM, how many SIGKILL, and how many process trees are left."""
        children = [*self.routers.values(), *self.engines.values()]
        terminated = sum(len(child.signal_tree(signal.SIGTERM)) for child in children)
        deadline = time.monotonic() + grace
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
        return terminated, killed, left


def _any_alive(children: Sequence[Child], running_too: bool = False) -> bool:
    """One /proc scan for all children: whether any of their processes still runs."""
    if running_too and any(c.running for c in children):
        return True
    table = scan()
    return any(c.tree_alive(table) for c in children)


def _instance_of(plan: LocalPlan, engine_name: str) -> Instance:
    engine = next(e for e in plan.engines if e.name == engine_name)
    return (engine.role, engine.index)
