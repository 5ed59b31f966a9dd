"""The operator as tests run it: a ``pdserve operator`` subprocess against the test cluster, kubectl
for one namespace, and a recorder of every pod and routing-ConfigMap version.

Registered as a pytest plugin (tests/conftest.py), so the ``pdd_crd``, ``operator``, ``cluster``
and ``recorder`` fixtures reach every cluster test module without imports.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.routing.table import RoutingTable, load_routing_table
from tests.support.kube import REPO, KubeCluster, eventually
from tests.support.procs import free_ports, running, spawn_pdserve
from tests.support.specs import vllm_manifest

WAIT = 60.0


def pdd_manifest(
    name: str,
    *,
    prefill_instances: int = 1,
    prefill_dp: int = 2,
    decode_instances: int = 2,
    decode_tp: int = 1,
    decode_args: list[str] | None = None,
    drain_seconds: int = 1,
    max_unavailable: int = 1,
    max_surge: int = 1,
    silent_router: bool = False,
) -> dict[str, Any]:
    """An ``engine: vllm`` deployment: its GPU pods land on kwok's nodes (Ready, nothing runs);
    its router pod asks for no GPU and really runs on the pod runner's node, unless
    ``silent_router`` pins it to a kwok node too, where it is Ready but never answers (so drains
    end at the ``drainSeconds`` bound)."""
    return vllm_manifest(
        name,
        model="Qwen/Qwen2.5-0.5B-Instruct",
        prefill={"instances": prefill_instances, "dataParallel": prefill_dp, "tensorParallel": 1},
        decode={
            "instances": decode_instances,
            "dataParallel": 1,
            "tensorParallel": decode_tp,
            "args": decode_args or [],
        },
        rollout={"maxUnavailable": max_unavailable, "maxSurge": max_surge, "drainSeconds": drain_seconds},
        router={"template": {"spec": KWOK_PLACEMENT}} if silent_router else None,
    )


#: Places a pod that asks for no GPU on a kwok node anyway.
KWOK_PLACEMENT: dict[str, Any] = {
    "nodeSelector": {"type": "kwok"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pdd_crd(kube_cluster: KubeCluster) -> KubeCluster:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube_cluster.wait_established("pddeployments.pdserve.io", timeout=60)
    return kube_cluster


@dataclass
class Operator:
    """``pdserve operator`` for one namespace, electing its leader through a Lease in that namespace
    (each test has its own namespace, so a killed operator never makes the next test wait).

    ``pod_name`` is the identity's prefix (POD_NAME, as the chart sets it); ``extra_args`` go last
    (election timings, a Lease name).
    """

    kubeconfig: Path
    namespace: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    pod_name: str = "operator"
    extra_args: list[str] = field(default_factory=list)

    def start(self) -> None:
        liveness, self.metrics_port = free_ports(2)
        args = [
            "operator",
            "--namespace",
            self.namespace,
            "--liveness-port",
            str(liveness),
            "--metrics-port",
            str(self.metrics_port),
            "--bind",
            "127.0.0.1",
            "--resync-seconds",
            "2",
            "--log-format",
            "json",
            "--leader-election-namespace",
            self.namespace,
            *self.extra_args,
        ]
        env = {"KUBECONFIG": str(self.kubeconfig), "POD_NAME": self.pod_name}
        self.proc = spawn_pdserve(args, self.log_path, env, append=True)  # a restart logs after the first run
        proc = self.proc

        def alive() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"operator exited with {proc.returncode}:\n{self.log()}")
            with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2) as r:
                return bool(r.status == 200)

        eventually(alive, timeout=WAIT, message="operator liveness endpoint")

    def stop(self) -> int:
        """SIGTERM, as Kubernetes stops a pod; returns the exit code (at once if it has exited)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"operator did not stop within 30 s of SIGTERM:\n{self.log()}") from None

    def metric(self, name: str) -> float:
        return sum(self.samples(name).values())

    def samples(self, name: str) -> dict[str, float]:
        """Every sample of the metric family ``name``: the sample line's name and labels -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_logged(self, text: str, message: str, timeout: float = 10.0) -> None:
        """Until ``text`` stands anywhere in the log (not only in its tail)."""
        eventually(
            lambda: text in self.log_path.read_text(errors="replace"), timeout=timeout, message=message
        )


@pytest.fixture
def operator(pdd_crd: KubeCluster, kube_namespace: str, tmp_path: Path) -> Iterator[Operator]:
    with running(Operator(pdd_crd.kubeconfig, kube_namespace, tmp_path / "operator.log")) as op:
        yield op


class Cluster:
    """kubectl for one namespace, with the reads the tests need."""

    def __init__(self, kube: KubeCluster, namespace: str) -> None:
        self.kube = kube
        self.ns = namespace

    def kubectl(self, *args: object, input: str | None = None, check: bool = True) -> str:
        return self.kube.kubectl(*args, "-n", self.ns, input=input, check=check).stdout

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kube.apply(json.dumps(manifest), namespace=self.ns)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        out = self.kube.kubectl("get", kind, name, "-n", self.ns, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def pods(self, name: str) -> list[dict[str, Any]]:
        """Instance pods (the router's pods have no role label)."""
        out = self.kubectl("get", "pods", "-l", f"pdserve.io/deployment={name},pdserve.io/role", "-o", "json")
        return list(json.loads(out)["items"])

    def instance(self, instance: str) -> dict[str, Any] | None:
        """The live pod of ``<deployment>-<role>-<index>`` (its name has a random suffix)."""
        deployment = instance.rsplit("-", 2)[0]
        live = [
            p
            for p in self.pods(deployment)
            if instance_of(p["metadata"]["name"]) == instance and not p["metadata"].get("deletionTimestamp")
        ]
        live.sort(key=lambda p: str(p["metadata"]["creationTimestamp"]))
        return live[-1] if live else None

    def instance_name(self, instance: str) -> str:
        pod = self.instance(instance)
        assert pod is not None, f"no live pod of instance {instance}"
        return str(pod["metadata"]["name"])

    def table(self, name: str) -> RoutingTable | None:
        cm = self.get("configmap", f"{name}-routing")
        return load_routing_table(cm["data"]["routing.json"]) if cm else None

    def status(self, name: str) -> dict[str, Any]:
        obj = self.get("pdd", name)
        return dict((obj or {}).get("status") or {})

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for c in self.status(name).get("conditions", []):
            if c["type"] == kind:
                return dict(c)
        return {}


@pytest.fixture
def cluster(pdd_crd: KubeCluster, kube_namespace: str) -> Cluster:
    return Cluster(pdd_crd, kube_namespace)


def ready(cluster: Cluster, name: str) -> bool:
    return cluster.condition(name, "Ready").get("status") == "True"


def routable(table: RoutingTable | None, role: str) -> list[str]:
    """The routable instances of a role, by instance (pod name without its suffix)."""
    if table is None:
        return []
    return [instance_of(i.name) for i in (table.prefill if role == "prefill" else table.decode) if i.routable]


def instance_of(pod_name: str) -> str:
    """``<deployment>-<role>-<index>`` of a pod named ``<deployment>-<role>-<index>-<suffix>``."""
    return re.sub(r"-[bcdfghjklmnpqrstvwxz2456789]{5}$", "", pod_name)


def events(on: Cluster, name: str, reason: str) -> list[str]:
    """Messages of the Events with this reason on object ``name``."""
    out = on.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json")
    return [e["message"] for e in json.loads(out)["items"] if e["reason"] == reason]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


# --- a recorder of every pod and ConfigMap version ----------------------------------------------


@dataclass
class Record:
    kind: str  # "pod" | "table"
    type: str  # ADDED | MODIFIED | DELETED
    name: str
    obj: dict[str, Any]
    # The object's resourceVersion: the etcd revision, one order across both watch streams. Arrival
    # order is not: under load the pod watch can lag the ConfigMap watch by several events.
    seq: int = 0


@dataclass
class Recorder:
    """Watches pods and the routing ConfigMap of one namespace in background threads."""

    kube_api: Any
    namespace: str
    records: list[Record] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.kube_api)
        ready = threading.Barrier(3)
        for kind, lister in (("pod", core.list_namespaced_pod), ("table", core.list_namespaced_config_map)):
            t = threading.Thread(target=self._watch, args=(kind, lister, ready), daemon=True)
            t.start()
            self._threads.append(t)
        ready.wait(timeout=30)

    def _watch(self, kind: str, lister: Any, ready: threading.Barrier) -> None:
        from kubernetes import watch

        make_watch: Any = watch.Watch

        initial = lister(self.namespace, _preload_content=False)
        version = json.loads(initial.data)["metadata"]["resourceVersion"]
        ready.wait(timeout=30)
        while not self._stop.is_set():
            w = make_watch()
            try:
                for ev in w.stream(lister, self.namespace, resource_version=version, timeout_seconds=5):
                    obj = self.kube_api.sanitize_for_serialization(ev["object"])
                    version = obj["metadata"]["resourceVersion"]
                    with self._lock:
                        self.records.append(
                            Record(kind, ev["type"], obj["metadata"]["name"], obj, int(version))
                        )
                    if self._stop.is_set():
                        break
            except Exception:
                if self._stop.is_set():
                    return
                time.sleep(0.2)

    def stop(self) -> list[Record]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        with self._lock:
            return list(self.records)


@pytest.fixture
def recorder(kube_api: Any, kube_namespace: str) -> Iterator[Recorder]:
    with running(Recorder(kube_api, kube_namespace)) as rec:
        yield rec


def tables(records: list[Record]) -> list[tuple[int, RoutingTable]]:
    return [
        (r.seq, load_routing_table(r.obj["data"]["routing.json"]))
        for r in records
        if r.kind == "table" and r.type != "DELETED" and (r.obj.get("data") or {}).get("routing.json")
    ]


def table_before(records: list[Record], seq: int) -> RoutingTable | None:
    earlier = [t for s, t in tables(records) if s < seq]
    return earlier[-1] if earlier else None
