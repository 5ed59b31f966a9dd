"""One runner pod: its containers as local process groups, its probes, its status, its deletion.

A :class:`PodWorker` thread owns one pod from the moment it is bound to a runner node until its
object is deleted: it prepares the volumes, runs the init containers in order, then the
containers (each ``unshare -m`` + ``container_entry.py``, one session and process group each),
restarts them per ``restartPolicy`` with the kubelet's back-off, runs the probes, writes
``status`` as the kubelet would, and on deletion runs ``preStop``, sends SIGTERM, waits the grace
period, sends SIGKILL and deletes the object (grace 0, uid precondition).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kube import Kube, now_iso, write_pidfile
from .probes import run_action
from .spec import (
    BACKOFF_RESET_AFTER,
    ConfigError,
    Lookups,
    backoff_delay,
    container_env,
    expand,
    should_restart,
    unsupported,
    with_pod_address,
)
from .volumes import PodVolumes

log = logging.getLogger("pod-runner")
HERE = Path(__file__).resolve().parent
TICK = 0.2
VOLUME_REFRESH = 3.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class RunnerConfig:
    state_dir: Path  # .cluster/runner
    logs: Path  # .cluster/logs
    shim_dir: Path  # pdserve and vllm for the containers' PATH
    apiserver_port: int
    host_ip: str
    allocatable: Mapping[str, str]


@dataclass
class Container:
    spec: dict[str, Any]
    init: bool
    restart_count: int = 0
    proc: subprocess.Popen[bytes] | None = None
    started_mono: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    crashes: int = 0
    restart_at: float | None = 0.0  # None: not to be (re)started
    kill_reason: str | None = None
    probe_stop: threading.Event = field(default_factory=threading.Event)
    container_id: str = ""
    succeeded: bool = False  # init containers: exited 0

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image") or "",
            "imageID": "",
            "ready": self.ready,
            "started": self.started and self.alive(),
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


class PodWorker(threading.Thread):
    def __init__(
        self,
        pod: dict[str, Any],
        pod_ip: str,
        kube: Kube,
        config: RunnerConfig,
        on_exit: Callable[[str], None],
    ) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.pod = pod
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.pod_ip = pod_ip
        self.kube = kube
        self.config = config
        self.on_exit = on_exit
        self.node: str = pod["spec"]["nodeName"]
        self.lock = threading.RLock()
        self.gone = threading.Event()  # the object was deleted behind our back (force delete)
        self.shutdown = threading.Event()  # the runner stops: kill, keep the object
        self.root = config.state_dir / "pods" / self.uid
        self.volumes = PodVolumes(pod, self.root, pod_ip, config.host_ip, config.allocatable)
        self.inits = [Container(c, True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c, False) for c in pod["spec"]["containers"]]
        old = {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or []}
        for c in self.containers:  # a restarted runner continues the counts
            if c.name in old:
                c.restart_count = int(old[c.name].get("restartCount", 0)) + (
                    1 if old[c.name].get("state") else 0
                )
        self.start_time = (pod.get("status") or {}).get("startTime") or now_iso()
        self.phase = "Pending"
        self.transitions: dict[str, tuple[str, str]] = {}
        self.last_sent: str = ""
        self.events_sent: set[tuple[str, str]] = set()
        self.next_refresh = 0.0

    # ------------------------------------------------------------------ interface for the watch

    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pod = pod

    @property
    def deleting(self) -> bool:
        with self.lock:
            return bool(self.pod["metadata"].get("deletionTimestamp"))

    def stopping(self) -> bool:
        return self.deleting or self.gone.is_set() or self.shutdown.is_set()

    # ------------------------------------------------------------------ main

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.error("pod %s: worker failed:\n%s", self.key, traceback.format_exc())
            self._kill_all(signal.SIGKILL)
        finally:
            self.volumes.cleanup()
            self.on_exit(self.uid)

    def _run(self) -> None:
        log.info("pod %s: starting (ip %s)", self.key, self.pod_ip)
        reasons = unsupported(self.pod)
        if reasons:
            message = "the pod runner does not support " + "; ".join(reasons)
            for c in self.inits + self.containers:
                c.state = {"waiting": {"reason": "RunnerUnsupported", "message": message}}
                c.restart_at = None
            self._event("Warning", "RunnerUnsupported", message)
            self._push()
            self._idle_until_stop()
            self._finish()
            return
        if not self._setup_volumes():
            self._finish()
            return
        if not self._run_inits():
            self._finish()
            return
        while not self.stopping():
            self._tick()
            time.sleep(TICK)
        self._finish()

    def _idle_until_stop(self) -> None:
        while not self.stopping():
            time.sleep(TICK)

    def _finish(self) -> None:
        if self.gone.is_set() or self.shutdown.is_set():
            self._kill_all(signal.SIGKILL)
            return
        with self.lock:
            grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        grace = int(grace if grace is not None else self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        log.info("pod %s: deleting, grace %ss", self.key, grace)
        threads = [
            threading.Thread(target=self._stop_container, args=(c, grace, "deletion"))
            for c in self.inits + self.containers
            if c.alive()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._push()
        self.kube.delete(self.pod)
        log.info("pod %s: deleted", self.key)

    def _setup_volumes(self) -> bool:
        while not self.stopping():
            try:
                self.volumes.setup(self.kube)
                return True
            except ConfigError as exc:
                message = f"MountVolume.SetUp failed: {exc}"
                for c in self.inits + self.containers:
                    c.state = {"waiting": {"reason": "ContainerCreating", "message": message}}
                self._event("Warning", "FailedMount", message)
                self._push()
                time.sleep(2.0)
        return False

    def _run_inits(self) -> bool:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.inits:
            while not c.succeeded:
                if self.stopping():
                    return False
                self._tick_container(c, policy)
                self._push()
                if c.restart_at is None and not c.succeeded and not c.alive():
                    self.phase = "Failed"
                    self._push()
                    self._idle_until_stop()
                    return False
                time.sleep(TICK)
        return True

    def _tick(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.containers:
            self._tick_container(c, policy)
        if time.monotonic() >= self.next_refresh:
            self.next_refresh = time.monotonic() + VOLUME_REFRESH
            try:
                self.volumes.refresh(self.kube)
            except ConfigError as exc:
                log.warning("pod %s: refreshing volumes: %s", self.key, exc)
        if all(c.restart_at is None and not c.alive() for c in self.containers):
            codes = [c.state.get("terminated", {}).get("exitCode", 1) for c in self.containers]
            self.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
        elif any(c.alive() or c.restart_count or c.last_state for c in self.containers):
            self.phase = "Running"
        self._push()

    def _tick_container(self, c: Container, policy: str) -> None:
        if c.kill_reason and c.alive():
            reason, c.kill_reason = c.kill_reason, None
            self._event("Normal", "Killing", f"Container {c.name} {reason}, will be restarted")
            probe = c.spec.get("startupProbe" if "startup" in reason else "livenessProbe") or {}
            grace = probe.get("terminationGracePeriodSeconds")  # a probe's own grace period wins
            if grace is None:
                grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
            self._stop_container(c, int(grace), reason)
        if c.proc is not None:
            code = c.proc.poll()
            if code is not None:
                # A failed init container is retried unless restartPolicy is Never (kubelet).
                self._exited(c, code, "OnFailure" if c.init and policy == "Always" else policy)
        if c.proc is None and c.restart_at is not None and time.monotonic() >= c.restart_at:
            self._start(c)

    # ------------------------------------------------------------------ processes

    def _start(self, c: Container) -> None:
        try:
            with self.lock:
                pod = self.pod
            c.env = container_env(
                pod,
                c.spec,
                Lookups(
                    config_map=lambda n: _text(self.kube.config_map(pod["metadata"]["namespace"], n)),
                    secret=lambda n: _text(self.kube.secret(pod["metadata"]["namespace"], n)),
                ),
                self.pod_ip,
                self.config.host_ip,
                self._injected_env(),
                self.config.allocatable,
            )
        except ConfigError as exc:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            self._event("Warning", "Failed", f"Error: {exc}")
            c.restart_at = time.monotonic() + 2.0
            return
        c.env["PATH"] = f"{self.config.shim_dir}:{c.env.get('PATH', DEFAULT_PATH)}"
        argv = [expand(str(a), c.env.get) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        argv = with_pod_address(argv, self.pod_ip)
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            source = self.volumes.paths[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists() and not source.is_symlink():
                    source.mkdir(parents=True, exist_ok=True)
            mounts.append(
                {"source": str(source), "target": m["mountPath"], "readOnly": bool(m.get("readOnly"))}
            )
        spec_file = self.root / "containers" / f"{c.name}.json"
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        spec_file.write_text(
            json.dumps({"argv": argv, "env": c.env, "mounts": mounts, "cwd": c.spec.get("workingDir")})
        )
        meta = self.pod["metadata"]
        log_path = self.config.logs / "pods" / f"{meta['namespace']}_{meta['name']}_{c.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            out.write(
                f"=== {now_iso()} pod-runner: start {c.name} (restart {c.restart_count}): {argv}\n".encode()
            )
            out.flush()
            c.proc = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    sys.executable,
                    str(HERE / "container_entry.py"),
                    str(spec_file),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": DEFAULT_PATH},
                cwd="/",
            )
        pid = c.proc.pid
        write_pidfile(self.config.state_dir / "pids" / f"{self.uid}_{c.name}.pid", pid)
        c.container_id = f"runner://{pid}"
        c.started_mono = time.monotonic()
        c.state = {"running": {"startedAt": now_iso()}}
        c.restart_at = None
        c.kill_reason = None
        c.ready = False
        c.started = "startupProbe" not in c.spec
        if not c.init and "readinessProbe" not in c.spec:
            c.ready = c.started
        c.probe_stop = threading.Event()
        if not c.init:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c.spec:
                    threading.Thread(
                        target=self._probe, args=(c, kind, c.probe_stop, pid), daemon=True
                    ).start()
        log.info("pod %s: started %s (pid %s): %s", self.key, c.name, pid, argv)
        self._event("Normal", "Started", f"Started container {c.name}")

    def _exited(self, c: Container, code: int, policy: str) -> None:
        assert c.proc is not None
        pid = c.proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the container is one process tree: nothing outlives it
        (self.config.state_dir / "pids" / f"{self.uid}_{c.name}.pid").unlink(missing_ok=True)
        c.probe_stop.set()
        ran = time.monotonic() - c.started_mono
        exit_code = code if code >= 0 else 128 - code
        terminated: dict[str, Any] = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": c.state.get("running", {}).get("startedAt", now_iso()),
            "finishedAt": now_iso(),
            "containerID": c.container_id,
        }
        if code < 0:
            terminated["signal"] = -code
        log.info("pod %s: container %s exited with %s after %.1fs", self.key, c.name, exit_code, ran)
        c.proc = None
        c.ready = False
        c.started = False
        if c.init and exit_code == 0:
            c.succeeded = True
            c.state = {"terminated": terminated}
            return
        restart = should_restart(policy, exit_code) and not self.stopping()
        if not restart:
            c.state = {"terminated": terminated}
            c.restart_at = None
            return
        c.crashes = 1 if ran >= BACKOFF_RESET_AFTER else c.crashes + 1
        delay = backoff_delay(c.crashes)
        c.last_state = {"terminated": terminated}
        c.restart_count += 1
        c.restart_at = time.monotonic() + delay
        if delay > 0:
            pod_name = self.pod["metadata"]["name"]
            message = f"back-off {int(delay)}s restarting failed container={c.name} pod={pod_name}"
            c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
            self._event("Warning", "BackOff", f"Back-off restarting failed container {c.name}")
        else:
            c.state = {"waiting": {"reason": "ContainerCreating"}}

    def _stop_container(self, c: Container, grace: int, why: str) -> None:
        """preStop, SIGTERM to the process group, the rest of the grace period, then SIGKILL."""
        proc = c.proc
        if proc is None or proc.poll() is not None:
            return
        deadline = time.monotonic() + grace
        c.probe_stop.set()
        pre_stop = (c.spec.get("lifecycle") or {}).get("preStop")
        if pre_stop:
            log.info("pod %s: %s: running preStop of %s", self.key, why, c.name)
            t = threading.Thread(
                target=run_action,
                args=(pre_stop, c.spec, self.pod_ip, proc.pid, c.env, max(1.0, grace)),
                daemon=True,
            )
            t.start()
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            deadline = max(deadline, time.monotonic() + 2.0)  # the kubelet's 2 s after a late preStop
        log.info("pod %s: %s: SIGTERM to %s (pid %s)", self.key, why, c.name, proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.info("pod %s: %s: grace period over, SIGKILL to %s", self.key, why, c.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if why == "deletion":
            self._exited(c, proc.returncode, "Never")
            c.proc = None

    def _kill_all(self, sig: signal.Signals) -> None:
        for c in self.inits + self.containers:
            c.probe_stop.set()
            if c.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)
                (self.config.state_dir / "pids" / f"{self.uid}_{c.name}.pid").unlink(missing_ok=True)

    def _injected_env(self) -> dict[str, str]:
        port = str(self.config.apiserver_port)
        return {
            "HOSTNAME": self.pod["spec"].get("hostname") or self.pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
        }

    # ------------------------------------------------------------------ probes

    def _probe(self, c: Container, kind: str, stop: threading.Event, pid: int) -> None:
        spec = c.spec[kind]
        period = float(spec.get("periodSeconds", 10))
        timeout = float(spec.get("timeoutSeconds", 1))
        success_needed = int(spec.get("successThreshold", 1))
        failures_allowed = int(spec.get("failureThreshold", 3))
        successes = failures = 0
        if stop.wait(float(spec.get("initialDelaySeconds", 0))):
            return
        while not stop.is_set():
            if kind != "startupProbe" and not c.started:
                stop.wait(min(period, 0.5))
                continue
            ok, detail = run_action(spec, c.spec, self.pod_ip, pid, c.env, timeout)
            if stop.is_set():
                return
            if ok:
                successes, failures = successes + 1, 0
            else:
                successes, failures = 0, failures + 1
                if failures == 1:
                    label = {
                        "startupProbe": "Startup",
                        "readinessProbe": "Readiness",
                        "livenessProbe": "Liveness",
                    }
                    self._event("Warning", "Unhealthy", f"{label[kind]} probe failed: {detail}")
            if kind == "startupProbe":
                if ok:
                    c.started = True
                    if "readinessProbe" not in c.spec:
                        c.ready = True
                    return
                if failures >= failures_allowed:
                    c.kill_reason = "failed startup probe"
                    return
            elif kind == "readinessProbe":
                if ok and successes >= success_needed:
                    c.ready = True
                elif not ok and failures >= failures_allowed:
                    c.ready = False
            elif not ok and failures >= failures_allowed:
                c.kill_reason = "failed liveness probe"
                return
            stop.wait(period)

    # ------------------------------------------------------------------ status

    def _condition(self, kind: str, value: bool) -> dict[str, Any]:
        status = "True" if value else "False"
        before = self.transitions.get(kind)
        if before is None or before[0] != status:
            self.transitions[kind] = (status, now_iso())
        return {
            "type": kind,
            "status": status,
            "lastTransitionTime": self.transitions[kind][1],
            "lastProbeTime": None,
        }

    def _push(self) -> None:
        if self.gone.is_set():
            return
        with self.lock:
            pod = self.pod
        initialized = all(c.succeeded for c in self.inits)
        containers_ready = all(c.ready and c.alive() for c in self.containers)
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
        present = {cond["type"]: cond["status"] for cond in (pod.get("status") or {}).get("conditions") or []}
        ready = containers_ready and all(present.get(g) == "True" for g in gates)
        status: dict[str, Any] = {
            "phase": self.phase,
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "hostIP": self.config.host_ip,
            "hostIPs": [{"ip": self.config.host_ip}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", True),
                self._condition("Initialized", initialized),
                self._condition("ContainersReady", containers_ready),
                self._condition("Ready", ready),
                {"type": "PodScheduled", "status": "True"},
            ],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.inits:
            status["initContainerStatuses"] = [c.status() for c in self.inits]
        text = json.dumps(status, sort_keys=True)
        if text == self.last_sent:
            return
        try:
            if not self.kube.patch_status(pod, status):
                self.gone.set()
                return
        except Exception as exc:
            log.warning("pod %s: status update failed: %s", self.key, exc)
            return
        self.last_sent = text

    def _event(self, kind: str, reason: str, message: str) -> None:
        if (reason, message) in self.events_sent:
            return
        self.events_sent.add((reason, message))
        log.info("pod %s: event %s %s: %s", self.key, kind, reason, message)
        self.kube.event(self.pod, kind, reason, message, self.node)


def _text(data: Mapping[str, bytes] | None) -> dict[str, str] | None:
    return None if data is None else {k: v.decode(errors="replace") for k, v in data.items()}
