"""Operator benchmark on the test cluster: N PDDeployments at once, beside the cluster's own floor.

Not a test: it prints figures next to their targets and writes
``bench/results/operator-<timestamp>.json`` and ``bench/results/operator-latest.md``. Run with
``make bench-operator`` (after ``make cluster-up``) or ``python -m bench.operator_bench``.

Shapes (``--shape``, each field overridable by its own flag, e.g. ``--decode-instances 3``):

* ``10pods``, the default (``make bench-operator``): issue 12 item 7's scale, 200 PDDeployments x
  (4 prefill DP2 + 5 decode TP1 + 1 router) = 2000 pods on 327 fake 8-GPU nodes. It fits the
  10 minutes of a benchmark on the 2-core test machine (about 7 minutes there, the cluster and
  other tests sharing it: floor ~2 min, operator ~2.5 min, idle 1 min, flips, cleanup ~1.5 min),
  so it is what ``make bench-operator`` runs.
* ``small``: the run before it, 50 PDDeployments x (2 prefill DP8 + 2 decode TP1 + 1 router) =
  250 pods on 114 nodes; ``python -m bench.operator_bench --shape small`` for a quicker look.

What it does:

1. registers kwok nodes for the run, sized from the shape: a prefill and a decode pool of
   ``--gpus-per-node`` GPU nodes and a router pool (100 pods a node). They carry the taint
   ``pdserve.io/bench-pool`` (tolerated only by the bench's pods, so nothing of a test sharing the
   cluster lands there) and the PDDeployments pin each role to its pool with ``nodeSelector``
   (no GPU fragmentation). kwok marks every pod Ready; nothing runs, routers included;
2. the floor the cluster alone imposes (``--floor``, on by default): the same number of plain
   pods, rendered by pdserve's own code (same nodeSelector, tolerations and GPU requests; the
   router pod from the router Deployment's template), created directly in a namespace of their
   own with no operator: create -> Ready per pod and per group of one deployment's pods. Then
   they are deleted (force, grace 0) and their namespace is waited away;
3. starts ``pdserve operator`` (this checkout's code: ``python -m pdserve.cli`` from the
   interpreter running the bench) and creates the N PDDeployments concurrently; per deployment,
   apply -> Ready with a complete routing table (Ready=True and every instance routable in the
   ConfigMap). Ratio of its p99 to the floor's p99 is the figure to compare across runs (the
   machine is shared: absolute times move with its load);
4. leaves everything alone for ``--idle-seconds``: the operator's steady-state load (resyncs,
   node listing) in API requests and CPU seconds;
5. flips pods' Ready condition (status subresource, one at a time and then one per deployment at
   once) and records readiness change -> the ConfigMap showing it;
6. records, for the operator process, peak RSS (VmHWM) and RSS at the end, CPU seconds
   (utime + stime from /proc/<pid>/stat) per phase, API requests by method and reconciles by
   result (from its /metrics) per phase;
7. deletes everything it created (namespaces, nodes), also on failure, Ctrl-C or SIGTERM.

The kubeconfig: ``--kubeconfig``, else ``$PDSERVE_TEST_KUBECONFIG``, else ``.cluster/kubeconfig``
of this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.support.specs import vllm_manifest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NAMESPACE = "pdserve-bench"
PLAIN_NAMESPACE = "pdserve-bench-plain"
POOL_LABEL = "pdserve.io/bench-pool"
BENCH_TAINT = {"key": POOL_LABEL, "value": "bench", "effect": "NoSchedule"}
TOLERATION = {"key": POOL_LABEL, "operator": "Exists", "effect": "NoSchedule"}
ROUTER_PODS_PER_NODE = 100
TARGETS = {"readiness_to_table_p99_s": 1.0, "apply_to_ready_p99_s": 10.0, "peak_rss_mb": 250.0}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- the shape -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One PDDeployment: instances x DP x TP per role, router replicas."""

    prefill_instances: int
    prefill_dp: int
    prefill_tp: int
    decode_instances: int
    decode_dp: int
    decode_tp: int
    router_replicas: int = 1

    @property
    def instances(self) -> int:
        return self.prefill_instances + self.decode_instances

    @property
    def pods(self) -> int:
        return self.instances + self.router_replicas

    def gpus(self, role: str) -> int:
        return self.prefill_dp * self.prefill_tp if role == "prefill" else self.decode_dp * self.decode_tp

    def count(self, role: str) -> int:
        return self.prefill_instances if role == "prefill" else self.decode_instances

    def describe(self) -> str:
        def role(n: int, dp: int, tp: int, name: str) -> str:
            size = f"DP{dp}" + (f"xTP{tp}" if tp > 1 else "") if dp > 1 else f"TP{tp}"
            return f"{n} {name} {size}"

        return (
            f"{role(self.prefill_instances, self.prefill_dp, self.prefill_tp, 'prefill')} + "
            f"{role(self.decode_instances, self.decode_dp, self.decode_tp, 'decode')} + "
            f"{self.router_replicas} router = {self.pods} pods"
        )


