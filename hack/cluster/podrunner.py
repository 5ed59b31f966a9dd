"""pdserve's pod runner: a tiny kubelet for the test cluster that runs pods as local processes.

Registers ``run-node-0..N-1`` (label ``type: runner``; no GPUs), keeps their Ready condition and
their Lease in kube-node-lease fresh, watches the pods bound to them and gives each one a
:class:`runner.pod.PodWorker`. Pod IPs come from ``--cidr`` (loopback, 127.128.128.0/17 by
default), one per live pod; the processes share the host network, so a listen address of
``0.0.0.0`` in a container's arguments is replaced by the pod IP.

Started by hack/cluster/up (log: .cluster/logs/pod-runner.log), stopped by hack/cluster/down:
SIGTERM kills every process group it started; a runner that crashed leaves pid files under
.cluster/runner/pids, and the next one kills those groups first. See hack/cluster/README.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from runner.kube import Kube, kill_leftovers  # hack/cluster/runner/, beside this script
from runner.pod import PodWorker, RunnerConfig

log = logging.getLogger("pod-runner")
HEARTBEAT = 10.0
LEASE_SECONDS = 40
ALLOCATABLE = {"cpu": "64", "memory": "256Gi", "pods": "250", "ephemeral-storage": "1Ti"}


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Addresses:
    """Pod IPs from the runner's CIDR, unique among the live pods."""

    def __init__(self, cidr: str) -> None:
        self.network = ipaddress.ip_network(cidr, strict=False)
        self.used: set[str] = set()
        self.lock = threading.Lock()

    def take(self, preferred: str | None) -> str:
        with self.lock:
            if preferred and preferred not in self.used and ipaddress.ip_address(preferred) in self.network:
                self.used.add(preferred)
                return preferred
            for host in self.network.hosts():
                ip = str(host)
                if ip not in self.used:
                    self.used.add(ip)
                    return ip
        raise RuntimeError(f"no free pod IP left in {self.network}")

    def release(self, ip: str) -> None:
        with self.lock:
            self.used.discard(ip)


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        from kubernetes import client, config

        self.api_client: Any = config.new_client_from_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
        self.kube = Kube(self.api_client)
        # dict bodies throughout: the client's typed models are not used
        self.core: Any = client.CoreV1Api(self.api_client)
        self.coordination: Any = client.CoordinationV1Api(self.api_client)
        self.ApiException = client.ApiException
        self.nodes = [f"run-node-{i}" for i in range(args.nodes)]
        self.addresses = Addresses(args.cidr)
        state = Path(args.state_dir)
        self.config = RunnerConfig(
            state_dir=state,
            logs=Path(args.logs),
            shim_dir=state / "bin",
            apiserver_port=args.apiserver_port,
            host_ip=args.host_ip,
            allocatable=ALLOCATABLE,
        )
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    # ------------------------------------------------------------------ setup

    def write_shims(self) -> None:
        """``pdserve`` and ``vllm`` first on every container's PATH, so rendered commands run as rendered."""
        shim = self.config.shim_dir
        shim.mkdir(parents=True, exist_ok=True)
        venv_bin = Path(sys.executable).parent
        pdserve = shim / "pdserve"
        pdserve.unlink(missing_ok=True)
        pdserve.symlink_to(venv_bin / "pdserve")
        vllm = shim / "vllm"
        vllm.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pdserve.sim.vllm_cli "$@"\n')
        vllm.chmod(0o755)

    def node_object(self, name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "type": "runner",
                    "kubernetes.io/arch": "amd64",
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/hostname": name,
                    "node-role.kubernetes.io/agent": "",
                    "pdserve.io/pod-runner": "true",
                },
            },
            "status": {
                "capacity": ALLOCATABLE,
                "allocatable": ALLOCATABLE,
                "conditions": self.conditions(True),
                "addresses": [
                    {"type": "InternalIP", "address": self.config.host_ip},
                    {"type": "Hostname", "address": name},
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "pdserve-pod-runner",
                    "kubeProxyVersion": "",
                    "containerRuntimeVersion": "pdserve-pod-runner://local-processes",
                    "osImage": "",
                    "kernelVersion": os.uname().release,
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                },
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            },
        }

    def conditions(self, ready: bool, transition: bool = True) -> list[dict[str, Any]]:
        now = _now()

        def cond(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
            out = {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
            }
            if transition:
                out["lastTransitionTime"] = now
            return out

        return [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "pod runner"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "pod runner"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "pod runner"),
            cond(
                "Ready",
                "True" if ready else "False",
                "KubeletReady" if ready else "KubeletNotReady",
                "pod runner is posting ready status" if ready else "pod runner stopped",
            ),
        ]

    def register(self) -> None:
        for name in self.nodes:
            body = self.node_object(name)
            try:
                self.core.create_node(body)
                log.info("registered node %s", name)
            except self.ApiException as exc:
                if exc.status != 409:
                    raise
                meta = {"labels": body["metadata"]["labels"], "annotations": {"kwok.x-k8s.io/node": None}}
                self.core.patch_node(name, {"metadata": meta})
                self.core.patch_node_status(name, {"status": body["status"]})
                log.info("node %s exists; updated it", name)

    def heartbeat(self, ready: bool = True) -> None:
        for name in self.nodes:
            try:
                # Merged by type; lastTransitionTime only when Ready flips (shutdown).
                conditions = self.conditions(ready, transition=not ready)
                self.core.patch_node_status(name, {"status": {"conditions": conditions}})
                self.renew_lease(name)
            except Exception as exc:
                log.warning("heartbeat of %s failed: %s", name, exc)

    def renew_lease(self, name: str) -> None:
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _micro_now()}
        try:
            self.coordination.patch_namespaced_lease(name, "kube-node-lease", {"spec": spec})
        except self.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.core.read_node(name)
            owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid}
            body = {"metadata": {"name": name, "ownerReferences": [owner]}, "spec": spec}
            self.coordination.create_namespaced_lease("kube-node-lease", body)

    # ------------------------------------------------------------------ pods

    def handle(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.gone.set()
                return
            if worker is not None:
                worker.update(pod)
                return
            if uid in self.finished or self.stop.is_set():
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):  # finished (before a runner restart): never rerun
                if pod["metadata"].get("deletionTimestamp"):
                    self.kube.delete(pod)  # nothing runs for it any more
                return
            preferred = (pod.get("status") or {}).get("podIP")
            worker = PodWorker(pod, self.addresses.take(preferred), self.kube, self.config, self.worker_done)
            self.workers[uid] = worker
        worker.start()

    def worker_done(self, uid: str) -> None:
        with self.lock:
            worker = self.workers.pop(uid, None)
            self.finished.add(uid)
        if worker is not None:
            self.addresses.release(worker.pod_ip)

    def watch_node(self, node: str) -> None:
        from kubernetes import watch

        selector = f"spec.nodeName={node}"
        version: str | None = None
        while not self.stop.is_set():
            try:
                if version is None:
                    listed = self.core.list_pod_for_all_namespaces(field_selector=selector)
                    version = listed.metadata.resource_version
                    present = set()
                    for item in listed.items:
                        pod = self.api_client.sanitize_for_serialization(item)
                        present.add(pod["metadata"]["uid"])
                        self.handle("MODIFIED", pod)
                    with self.lock:
                        lost = [w for w in self.workers.values() if w.node == node and w.uid not in present]
                    for w in lost:
                        w.gone.set()
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=60,
                )
                for event in stream:
                    obj = event["raw_object"]
                    if event["type"] == "ERROR":
                        version = None
                        break
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self.handle(event["type"], obj)
                    if self.stop.is_set():
                        break
            except self.ApiException as exc:
                if exc.status == 410:
                    version = None
                else:
                    log.warning("watch of pods on %s: %s %s", node, exc.status, exc.reason)
                    time.sleep(1.0)
            except Exception as exc:
                log.warning("watch of pods on %s: %r", node, exc)
                time.sleep(1.0)

    # ------------------------------------------------------------------ main

    def run(self) -> None:
        killed = kill_leftovers(self.config.state_dir / "pids")
        if killed:
            log.info("killed %d process groups left by an earlier runner", killed)
        self.write_shims()
        self.register()
        self.heartbeat()
        for node in self.nodes:
            threading.Thread(target=self.watch_node, args=(node,), name=f"watch-{node}", daemon=True).start()
        log.info("pod runner ready: nodes %s, pod IPs from %s", ", ".join(self.nodes), self.addresses.network)
        while not self.stop.wait(HEARTBEAT):
            self.heartbeat()
        log.info("stopping: killing the containers of %d pods", len(self.workers))
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.shutdown.set()
        for w in workers:
            w.join(timeout=10)
        self.heartbeat(ready=False)
        log.info("pod runner stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="podrunner", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", required=True, help="pid files, volumes, shims (.cluster/runner)")
    parser.add_argument("--logs", required=True, help="log directory (.cluster/logs); pods/ under it")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cidr", default="127.128.128.0/17")
    parser.add_argument("--apiserver-port", type=int, required=True)
    parser.add_argument("--host-ip", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout, force=True
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    runner = Runner(args)

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("received signal %d", signum)
        runner.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
