"""Supervision of a local run: engine processes, the routing file, the proxy, a clean stop.

The loop is the operator's reconcile loop with processes in place of pods: poll every
engine's ``/health`` (the pod's readiness probe), turn the answers into
:class:`ObservedInstance` values, build the table with the operator's
:func:`build_routing_table`, and write it (atomically: temp file + rename) only when its
content changed, for the proxy's ``--routing-file`` watcher.

Every child runs in its own session (process group), so a stop signals the whole group:
vLLM's DP engine processes go with their API server. On Linux children also get a
parent-death signal, so even a SIGKILL of `pdserve up` leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdserve.deployment.routing import ObservedInstance, build_routing_table
from pdserve.local.plan import LOOPBACK, EngineProcess, LocalPlan
from pdserve.routing import Instance, RoutingTable

#: How often engines' /health is polled (a pod readiness probe is 2-5 s; locally we can be quicker).
POLL_SECONDS = 0.25
#: An engine that exits this many times in a row without ever answering /health fails the run.
MAX_FAILED_STARTS = 3
MAX_RESTART_DELAY = 30.0


class Reporter:
    """Where the runner's events go; the live view overrides this to show them in its frame."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def event(self, text: str) -> None:
        print(f"[pdserve up {time.monotonic() - self._t0:6.1f}s] {text}", flush=True)


@dataclass
class Child:
    """One supervised process (an engine or the proxy) and its restart bookkeeping."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    healthy_once: bool = False
    failed_starts: int = 0
    restart_at: float = 0.0
    restarts: int = 0

    def start(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            log.close()
        self.healthy_once = False

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel sends SIGTERM to the child when `pdserve up` dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass
class LocalRunner:
    plan: LocalPlan
    routing_file: Path
    log_dir: Path
    reporter: Reporter = field(default_factory=Reporter)
    stop_grace: float = 10.0
    on_ready: Callable[[RoutingTable], None] | None = None

    def __post_init__(self) -> None:
        self.engines = {
            e.name: Child(e.name, e.argv, e.env, self.log_dir / f"{e.name}.log") for e in self.plan.engines
        }
        self.proxy = Child("router", self.plan.router.argv, {}, self.log_dir / "router.log")
        self.table: RoutingTable | None = None
        self.stopping = asyncio.Event()
        self.failure: str | None = None
        self._announced = False

    # --- the run ---------------------------------------------------------------------------------

    async def run(self) -> int:
        """Start everything, keep the table in step with health until a stop signal, stop all."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            self._write_table(
                [
                    ObservedInstance(e.role, e.index, e.name, LOOPBACK, False, port=e.port)
                    for e in self.plan.engines
                ]
            )
            for child in self.engines.values():
                child.start()
            self.proxy.start()
            self.reporter.event(
                f"started {len(self.engines)} {self.plan.deployment.spec.engine} engine process(es) and the "
                f"router; logs in {self.log_dir}"
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
            await self.stop_all()
        if self.failure:
            self.reporter.event(f"error: {self.failure}")
            return 1
        return 0

    def _on_signal(self, sig: int) -> None:
        if not self.stopping.is_set():
            self.reporter.event(f"{signal.Signals(sig).name}: stopping every process")
        self.stopping.set()

    async def _tick(self, session: aiohttp.ClientSession) -> None:
        if not self.proxy.running:
            code = self.proxy.popen.returncode if self.proxy.popen else None
            self._fail(f"the router exited with code {code}:\n{self.proxy.log_tail()}")
            return
        self._restart_exited_engines()
        if self.stopping.is_set():
            return
        health = await asyncio.gather(*(self._healthy(session, e) for e in self.plan.engines))
        observed = [
            ObservedInstance(e.role, e.index, e.name, LOOPBACK, ok, port=e.port)
            for e, ok in zip(self.plan.engines, health, strict=True)
        ]
        for e, ok in zip(self.plan.engines, health, strict=True):
            if ok:
                child = self.engines[e.name]
                child.healthy_once = True
                child.failed_starts = 0
        self._write_table(observed)
        if not self._announced and all(health) and await self._router_ready(session):
            self._announced = True
            assert self.table is not None
            if self.on_ready is not None:
                self.on_ready(self.table)

    def _restart_exited_engines(self) -> None:
        now = time.monotonic()
        for child in self.engines.values():
            if child.running:
                continue
            if child.restart_at == 0.0:  # just noticed the exit
                assert child.popen is not None
                code = child.popen.returncode
                child.failed_starts = 0 if child.healthy_once else child.failed_starts + 1
                if child.failed_starts >= MAX_FAILED_STARTS:
                    self._fail(
                        f"{child.name} exited with code {code} {child.failed_starts} times without becoming "
                        f"healthy; last lines of {child.log_path}:\n{child.log_tail()}"
                    )
                    return
                delay = min(MAX_RESTART_DELAY, 2.0**child.restarts)
                child.restart_at = now + delay
                self.reporter.event(
                    f"{child.name} exited with code {code}; restarting in {delay:.0f}s "
                    f"(log: {child.log_path})"
                )
            elif now >= child.restart_at:
                child.restart_at = 0.0
                child.restarts += 1
                child.start()

    async def _healthy(self, session: aiohttp.ClientSession, engine: EngineProcess) -> bool:
        if not self.engines[engine.name].running:
            return False
        try:
            async with session.get(engine.url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _router_ready(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.plan.router.url + "/ready") as resp:
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

    # --- stopping --------------------------------------------------------------------------------

    async def stop_all(self) -> None:
        """SIGTERM to every process group (router first, so it stops taking requests), then SIGKILL."""
        children = [self.proxy, *self.engines.values()]
        for child in children:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and any(c.running for c in children):
            await asyncio.sleep(0.05)
        for child in children:
            # The group too: a leader that exited may leave workers behind.
            child.signal_group(signal.SIGKILL)
            if child.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(5)


def describe_table(table: RoutingTable) -> str:
    def role(instances: Sequence[Instance]) -> str:
        ready = sum(i.dp_size for i in instances if i.routable)
        total = sum(i.dp_size for i in instances)
        return f"{ready}/{total} slots ready"

    return f"prefill {role(table.prefill)}, decode {role(table.decode)}"