SHAPES = {
    "10pods": Shape(4, 2, 1, 5, 1, 1, 1),
    "small": Shape(2, 8, 1, 2, 1, 1, 1),
}
#: The deployments each named shape runs unless --deployments says otherwise.
SHAPE_DEPLOYMENTS = {"10pods": 200, "small": 50}
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Pool:
    name: str
    nodes: int
    gpus: int  # per node
    pods_per_node: int


def node_pools(shape: Shape, deployments: int, gpus_per_node: int) -> list[Pool]:
    pools = []
    for role in ROLES:
        gpus = shape.gpus(role)
        node_gpus = max(gpus_per_node, gpus)
        per_node = min(node_gpus // gpus, 100)
        pods = shape.count(role) * deployments
        pools.append(Pool(role, -(-pods // per_node), node_gpus, per_node))
    routers = shape.router_replicas * deployments
    pools.append(Pool("router", -(-routers // ROUTER_PODS_PER_NODE), 0, ROUTER_PODS_PER_NODE))
    return [p for p in pools if p.nodes]


# --- cluster access ------------------------------------------------------------------------------


def kubeconfig_path(explicit: str | None = None) -> Path:
    path = Path(explicit or os.environ.get("PDSERVE_TEST_KUBECONFIG") or REPO / ".cluster" / "kubeconfig")
    if not path.is_file():
        raise SystemExit(f"no kubeconfig at {path}: run `make cluster-up` first")
    return path


def kubectl_path() -> str:
    out = subprocess.run(
        [str(REPO / "hack" / "cluster" / "build"), "--print-bin"], capture_output=True, text=True, check=False
    )
    candidate = Path(out.stdout.strip()) / "kubectl" if out.returncode == 0 else None
    if candidate is not None and candidate.exists():
        return str(candidate)
    return "kubectl"


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.binary = kubectl_path()

    def __call__(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300) -> str:
        cmd = [self.binary, f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout


def source_commit() -> str:
    """The commit of this checkout (whose operator code the bench runs), "+dirty" with local edits."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "pdserve") else "")


def make_kube(kubeconfig: Path) -> Any:
    """pdserve's own thin client (dicts in and out) plus a raw watch: no generated models, which
    cost the bench process CPU the cluster and the operator need on a 2-core machine."""
    from pdserve.operator.cluster.kube import Kube

    class BenchKube(Kube):
        def watch(
            self, path: str, on_event: Callable[[str, dict[str, Any], float], None], stop: threading.Event
        ) -> None:
            version = ""
            while not stop.is_set():
                query = [("watch", "true"), ("timeoutSeconds", "5")]
                if version:
                    query.append(("resourceVersion", version))
                try:
                    _, url, headers, _, _ = self._api.param_serialize(
                        "GET", path, query_params=query, auth_settings=["BearerToken"]
                    )
                    response = self._api.call_api("GET", url, headers, None, None, (5, 30)).response
                    buffer = b""
                    for chunk in response.stream(65536, decode_content=True):
                        buffer += chunk
                        *lines, buffer = buffer.split(b"\n")
                        for line in lines:
                            if not line.strip():
                                continue
                            now = time.monotonic()
                            ev = json.loads(line)
                            if ev["type"] == "ERROR":
                                version = ""
                                continue
                            obj = ev["object"]
                            version = obj["metadata"]["resourceVersion"]
                            on_event(ev["type"], obj, now)
                        if stop.is_set():
                            response.release_conn()
                            return
                    response.release_conn()
                except Exception:
                    version = ""
                    time.sleep(0.2)

    return BenchKube(str(kubeconfig), pool_size=32)


def start_watch(
    kube: Any, path: str, on_event: Callable[[str, dict[str, Any], float], None], stop: threading.Event
) -> None:
    threading.Thread(target=kube.watch, args=(path, on_event, stop), daemon=True).start()


def node_manifests(pool: Pool, prefix: str = "bench") -> str:
    docs = []
    for i in range(pool.nodes):
        name = f"{prefix}-{pool.name}-{i}"
        resources = {"cpu": "96", "memory": "1Ti", "pods": str(pool.pods_per_node + 10)}
        if pool.gpus:
            resources["nvidia.com/gpu"] = str(pool.gpus)
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        POOL_LABEL: pool.name,
                    },
                },
                "spec": {"taints": [BENCH_TAINT]},
                "status": {"capacity": resources, "allocatable": resources},
            }
        )
    return "\n---\n".join(json.dumps(d) for d in docs)


def pdd_manifest(name: str, shape: Shape, drain_seconds: int, namespace: str = NAMESPACE) -> dict[str, Any]:
    def role(n: int, dp: int, tp: int, pool: str) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "instances": n,
            "dataParallel": dp,
            "tensorParallel": tp,
            "nodeSelector": {POOL_LABEL: pool},
            "tolerations": [TOLERATION],
        }
        if dp > 1:
            spec["expertParallel"] = True
        return spec

    return vllm_manifest(
        name,
        metadata={"namespace": namespace},
        model="deepseek-ai/DeepSeek-R1",
        prefill=role(shape.prefill_instances, shape.prefill_dp, shape.prefill_tp, "prefill"),
        decode=role(shape.decode_instances, shape.decode_dp, shape.decode_tp, "decode"),
        router={
            "replicas": shape.router_replicas,
            "template": {"spec": {"nodeSelector": {POOL_LABEL: "router"}, "tolerations": [TOLERATION]}},
        },
        rollout={"maxUnavailable": 1, "drainSeconds": drain_seconds},
    )


def plain_pods(group: int, shape: Shape, namespace: str) -> list[dict[str, Any]]:
    """The pods the operator would create for one PDDeployment, as pdserve renders them, unowned."""
    from pdserve.deployment.render.engine_pod import instance_pod
    from pdserve.deployment.render.router import router_deployment
    from pdserve.deployment.spec.parse import parse_pddeployment
    from pdserve.routing import Role

    pdd = parse_pddeployment(pdd_manifest(f"plain-{group:03d}", shape, 1, namespace))
    pods = []
    for role in ROLES:
        for index in range(shape.count(role)):
            pod = instance_pod(pdd, Role(role), index)
            pod["metadata"]["name"] = f"plain-{group:03d}-{role}-{index}"
            pods.append(pod)
    template = router_deployment(pdd)["spec"]["template"]
    for index in range(shape.router_replicas):
        spec = {**template["spec"], "serviceAccountName": "default"}  # no per-deployment account here
        meta = {**template["metadata"], "name": f"plain-{group:03d}-router-{index}"}
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    for pod in pods:
        pod["metadata"]["namespace"] = namespace
        pod["metadata"].pop("ownerReferences", None)
    return pods


def is_ready(obj: Mapping[str, Any]) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


# --- watching ------------------------------------------------------------------------------------


@dataclass
class Observed:
    """What the watch threads saw, with the local time each version arrived."""

    instances: int = 4  # prefill + decode instances of one deployment: a complete table routes all
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    ready_at: dict[str, float] = field(default_factory=dict)  # pdd -> first Ready=True
    complete_at: dict[str, float] = field(default_factory=dict)  # pdd -> first complete table
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # pdd -> latest table
    table_log: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    pod_ready_at: dict[str, float] = field(default_factory=dict)  # plain pod -> first Ready=True

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def seen_pdd(self, _type: str, obj: dict[str, Any], now: float) -> None:
        if is_ready(obj):
            with self.lock:
                self.ready_at.setdefault(obj["metadata"]["name"], now)
                self.changed.notify_all()

    def seen_table(self, _type: str, obj: dict[str, Any], now: float) -> None:
        text = (obj.get("data") or {}).get("routing.json")
        if not text:
            return
        table = json.loads(text)
        name = table["deployment"]
        routable = [i for role in ROLES for i in table[role] if i["ready"] and not i["draining"]]
        with self.lock:
            self.tables[name] = table
            self.table_log.append((now, name, table))
            if len(routable) == self.instances:
                self.complete_at.setdefault(name, now)
            self.changed.notify_all()

    def seen_pod(self, _type: str, obj: dict[str, Any], now: float) -> None:
        if is_ready(obj):
            with self.lock:
                self.pod_ready_at.setdefault(obj["metadata"]["name"], now)
                self.changed.notify_all()


def wait_until(observed: Observed, predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    with observed.lock:
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            observed.changed.wait(left)
    return True


# --- the operator process ------------------------------------------------------------------------


@contextmanager
def operator_process(
    kubeconfig: Path, log_path: Path, namespace: str = NAMESPACE
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    liveness, metrics = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "operator",
        "--namespace",
        namespace,
        "--leader-election-namespace",  # as deployed: elected, its Lease beside its PDDeployments
        namespace,
        "--bind",
        "127.0.0.1",
        "--liveness-port",
        str(liveness),
        "--metrics-port",
        str(metrics),
        "--log-format",
        "json",
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log_file, stderr=log_file
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"operator exited with {proc.returncode}; see {log_path}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"operator not live after 60 s; see {log_path}") from None
                    time.sleep(0.2)
            yield proc, metrics
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of proc(5)


def proc_memory_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (the kernel's peak RSS) of the process, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out.get("VmRSS", float("nan")), "peak_rss_mb": out.get("VmHWM", float("nan"))}


def scrape_labeled(port: int) -> dict[str, dict[str, float]]:
    """Every ``pdserve_operator_*`` sample: name -> {label string ("" if none) -> value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_operator_"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            out.setdefault(name, {})[labels.rstrip("}")] = float(value)
    return out


def scrape(port: int) -> dict[str, float]:
    """Every ``pdserve_operator_*`` sample summed over its labels (the JSON's ``operator_metrics``)."""
    return {name: sum(values.values()) for name, values in scrape_labeled(port).items()}


def by_label(metrics: Mapping[str, Mapping[str, float]], name: str, label: str) -> dict[str, float]:
    """One metric's values keyed by one label's value (``method="GET"`` -> ``GET``)."""
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, {}).items():
        key = ""
        for part in labels.split(","):
            k, _, v = part.partition("=")
            if k == label:
                key = v.strip('"')
        out[key] = out.get(key, 0.0) + value
    return out


@dataclass
class Snapshot:
    at: float
    cpu_s: float
    rss_mb: float
    metrics: dict[str, dict[str, float]]

    @classmethod
    def take(cls, pid: int, port: int) -> Snapshot:
        return cls(
            time.monotonic(), proc_cpu_seconds(pid), proc_memory_mb(pid)["rss_mb"], scrape_labeled(port)
        )

    def api_requests(self) -> dict[str, float]:
        return by_label(self.metrics, "pdserve_operator_api_request_seconds_count", "method")

    def reconciles(self) -> dict[str, float]:
        return by_label(self.metrics, "pdserve_operator_reconciles_total", "result")


def phase(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """What the operator did between two snapshots."""

    def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, int]:
        return {k: round(b[k] - a.get(k, 0.0)) for k in sorted(b) if round(b[k] - a.get(k, 0.0))}

    api = delta(before.api_requests(), after.api_requests())
    seconds = after.at - before.at
    return {
        "seconds": round(seconds, 1),
        "cpu_s": round(after.cpu_s - before.cpu_s, 2),
        "rss_mb_at_end": round(after.rss_mb, 1),
        "api_requests": api,
        "api_requests_total": sum(api.values()),
        "api_requests_per_s": round(sum(api.values()) / seconds, 2) if seconds > 0 else None,
        "reconciles": delta(before.reconciles(), after.reconciles()),
    }


# --- phases --------------------------------------------------------------------------------------


def create_all(kube: Any, count: int, shape: Shape, drain_seconds: int) -> dict[str, float]:
    started: dict[str, float] = {}

    def create(i: int) -> None:
        name = f"bench-{i:03d}"
        started[name] = time.monotonic()
        kube.create(pdd_manifest(name, shape, drain_seconds))

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(create, range(count)))
    return started


def instance_pods(api: Any, namespace: str) -> dict[str, str]:
    """``<deployment>-<role>-<index>`` -> the live pod's name (pods have a random suffix).

    ``api`` is a kubernetes ApiClient (the routing-lag bench) or pdserve's Kube (this bench).
    """
    if hasattr(api, "list_objects"):
        pods = api.list_objects("Pod", namespace, "pdserve.io/role")
        items = [(p["metadata"].get("deletionTimestamp"), p["metadata"]) for p in pods]
    else:
        from kubernetes import client

        listed = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="pdserve.io/role").items
        items = [
            (p.metadata.deletion_timestamp, {"name": p.metadata.name, "labels": p.metadata.labels})
            for p in listed
            if p.metadata is not None
        ]
    out = {}
    for deleting, meta in items:
        if deleting is None:
            labels = meta["labels"]
            parts = (labels[k] for k in ("pdserve.io/deployment", "pdserve.io/role", "pdserve.io/instance"))
            out["-".join(parts)] = meta["name"]
    return out


def flip(
    kube: Any, observed: Observed, pod: str, deployment: str, ready: bool, timeout: float
) -> float | None:
    """Sets the pod's Ready condition; returns seconds until the ConfigMap shows it."""
    value = "True" if ready else "False"
    body = {"status": {"conditions": [{"type": "Ready", "status": value}]}}
    t0 = time.monotonic()
    kube.request(
        "PATCH",
        f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/status",
        body,
        content_type="application/strategic-merge-patch+json",
    )

    def entries(table: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [i for role in ROLES for i in table.get(role, []) if i["name"] == pod]

    def shown() -> bool:
        found = entries(observed.tables.get(deployment) or {})
        return bool(found) and found[0]["ready"] is ready

    def first_seen() -> float | None:
        for at, name, table in observed.table_log:
            if name == deployment and at >= t0:
                found = entries(table)
                if found and found[0]["ready"] is ready:
                    return at
        return None

    if not wait_until(observed, shown, timeout):
        return None
    with observed.lock:
        at = first_seen()
    return None if at is None else at - t0


def not_ready_reasons(kube: Any, names: set[str]) -> dict[str, int]:
    """What the PDDeployments that are not Ready say (reason: message), counted."""
    out: dict[str, int] = {}
    for pdd in kube.list_objects("PDDeployment", NAMESPACE, ""):
        if pdd["metadata"]["name"] in names:
            conditions = (pdd.get("status") or {}).get("conditions") or []
            said = [f"{c['type']} {c.get('reason')}: {c.get('message', '')[:200]}" for c in conditions]
            key = "; ".join(said) or "no status"
            out[key] = out.get(key, 0) + 1
    return out


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_s": percentile(values, 0.5),
        "p99_s": percentile(values, 0.99),
        "max_s": max(values) if values else float("nan"),
        "mean_s": statistics.fmean(values) if values else float("nan"),
    }


def ensure_namespace(kubectl: Kubectl, namespace: str) -> None:
    kubectl("create", "namespace", namespace)
    deadline = time.monotonic() + 60
    while kubectl("get", "serviceaccount", "default", "-n", namespace, check=False) == "":
        if time.monotonic() > deadline:
            raise SystemExit(f"namespace {namespace}'s default ServiceAccount never appeared")
        time.sleep(0.2)


def delete_namespace(kube: Any, kubectl: Kubectl, namespace: str, timeout: float) -> float:
    """Force-deletes the namespace's pods (grace 0: kwok need not act), then the namespace; waits."""
    t0 = time.monotonic()
    body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
    for path in (
        f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/pddeployments",
        f"/api/v1/namespaces/{namespace}/pods",
    ):
        try:
            kube.request("DELETE", path, body)
        except Exception as exc:
            if getattr(exc, "status", 0) != 404:
                log(f"warning: DELETE {path}: {exc}")
    kubectl(
        "delete",
        "namespace",
        namespace,
        "--ignore-not-found",
        "--wait=true",
        f"--timeout={int(timeout)}s",
        check=False,
        timeout=timeout + 30,
    )
    return time.monotonic() - t0


def run_floor(
    kube: Any, kubectl: Kubectl, shape: Shape, count: int, timeout: float, stop: threading.Event
) -> dict[str, Any]:
    """The same pods created directly, no operator: create -> Ready per pod and per group."""
    ensure_namespace(kubectl, PLAIN_NAMESPACE)
    groups = [plain_pods(i, shape, PLAIN_NAMESPACE) for i in range(count)]
    observed = Observed()
    start_watch(kube, f"/api/v1/namespaces/{PLAIN_NAMESPACE}/pods", observed.seen_pod, stop)
    time.sleep(1.0)
    created: dict[str, float] = {}
    failed: list[str] = []

    def create(pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        created[name] = time.monotonic()
        try:
            kube.create(pod)
        except Exception as exc:
            failed.append(f"{name}: {exc}")

    flat = [pod for group in groups for pod in group]
    log(f"floor: creating {len(flat)} plain pods ({count} groups of {shape.pods}) ...")
    t_start = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(create, flat))
    create_s = time.monotonic() - t_start
    names = [p["metadata"]["name"] for p in flat if p["metadata"]["name"] not in failed]
    ok = wait_until(observed, lambda: all(n in observed.pod_ready_at for n in names), timeout)
    with observed.lock:
        ready = dict(observed.pod_ready_at)
    per_pod = [ready[n] - created[n] for n in names if n in ready]
    per_group = []
    for group in groups:
        members = [p["metadata"]["name"] for p in group]
        if all(n in ready for n in members):
            per_group.append(max(ready[n] for n in members) - min(created[n] for n in members))
    not_ready = len(flat) - len(per_pod)
    if not ok:
        log(f"warning: floor: {not_ready} plain pods not Ready within {timeout:g}s")
    log("floor: deleting the plain pods ...")
    delete_s = delete_namespace(kube, kubectl, PLAIN_NAMESPACE, timeout=300)
    return {
        "pods": len(flat),
        "create_requests_s": round(create_s, 1),
        "create_failures": failed[:5],
        "create_to_ready_per_pod": {**summarize(per_pod), "not_ready": not_ready},
        "create_to_ready_per_group": {**summarize(per_group), "not_ready": count - len(per_group)},
        "delete_s": round(delete_s, 1),
    }


def resolve_shape(args: argparse.Namespace) -> Shape:
    shape = SHAPES[args.shape]
    overrides = {
        k: getattr(args, k)
        for k in (
            "prefill_instances",
            "prefill_dp",
            "prefill_tp",
            "decode_instances",
            "decode_dp",
            "decode_tp",
            "router_replicas",
        )
        if getattr(args, k) is not None
    }
    return replace(shape, **overrides)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="10pods", help="see the module docstring")
    parser.add_argument("--deployments", type=int, help="default: 200 (10pods), 50 (small)")
    for role in ROLES:
        parser.add_argument(f"--{role}-instances", type=int)
        parser.add_argument(f"--{role}-dp", type=int, help="data-parallel size of one instance")
        parser.add_argument(f"--{role}-tp", type=int, help="tensor-parallel size")
    parser.add_argument("--router-replicas", type=int)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the same number of plain pods first (the cluster's own floor)",
    )
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="quiet window after all are Ready")
    parser.add_argument("--sequential-flips", type=int, default=40)
    parser.add_argument("--timeout", type=float, help="seconds for all to be Ready (default from the size)")
    parser.add_argument("--kubeconfig", help="default: $PDSERVE_TEST_KUBECONFIG, else .cluster/kubeconfig")
    parser.add_argument("--note", action="append", default=[], help="a line for the results")
    parser.add_argument(
        "--latest",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write bench/results/operator-latest.md (--no-latest: the JSON only, for a variant)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = resolve_shape(args)
    count = args.deployments or SHAPE_DEPLOYMENTS[args.shape]
    pools = node_pools(shape, count, args.gpus_per_node)
    timeout = args.timeout or max(180.0, 0.3 * count * shape.pods)

    # SIGTERM (a stopped job) runs the cleanup like Ctrl-C does.
    def terminated(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminated)

    kubeconfig = kubeconfig_path(args.kubeconfig)
    kubectl = Kubectl(kubeconfig)
    kube = make_kube(kubeconfig)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = Path(tempfile.gettempdir()) / f"pdserve-operator-bench-{stamp}.log"
    command = "python -m bench.operator_bench " + " ".join(argv if argv is not None else sys.argv[1:])

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/pddeployments.pdserve.io", "--timeout=60s")
    stop = threading.Event()
    observed = Observed(instances=shape.instances)
    result: dict[str, Any] = {
        "deployments": count,
        "shape": {"name": args.shape, **asdict(shape), "pods_per_deployment": shape.pods},
        "shape_text": shape.describe(),
        "pods": count * shape.pods,
        "nodes": {p.name: {"nodes": p.nodes, "gpus_per_node": p.gpus} for p in pools},
        "timestamp": stamp,
        "command": command,
        "operator_commit": source_commit(),
        "notes": args.note,
        "cpus": os.cpu_count(),
        "load_average_before": round(os.getloadavg()[0], 2),
        "targets": TARGETS,
    }
    log(f"{count} PDDeployments x ({shape.describe()}); timeout {timeout:g}s")
    t_run = time.monotonic()
    error: str | None = None
    try:
        delete_namespace(kube, kubectl, NAMESPACE, timeout=180)
        delete_namespace(kube, kubectl, PLAIN_NAMESPACE, timeout=180)
        kubectl("delete", "node", "-l", POOL_LABEL, "--ignore-not-found", "--wait=true", check=False)
        log("registering " + ", ".join(f"{p.nodes} {p.name} nodes ({p.gpus} GPUs)" for p in pools) + " ...")
        for pool in pools:
            kubectl("create", "-f", "-", input=node_manifests(pool))
        kubectl("wait", "--for=condition=Ready", "node", "-l", POOL_LABEL, "--timeout=300s", timeout=330)

        if args.floor:
            result["plain_pods"] = run_floor(kube, kubectl, shape, count, timeout, stop)
            f = result["plain_pods"]
            log(
                f"floor: per group p50 {f['create_to_ready_per_group']['p50_s']:.1f}s "
                f"p99 {f['create_to_ready_per_group']['p99_s']:.1f}s; deleted in {f['delete_s']:.0f}s"
            )

        ensure_namespace(kubectl, NAMESPACE)
        start_watch(
            kube, f"/apis/pdserve.io/v1alpha1/namespaces/{NAMESPACE}/pddeployments", observed.seen_pdd, stop
        )
        start_watch(kube, f"/api/v1/namespaces/{NAMESPACE}/configmaps", observed.seen_table, stop)
        time.sleep(1.0)  # let the watches connect

        with operator_process(kubeconfig, log_path) as (proc, metrics_port):
            result["operator_pid_start_cpu_s"] = proc_cpu_seconds(proc.pid)
            snaps = {"start": Snapshot.take(proc.pid, metrics_port)}
            log(f"creating {count} PDDeployments at once ...")
            started = create_all(kube, count, shape, drain_seconds=1)

            def all_ready() -> bool:
                return all(n in observed.ready_at and n in observed.complete_at for n in started)

            ok = wait_until(observed, all_ready, timeout)
            snaps["ready"] = Snapshot.take(proc.pid, metrics_port)
            with observed.lock:
                apply_to_ready = [
                    max(observed.ready_at[n], observed.complete_at[n]) - t0
                    for n, t0 in started.items()
                    if n in observed.ready_at and n in observed.complete_at
                ]
            result["apply_to_ready"] = summarize(apply_to_ready)
            result["apply_to_ready"]["not_ready"] = count - len(apply_to_ready)
            a = result["apply_to_ready"]
            log(f"apply -> Ready: {a['n']}/{count}, p50 {a['p50_s']:.1f}s p99 {a['p99_s']:.1f}s")
            if not ok:
                log(f"warning: {count - len(apply_to_ready)} deployments not Ready within {timeout:g}s")
                result["not_ready_reasons"] = not_ready_reasons(kube, set(started) - set(observed.ready_at))
                log(f"why: {result['not_ready_reasons']}")

            if args.idle_seconds > 0:
                log(f"idle for {args.idle_seconds:g}s (steady-state load) ...")
                time.sleep(args.idle_seconds)
            snaps["idle"] = Snapshot.take(proc.pid, metrics_port)
            pods = instance_pods(kube, NAMESPACE)

            rng = random.Random(7)
            names = sorted(n for n in started if n in observed.complete_at)
            sequential: list[float] = []
            missed = 0
            log(f"flipping readiness {args.sequential_flips} times, one at a time ...")
            for _ in range(args.sequential_flips if names else 0):
                deployment = rng.choice(names)
                role = rng.choice(ROLES)
                pod = pods.get(f"{deployment}-{role}-{rng.randrange(shape.count(role))}")
                for value in (False, True):
                    latency = (
                        None if pod is None else flip(kube, observed, pod, deployment, value, timeout=10)
                    )
                    if latency is None:
                        missed += 1
                    else:
                        sequential.append(latency)
            result["readiness_to_table_sequential"] = {**summarize(sequential), "missed": missed}

            log(f"flipping one pod in each of the {len(names)} deployments at once ...")
            burst: list[float] = []
            burst_missed = 0
            for value in (False, True):

                def one(n: str, v: bool = value) -> float | None:
                    pod = pods.get(f"{n}-decode-0")
                    return None if pod is None else flip(kube, observed, pod, n, v, timeout=30)

                with ThreadPoolExecutor(max_workers=16) as executor:
                    latencies = list(executor.map(one, names))
                burst += [x for x in latencies if x is not None]
                burst_missed += sum(1 for x in latencies if x is None)
            result["readiness_to_table_burst"] = {**summarize(burst), "missed": burst_missed}
            snaps["flips"] = Snapshot.take(proc.pid, metrics_port)

            memory = proc_memory_mb(proc.pid)
            end = snaps["flips"]
            result["peak_rss_mb"] = memory["peak_rss_mb"]
            result["rss_end_mb"] = memory["rss_mb"]
            result["operator_cpu_s"] = round(end.cpu_s, 2)
            result["api_requests"] = {k: round(v) for k, v in sorted(end.api_requests().items())}
            result["reconciles"] = {k: round(v) for k, v in end.reconciles().items()}
            result["phases"] = {
                "apply_to_ready": phase(snaps["start"], snaps["ready"]),
                "idle": phase(snaps["ready"], snaps["idle"]),
                "flips": phase(snaps["idle"], snaps["flips"]),
            }
            result["operator_metrics"] = {k: sum(v.values()) for k, v in end.metrics.items()}
            result["operator_counts"] = counts(end.metrics)
            result["operator_metrics_labeled"] = end.metrics
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        result["error"] = error
        log(f"failed: {error}")
        if not isinstance(exc, Exception | KeyboardInterrupt):
            raise
    finally:
        stop.set()
        log("cleaning up (namespaces, bench nodes) ...")
        for ns in (NAMESPACE, PLAIN_NAMESPACE):
            delete_namespace(kube, kubectl, ns, timeout=300)
        kubectl("delete", "node", "-l", POOL_LABEL, "--ignore-not-found", "--wait=false", check=False)
        result["wall_s"] = round(time.monotonic() - t_run, 1)
        result["load_average_after"] = round(os.getloadavg()[0], 2)
        out = RESULTS / f"operator-{stamp}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"written {out.relative_to(REPO)} (operator log: {log_path})")

    if error is not None:
        return 1
    print_table(result)
    if args.latest:
        (RESULTS / "operator-latest.md").write_text(markdown(result))
        log("written bench/results/operator-latest.md")
    return 0


# --- reporting -----------------------------------------------------------------------------------


def counts(metrics: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """The operator's own counters worth a line: writes, objects changed, coalescing, reconcile time."""

    def total(name: str) -> float:
        return sum(metrics.get(name, {}).values())

    reconciles = total("pdserve_operator_reconcile_duration_seconds_count")
    changes = metrics.get("pdserve_operator_object_changes_total", {})
    return {
        "routing_table_writes": round(total("pdserve_operator_routing_table_writes_total")),
        "requests_coalesced": round(total("pdserve_operator_requests_coalesced_total")),
        "reconcile_errors": round(total("pdserve_operator_reconcile_errors_total")),
        "reconcile_mean_s": round(total("pdserve_operator_reconcile_duration_seconds_sum") / reconciles, 3)
        if reconciles
        else None,
        "object_changes": {k.replace('"', ""): round(v) for k, v in changes.items()},
        "router_queries": by_label(metrics, "pdserve_operator_router_queries_total", "outcome"),
    }


def floor_ratio(result: Mapping[str, Any]) -> float | None:
    plain = result.get("plain_pods")
    if not plain:
        return None
    floor = plain["create_to_ready_per_group"]["p99_s"]
    return float(result["apply_to_ready"]["p99_s"] / floor) if floor else None


def rows(result: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str]]:
    out: list[tuple[str, Mapping[str, Any], str]] = [
        ("operator: apply -> Ready + complete table", result["apply_to_ready"], "apply_to_ready_p99_s")
    ]
    plain = result.get("plain_pods")
    if plain:
        out += [
            (
                f"floor: {result['shape']['pods_per_deployment']} plain pods -> all Ready",
                plain["create_to_ready_per_group"],
                "",
            ),
            ("floor: one plain pod create -> Ready", plain["create_to_ready_per_pod"], ""),
        ]
    out += [
        (
            "readiness -> ConfigMap (one at a time)",
            result["readiness_to_table_sequential"],
            "readiness_to_table_p99_s",
        ),
        (
            f"readiness -> ConfigMap ({result['readiness_to_table_burst']['n'] // 2} at once)",
            result["readiness_to_table_burst"],
            "readiness_to_table_p99_s",
        ),
    ]
    return out


def fmt_counts(counts: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['deployments']} PDDeployments x ({result['shape_text']})")
    print(f"{'measure':46} {'n':>5} {'p50 s':>8} {'p99 s':>8} {'max s':>8} {'target p99':>11}")
    for label, row, target in rows(result):
        goal = f"{result['targets'][target]:>10.1f}s" if target else f"{'-':>11}"
        print(
            f"{label:46} {row['n']:>5} {row['p50_s']:>8.2f} {row['p99_s']:>8.2f} {row['max_s']:>8.2f} {goal}"
        )
    ratio = floor_ratio(result)
    if ratio is not None:
        print(f"\noperator apply->Ready p99 / plain-pods floor p99 (per deployment's pods): {ratio:.2f}")
    print(
        f"operator: peak RSS {result['peak_rss_mb']:.1f} MB (target {TARGETS['peak_rss_mb']:.0f}), "
        f"RSS at the end {result['rss_end_mb']:.1f} MB, CPU {result['operator_cpu_s']:.1f} s"
    )
    print(
        f"operator: API requests {fmt_counts(result['api_requests'])}; "
        f"reconciles {fmt_counts(result['reconciles'])}"
    )
    for name, p in result["phases"].items():
        print(
            f"  {name:15} {p['seconds']:>7.1f}s  CPU {p['cpu_s']:>6.1f}s  API {p['api_requests_total']:>6}"
            f" ({fmt_counts(p['api_requests'])})  reconciles {fmt_counts(p['reconciles'])}"
        )


def markdown(result: Mapping[str, Any]) -> str:
    lines = [
        "# Operator benchmark: apply -> Ready, load, readiness flips",
        "",
        f"Run {result['timestamp']} on {result['cpus']} CPU(s), 1-minute load average "
        f"{result['load_average_before']} before and {result['load_average_after']} after (the machine "
        f"and the test cluster are shared; compare ratios, not absolute times); `{result['command']}`, "
        f"{result['wall_s']:.0f} s in all; operator code of commit {result.get('operator_commit', '?')}.",
        f"{result['deployments']} PDDeployments x ({result['shape_text']}) = {result['pods']} pods on "
        + ", ".join(f"{v['nodes']} {k} nodes" for k, v in result["nodes"].items())
        + " (kwok: pods are marked Ready, nothing runs). The floor: the same pods, rendered by pdserve,"
        " created directly with no operator, before the operator's run.",
        *(f"- {note}" for note in result.get("notes", [])),
        "",
        "| measure | n | not Ready/missed | p50 s | p99 s | max s | target p99 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row, target in rows(result):
        miss = row.get("not_ready", row.get("missed", 0))
        goal = f"{result['targets'][target]:g}" if target else "-"
        lines.append(
            f"| {label} | {row['n']} | {miss} | {row['p50_s']:.2f} | {row['p99_s']:.2f} "
            f"| {row['max_s']:.2f} | {goal} |"
        )
    ratio = floor_ratio(result)
    lines += [""]
    if ratio is not None:
        lines.append(
            f"**Operator apply -> Ready p99 / floor p99 = {ratio:.2f}** (the floor: one deployment's "
            "plain pods from the first create to the last Ready)."
        )
    lines += [
        "",
        f"Operator process: peak RSS **{result['peak_rss_mb']:.1f} MB** (VmHWM; target "
        f"{TARGETS['peak_rss_mb']:g}), RSS at the end {result['rss_end_mb']:.1f} MB, "
        f"**{result['operator_cpu_s']:.1f} CPU s** over the run (utime + stime).",
        "",
        "| phase | s | CPU s | API requests | by method | reconciles by result |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in result["phases"].items():
        lines.append(
            f"| {name} | {p['seconds']:.0f} | {p['cpu_s']:.1f} | {p['api_requests_total']} "
            f"| {fmt_counts(p['api_requests'])} | {fmt_counts(p['reconciles'])} |"
        )
    lines.append(
        f"| whole run | | {result['operator_cpu_s']:.1f} | {sum(result['api_requests'].values())} "
        f"| {fmt_counts(result['api_requests'])} | {fmt_counts(result['reconciles'])} |"
    )
    c = result.get("operator_counts") or {}
    if c:
        changed = sum(c["object_changes"].values())
        lines += [
            "",
            f"Operator counters: {c['routing_table_writes']} routing-table writes, {changed} objects "
            f"created/applied, {c['requests_coalesced']} requests coalesced, {c['reconcile_errors']} "
            f"reconcile errors, reconcile wall time mean {c['reconcile_mean_s']} s, router queries "
            f"{fmt_counts({k: round(v) for k, v in c['router_queries'].items()})} (kwok runs no router: "
            "drains end on drainSeconds).",
        ]
    lines += [
        "",
        "`apply_to_ready`: from the first create until every deployment is Ready (or the timeout); "
        "`idle`: nothing changes (resyncs, node listing); `flips`: the readiness flips.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
