"""The operator against the real control plane (kwok makes pods Running and Ready with IPs).

Each test runs ``pdserve operator --namespace <its namespace>`` as a subprocess, as users run it,
which also lets a test restart it. Rollouts are watched through the API (every version of every
pod and of the routing ConfigMap) and the rules are checked on that record, not on timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
from tests.support.procs import free_port

pytestmark = pytest.mark.cluster

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
) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "image": "vllm/vllm-openai:v0.11.0",
            "engine": "vllm",
            "kvTransfer": {"connector": "NixlConnector"},
            "prefill": {"instances": prefill_instances, "dataParallel": prefill_dp, "tensorParallel": 1},
            "decode": {
                "instances": decode_instances,
                "dataParallel": 1,
                "tensorParallel": decode_tp,
                "args": decode_args or [],
            },
            "rollout": {"maxUnavailable": max_unavailable, "drainSeconds": drain_seconds},
        },
    }


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pdd_crd(kube_cluster: KubeCluster) -> KubeCluster:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/pddeployments.pdserve.io", "--timeout=60s", timeout=90
    )
    return kube_cluster


@dataclass
class Operator:
    kubeconfig: Path
    namespace: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0

    def start(self) -> None:
        liveness = free_port()
        self.metrics_port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
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
        ]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc

        def alive() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"operator exited with {proc.returncode}:\n{self.log()}")
            with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2) as r:
                return bool(r.status == 200)

        eventually(alive, timeout=WAIT, message="operator liveness endpoint")

    def stop(self) -> int:
        """SIGTERM, as Kubernetes stops a pod; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"operator did not stop within 30 s of SIGTERM:\n{self.log()}") from None

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@pytest.fixture
def operator(pdd_crd: KubeCluster, kube_namespace: str, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(pdd_crd.kubeconfig, kube_namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        if op.proc is not None and op.proc.poll() is None:
            op.stop()


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
    if table is None:
        return []
    return [i.name for i in (table.prefill if role == "prefill" else table.decode) if i.routable]


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
    rec = Recorder(kube_api, kube_namespace)
    rec.start()
    try:
        yield rec
    finally:
        rec.stop()


def tables(records: list[Record]) -> list[tuple[int, RoutingTable]]:
    return [
        (r.seq, load_routing_table(r.obj["data"]["routing.json"]))
        for r in records
        if r.kind == "table" and r.type != "DELETED" and (r.obj.get("data") or {}).get("routing.json")
    ]


def table_before(records: list[Record], seq: int) -> RoutingTable | None:
    earlier = [t for s, t in tables(records) if s < seq]
    return earlier[-1] if earlier else None


# --- tests ---------------------------------------------------------------------------------------


def test_apply_renders_pods_table_status_and_printer_columns(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("demo", prefill_dp=2, decode_instances=2, decode_tp=2))
    eventually(lambda: ready(cluster, "demo"), timeout=WAIT, message="Ready=True")

    pods = {p["metadata"]["name"]: p for p in cluster.pods("demo")}
    assert sorted(pods) == ["demo-decode-0", "demo-decode-1", "demo-prefill-0"]
    prefill = pods["demo-prefill-0"]["spec"]["containers"][0]
    argv = [*prefill.get("command", []), *prefill.get("args", [])]
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "2"
    decode = pods["demo-decode-0"]["spec"]["containers"][0]
    dargv = [*decode.get("command", []), *decode.get("args", [])]
    assert dargv[dargv.index("--tensor-parallel-size") + 1] == "2"
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == "2"
    for pod in pods.values():
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("PDDeployment", "demo", True)

    table = cluster.table("demo")
    assert table is not None
    ips = {name: p["status"]["podIP"] for name, p in pods.items()}
    assert [(i.name, i.url, i.dp_size, i.routable) for i in table.prefill] == [
        ("demo-prefill-0", f"http://{ips['demo-prefill-0']}:8000", 2, True)
    ]
    assert [(i.name, i.url, i.routable) for i in table.decode] == [
        ("demo-decode-0", f"http://{ips['demo-decode-0']}:8000", True),
        ("demo-decode-1", f"http://{ips['demo-decode-1']}:8000", True),
    ]

    status = cluster.status("demo")
    assert status["observedGeneration"] == cluster.get("pdd", "demo")["metadata"]["generation"]  # type: ignore[index]
    assert status["routingGeneration"] == table.generation
    assert (status["prefill"]["slots"], status["prefill"]["readySlots"]) == (2, 2)
    assert (status["decode"]["readyInstances"], status["decode"]["summary"]) == (2, "2/2")
    assert status["decode"]["selector"] == "pdserve.io/deployment=demo,pdserve.io/role=decode"

    columns = cluster.kubectl("get", "pdd", "demo", "--no-headers").split()
    assert columns[:6] == ["demo", "True", "1/1", "2/2", "2", "2"]

    for kind, name in (("service", "demo"), ("service", "demo-engines"), ("deployment", "demo-router")):
        obj = cluster.get(kind, name)
        assert obj is not None, f"{kind} {name} missing"
        assert obj["metadata"]["ownerReferences"][0]["name"] == "demo"

    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=demo", "-o", "json")
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Created", "Ready"} <= reasons


def test_repeated_reconciles_change_nothing(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("idle"))
    eventually(lambda: ready(cluster, "idle"), timeout=WAIT, message="Ready=True")

    def versions() -> dict[str, str]:
        objs = [*cluster.pods("idle")]
        for kind, name in (
            ("configmap", "idle-routing"),
            ("pdd", "idle"),
            ("service", "idle"),
            ("deployment", "idle-router"),
        ):
            obj = cluster.get(kind, name)
            assert obj is not None
            objs.append(obj)
        return {f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in objs}

    # Let the router's own status settle (its Deployment status is written by the controller-manager).
    eventually(lambda: (v := versions()) == versions() and v, timeout=WAIT, message="quiet cluster")
    before = versions()
    reconciles = operator.metric("pdserve_operator_reconciles_total")
    eventually(
        lambda: operator.metric("pdserve_operator_reconciles_total") >= reconciles + 3,
        timeout=WAIT,
        message="three resyncs",
    )
    assert versions() == before


def test_unready_pod_leaves_the_table_and_comes_back(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("flaky", decode_instances=2))
    eventually(lambda: ready(cluster, "flaky"), timeout=WAIT, message="Ready=True")
    generation = cluster.table("flaky").generation  # type: ignore[union-attr]

    def set_ready(value: str) -> None:
        patch = {"status": {"conditions": [{"type": "Ready", "status": value}]}}
        cluster.kubectl("patch", "pod", "flaky-decode-1", "--subresource=status", "-p", json.dumps(patch))

    set_ready("False")
    eventually(
        lambda: routable(cluster.table("flaky"), "decode") == ["flaky-decode-0"],
        timeout=WAIT,
        message="decode-1 out of the table",
    )
    out = cluster.table("flaky")
    assert out is not None and out.generation > generation
    assert [(i.name, i.ready) for i in out.decode] == [("flaky-decode-0", True), ("flaky-decode-1", False)]
    eventually(
        lambda: cluster.status("flaky")["decode"]["readyInstances"] == 1, timeout=WAIT, message="status"
    )
    assert cluster.condition("flaky", "Ready")["status"] == "False"

    set_ready("True")
    eventually(
        lambda: routable(cluster.table("flaky"), "decode") == ["flaky-decode-0", "flaky-decode-1"],
        timeout=WAIT,
        message="decode-1 back in the table",
    )
    eventually(lambda: ready(cluster, "flaky"), timeout=WAIT, message="Ready again")


def test_deleted_pod_is_recreated(operator: Operator, cluster: Cluster, recorder: Recorder) -> None:
    cluster.apply(pdd_manifest("phoenix", decode_instances=2))
    eventually(lambda: ready(cluster, "phoenix"), timeout=WAIT, message="Ready=True")
    old_uid = cluster.get("pod", "phoenix-decode-0")["metadata"]["uid"]  # type: ignore[index]
    cluster.kubectl("delete", "pod", "phoenix-decode-0", "--wait=false")

    def recreated() -> bool:
        pod = cluster.get("pod", "phoenix-decode-0")
        return bool(pod and pod["metadata"]["uid"] != old_uid and pod_ready(pod))

    eventually(recreated, timeout=WAIT, message="a new phoenix-decode-0, Ready")
    eventually(
        lambda: routable(cluster.table("phoenix"), "decode") == ["phoenix-decode-0", "phoenix-decode-1"],
        timeout=WAIT,
        message="the new pod in the table",
    )
    records = recorder.stop()
    # Between the deletion and the new pod's readiness, some table showed decode-0 not routable.
    assert any(
        "phoenix-decode-0" not in routable(t, "decode") for _, t in tables(records) if routable(t, "decode")
    )


def test_kubectl_scale_changes_decode_instances(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    cluster.apply(pdd_manifest("elastic", decode_instances=2))
    eventually(lambda: ready(cluster, "elastic"), timeout=WAIT, message="Ready=True")

    cluster.kubectl("scale", "pdd", "elastic", "--replicas", "3")
    eventually(
        lambda: routable(cluster.table("elastic"), "decode") == [f"elastic-decode-{i}" for i in range(3)],
        timeout=WAIT,
        message="three decode instances routable",
    )
    eventually(lambda: ready(cluster, "elastic"), timeout=WAIT, message="Ready at 3")
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/pdserve.io/v1alpha1/namespaces/{cluster.ns}/pddeployments/elastic/scale"
        )
    )
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "pdserve.io/deployment=elastic,pdserve.io/role=decode"

    cluster.kubectl("scale", "pdd", "elastic", "--replicas", "1")
    eventually(
        lambda: (
            [p["metadata"]["name"] for p in cluster.pods("elastic") if "decode" in p["metadata"]["name"]]
            == ["elastic-decode-0"]
        ),
        timeout=WAIT,
        message="scaled down to one decode pod",
    )
    eventually(lambda: ready(cluster, "elastic"), timeout=WAIT, message="Ready at 1")
    records = recorder.stop()
    # Highest index first, each drained (marked in the table) before its deletion.
    deletions = [
        r
        for r in records
        if r.kind == "pod" and r.type == "MODIFIED" and r.obj["metadata"].get("deletionTimestamp")
    ]
    first: dict[str, int] = {}
    for r in deletions:
        first.setdefault(r.name, r.seq)
    assert sorted(first, key=first.__getitem__) == ["elastic-decode-2", "elastic-decode-1"]
    for name, seq in first.items():
        table = table_before(records, seq)
        assert table is not None
        entry = {i.name: i for i in table.decode}[name]
        assert entry.draining, f"{name} deleted without being drained first"


def test_template_change_rolls_one_instance_at_a_time(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    cluster.apply(pdd_manifest("roll", decode_instances=3))
    eventually(lambda: ready(cluster, "roll"), timeout=WAIT, message="Ready=True")
    prefill_uid = cluster.get("pod", "roll-prefill-0")["metadata"]["uid"]  # type: ignore[index]
    old_hash = cluster.status("roll")["decode"]["templateHash"]
    start = len(recorder.records)

    cluster.apply(pdd_manifest("roll", decode_instances=3, decode_args=["--max-num-seqs", "64"]))

    def rolled() -> bool:
        pods = [p for p in cluster.pods("roll") if p["metadata"]["labels"]["pdserve.io/role"] == "decode"]
        hashes = {p["metadata"]["labels"]["pdserve.io/template-hash"] for p in pods}
        return (
            len(pods) == 3
            and old_hash not in hashes
            and all(pod_ready(p) for p in pods)
            and ready(cluster, "roll")
        )

    eventually(rolled, timeout=90, message="decode rolled to the new template")
    records = recorder.stop()[start:]

    # Every pod deletion came after a table that marked it draining.
    deleted: dict[str, int] = {}
    for r in records:
        if r.kind == "pod" and r.obj["metadata"].get("deletionTimestamp"):
            deleted.setdefault(r.name, r.seq)
    assert sorted(deleted) == ["roll-decode-0", "roll-decode-1", "roll-decode-2"]
    for name, seq in deleted.items():
        table = table_before(records, seq)
        assert table is not None and {i.name: i for i in table.decode}[name].draining, name
    # Never more than maxUnavailable (1) decode instance missing or unroutable, never an empty role.
    for _, table in tables(records):
        assert len(routable(table, "decode")) >= 2, table
        assert routable(table, "prefill") == ["roll-prefill-0"]
    # One replacement at a time, highest index first.
    assert sorted(deleted, key=deleted.__getitem__) == ["roll-decode-2", "roll-decode-1", "roll-decode-0"]
    # The prefill pod was never touched.
    assert cluster.get("pod", "roll-prefill-0")["metadata"]["uid"] == prefill_uid  # type: ignore[index]
    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=roll", "-o", "json")
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert reasons.count("Draining") >= 3 and reasons.count("Deleted") >= 3


def test_data_parallel_change_advertises_each_pods_own_size(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    """DP2 -> DP4: while old pods serve, the table must say 2 for them (ranks 2-3 would be refused)."""
    cluster.apply(pdd_manifest("regrow", prefill_instances=2, prefill_dp=2))
    eventually(lambda: ready(cluster, "regrow"), timeout=WAIT, message="Ready=True")
    start = len(recorder.records)
    cluster.apply(pdd_manifest("regrow", prefill_instances=2, prefill_dp=4))

    def rolled() -> bool:
        pods = [p for p in cluster.pods("regrow") if p["metadata"]["labels"]["pdserve.io/role"] == "prefill"]
        return (
            len(pods) == 2
            and all(p["metadata"]["annotations"]["pdserve.io/dp-size"] == "4" for p in pods)
            and ready(cluster, "regrow")
        )

    eventually(rolled, timeout=90, message="prefill rolled to DP4")
    records = recorder.stop()

    def created_with(pod: dict[str, Any]) -> int:
        container = pod["spec"]["containers"][0]
        args = container["args"]
        from_args = int(args[args.index("--data-parallel-size") + 1])
        assert pod["metadata"]["annotations"]["pdserve.io/dp-size"] == str(from_args)
        return from_args

    mixed = False  # a table listing an old DP2 pod next to a new DP4 one
    for seq, table in tables(records[start:]):
        routable_sizes = []
        for entry in table.prefill:
            ip = entry.url.removeprefix("http://").rsplit(":", 1)[0]
            versions = [
                r.obj
                for r in records
                if r.kind == "pod"
                and r.seq < seq
                and r.name == entry.name
                and (r.obj.get("status") or {}).get("podIP") == ip
            ]
            assert versions, f"table at {seq} lists {entry.name} at {ip}, a pod never seen"
            assert entry.dp_size == created_with(versions[-1]), (seq, entry)
            if entry.routable:
                routable_sizes.append(entry.dp_size)
        mixed = mixed or {i.dp_size for i in table.prefill} == {2, 4}
        assert routable_sizes, f"no routable prefill instance in the table at {seq}"
    assert mixed, "no table listed an old DP2 and a new DP4 pod side by side"
    status = cluster.status("regrow")
    assert (status["prefill"]["slots"], status["prefill"]["readySlots"]) == (8, 8)


def test_restart_mid_rollout_creates_no_duplicate_and_finishes(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    cluster.apply(pdd_manifest("phoenix2", decode_instances=3, drain_seconds=3))
    eventually(lambda: ready(cluster, "phoenix2"), timeout=WAIT, message="Ready=True")
    old_hash = cluster.status("phoenix2")["decode"]["templateHash"]
    start = len(recorder.records)
    cluster.apply(
        pdd_manifest("phoenix2", decode_instances=3, drain_seconds=3, decode_args=["--max-num-seqs", "8"])
    )

    def draining() -> bool:
        pod = cluster.get("pod", "phoenix2-decode-2")
        return bool(pod and "pdserve.io/draining-since" in (pod["metadata"].get("annotations") or {}))

    eventually(draining, timeout=WAIT, message="the first drain")
    assert operator.stop() == 0  # graceful on SIGTERM
    operator.start()

    def rolled() -> bool:
        pods = [p for p in cluster.pods("phoenix2") if p["metadata"]["labels"]["pdserve.io/role"] == "decode"]
        hashes = {p["metadata"]["labels"]["pdserve.io/template-hash"] for p in pods}
        return len(pods) == 3 and old_hash not in hashes and ready(cluster, "phoenix2")

    eventually(rolled, timeout=90, message="the rollout finished after the restart")
    records = recorder.stop()[start:]
    created = [r.name for r in records if r.kind == "pod" and r.type == "ADDED"]
    # Each decode index replaced exactly once: no duplicate create, no second replacement.
    assert sorted(created) == ["phoenix2-decode-0", "phoenix2-decode-1", "phoenix2-decode-2"]
    for _, table in tables(records):
        assert len(routable(table, "decode")) >= 2


def test_deleting_the_pddeployment_removes_everything(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("gone"))
    eventually(lambda: ready(cluster, "gone"), timeout=WAIT, message="Ready=True")
    cluster.kubectl("delete", "pdd", "gone", "--wait=false")

    def nothing_left() -> bool:
        out = cluster.kubectl(
            "get",
            "pods,services,deployments,replicasets,configmaps",
            "-l",
            "pdserve.io/deployment=gone",
            "-o",
            "name",
        )
        return out.strip() == ""

    eventually(nothing_left, timeout=WAIT, message="garbage collection of every owned object")
    assert cluster.get("pdd", "gone") is None


def test_spec_beyond_any_node_is_degraded_and_renders_nothing(operator: Operator, cluster: Cluster) -> None:
    manifest = pdd_manifest("huge", prefill_dp=16)  # 16 GPUs per instance; the nodes have 8
    cluster.apply(manifest)

    def degraded() -> dict[str, Any]:
        c = cluster.condition("huge", "Degraded")
        return c if c.get("status") == "True" else {}

    condition = degraded() or eventually(degraded, timeout=WAIT, message="Degraded=True")
    assert condition["reason"] == "InvalidSpec"
    assert "16 nvidia.com/gpu" in condition["message"] and "largest node has 8" in condition["message"]
    assert cluster.condition("huge", "Ready")["status"] == "False"
    out = cluster.kubectl(
        "get", "pods,services,deployments,configmaps", "-l", "pdserve.io/deployment=huge", "-o", "name"
    )
    assert out.strip() == ""
    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=huge", "-o", "json")
    assert any(
        e["type"] == "Warning" and "largest node has 8" in e["message"] for e in json.loads(events)["items"]
    )

    # Fixing the spec renders it.
    cluster.apply(pdd_manifest("huge", prefill_dp=8))
    eventually(lambda: ready(cluster, "huge"), timeout=WAIT, message="Ready once fixed")
    assert cluster.condition("huge", "Degraded")["status"] == "False"
