"""Operator benchmark on the test cluster: 50 PDDeployments at once, then readiness flips.

Not a test: it prints figures next to their targets and writes
``bench/results/operator-<timestamp>.json``. Run with ``make bench-operator`` (after
``make cluster-up``) or ``python -m bench.operator_bench``.

What it does:

1. registers extra kwok GPU nodes for the run (a prefill pool of 8-GPU nodes, one per prefill
   instance, and a decode pool), so 50 x (2 x DP8 + 2 x TP1) = 900 GPUs fit; the PDDeployments
   pin their roles to the pools with ``nodeSelector`` so scheduling order cannot fragment GPUs;
2. starts ``pdserve operator`` as a subprocess and samples its RSS;
3. creates the 50 PDDeployments concurrently and records, per deployment, apply -> Ready with a
   complete routing table (Ready=True and all four instances routable in the ConfigMap);
4. flips pods' Ready condition (status subresource, one at a time and then one per deployment at
   once) and records readiness change -> the ConfigMap showing it;
5. deletes everything it created (namespace, nodes), also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NAMESPACE = "pdserve-bench"
POOL_LABEL = "pdserve.io/bench-pool"
TARGETS = {"readiness_to_table_p99_s": 1.0, "apply_to_ready_p99_s": 10.0, "peak_rss_mb": 250.0}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# --- cluster access ------------------------------------------------------------------------------


def kubeconfig_path() -> Path:
    path = Path(os.environ.get("PDSERVE_TEST_KUBECONFIG") or REPO / ".cluster" / "kubeconfig")
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

    def __call__(self, *args: str, input: str | None = None, check: bool = True) -> str:
        cmd = [self.binary, f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=300, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout


def node_manifests(prefix: str, count: int, pool: str, gpus: int) -> str:
    docs = []
    for i in range(count):
        name = f"{prefix}-{i}"
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
                        POOL_LABEL: pool,
                    },
                },
                "status": {
                    "capacity": {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)},
                    "allocatable": {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)},
                },
            }
        )
    return "\n---\n".join(json.dumps(d) for d in docs)


def pdd_manifest(name: str, drain_seconds: int) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": "deepseek-ai/DeepSeek-R1",
            "image": "vllm/vllm-openai:v0.11.0",
            "engine": "vllm",
            "kvTransfer": {"connector": "NixlConnector"},
            "prefill": {
                "instances": 2,
                "dataParallel": 8,
                "tensorParallel": 1,
                "expertParallel": True,
                "nodeSelector": {POOL_LABEL: "prefill"},
            },
            "decode": {
                "instances": 2,
                "dataParallel": 1,
                "tensorParallel": 1,
                "nodeSelector": {POOL_LABEL: "decode"},
            },
            "rollout": {"maxUnavailable": 1, "drainSeconds": drain_seconds},
        },
    }


# --- watching ------------------------------------------------------------------------------------


@dataclass
class Observed:
    """What the watch threads saw, with the local time each version arrived."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    ready_at: dict[str, float] = field(default_factory=dict)  # pdd -> first Ready=True
    complete_at: dict[str, float] = field(default_factory=dict)  # pdd -> first complete table
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # pdd -> latest table
    table_log: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


def watch_forever(api: Any, kind: str, observed: Observed, stop: threading.Event) -> None:
    from kubernetes import client, watch

    make_watch: Any = watch.Watch
    if kind == "pdd":
        custom = client.CustomObjectsApi(api)

        def lister(**kw: Any) -> Any:
            return custom.list_namespaced_custom_object(
                "pdserve.io", "v1alpha1", NAMESPACE, "pddeployments", **kw
            )
    else:
        core = client.CoreV1Api(api)

        def lister(**kw: Any) -> Any:
            return core.list_namespaced_config_map(NAMESPACE, **kw)

    version = ""
    while not stop.is_set():
        try:
            for ev in make_watch().stream(lister, resource_version=version or None, timeout_seconds=5):
                now = time.monotonic()
                obj = (
                    ev["object"]
                    if isinstance(ev["object"], dict)
                    else api.sanitize_for_serialization(ev["object"])
                )
                version = obj["metadata"]["resourceVersion"]
                if kind == "pdd":
                    _seen_pdd(obj, now, observed)
                else:
                    _seen_table(obj, now, observed)
                if stop.is_set():
                    return
        except Exception:
            version = ""
            time.sleep(0.2)


def _seen_pdd(obj: dict[str, Any], now: float, observed: Observed) -> None:
    name = obj["metadata"]["name"]
    conditions = (obj.get("status") or {}).get("conditions") or []
    if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        with observed.lock:
            observed.ready_at.setdefault(name, now)
            observed.changed.notify_all()


def _seen_table(obj: dict[str, Any], now: float, observed: Observed) -> None:
    text = (obj.get("data") or {}).get("routing.json")
    if not text:
        return
    table = json.loads(text)
    name = table["deployment"]
    routable = [i for role in ("prefill", "decode") for i in table[role] if i["ready"] and not i["draining"]]
    with observed.lock:
        observed.tables[name] = table
        observed.table_log.append((now, name, table))
        if len(routable) == 4:
            observed.complete_at.setdefault(name, now)
        observed.changed.notify_all()


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
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log, stderr=log
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


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process(pid)
        self.peak = 0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except Exception:
                return
            self.stop_flag.wait(0.1)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_operator_") and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            base = key.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
    return out


# --- phases --------------------------------------------------------------------------------------


def create_all(api: Any, count: int, drain_seconds: int) -> dict[str, float]:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    started: dict[str, float] = {}

    def create(i: int) -> None:
        name = f"bench-{i:03d}"
        started[name] = time.monotonic()
        custom.create_namespaced_custom_object(
            "pdserve.io", "v1alpha1", NAMESPACE, "pddeployments", pdd_manifest(name, drain_seconds)
        )

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(create, range(count)))
    return started


def instance_pods(api: Any, namespace: str) -> dict[str, str]:
    """``<deployment>-<role>-<index>`` -> the live pod's name (pods have a random suffix)."""
    from kubernetes import client

    items = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="pdserve.io/role").items
    out = {}
    for pod in items:
        if pod.metadata.deletion_timestamp is None:
            labels = pod.metadata.labels
            parts = (labels[k] for k in ("pdserve.io/deployment", "pdserve.io/role", "pdserve.io/instance"))
            out["-".join(parts)] = pod.metadata.name
    return out


def flip(
    api: Any, observed: Observed, pod: str, deployment: str, ready: bool, timeout: float
) -> float | None:
    """Sets the pod's Ready condition; returns seconds until the ConfigMap shows it."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    value = "True" if ready else "False"
    body = {"status": {"conditions": [{"type": "Ready", "status": value}]}}
    t0 = time.monotonic()
    core.patch_namespaced_pod_status(pod, NAMESPACE, body)

    def shown() -> bool:
        table = observed.tables.get(deployment) or {}
        entries = [i for role in ("prefill", "decode") for i in table.get(role, []) if i["name"] == pod]
        return bool(entries) and entries[0]["ready"] is ready

    def first_seen() -> float | None:
        for at, name, table in observed.table_log:
            if name == deployment and at >= t0:
                entries = [i for r in ("prefill", "decode") for i in table.get(r, []) if i["name"] == pod]
                if entries and entries[0]["ready"] is ready:
                    return at
        return None

    if not wait_until(observed, shown, timeout):
        return None
    with observed.lock:
        at = first_seen()
    return None if at is None else at - t0


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_s": percentile(values, 0.5),
        "p99_s": percentile(values, 0.99),
        "max_s": max(values) if values else float("nan"),
        "mean_s": statistics.fmean(values) if values else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, default=50)
    parser.add_argument("--sequential-flips", type=int, default=40)
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds for all deployments to be Ready"
    )
    args = parser.parse_args(argv)

    from kubernetes import config

    kubeconfig = kubeconfig_path()
    kubectl = Kubectl(kubeconfig)
    new_client: Any = config.new_client_from_config
    api = new_client(config_file=str(kubeconfig))
    count = args.deployments
    prefill_nodes = 2 * count
    decode_nodes = (2 * count + 7) // 8
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = Path(tempfile.gettempdir()) / f"pdserve-operator-bench-{stamp}.log"

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/pddeployments.pdserve.io", "--timeout=60s")
    stop = threading.Event()
    observed = Observed()
    result: dict[str, Any] = {"deployments": count, "timestamp": stamp, "targets": TARGETS}
    try:
        print(f"registering {prefill_nodes} prefill and {decode_nodes} decode kwok nodes (8 GPUs each) ...")
        kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=120s")
        kubectl(
            "create",
            "-f",
            "-",
            input=node_manifests("bench-prefill", prefill_nodes, "prefill", 8),
            check=False,
        )
        kubectl(
            "create", "-f", "-", input=node_manifests("bench-decode", decode_nodes, "decode", 8), check=False
        )
        kubectl("wait", "--for=condition=Ready", "node", "-l", POOL_LABEL, "--timeout=120s")
        kubectl("create", "namespace", NAMESPACE)
        deadline = time.monotonic() + 30
        while kubectl("get", "serviceaccount", "default", "-n", NAMESPACE, check=False) == "":
            if time.monotonic() > deadline:
                raise SystemExit("namespace's default ServiceAccount never appeared")
            time.sleep(0.2)

        for kind in ("pdd", "table"):
            threading.Thread(target=watch_forever, args=(api, kind, observed, stop), daemon=True).start()
        time.sleep(1.0)  # let the watches connect

        with operator_process(kubeconfig, log_path) as (proc, metrics_port):
            rss = RssSampler(proc.pid)
            rss.start()
            print(f"creating {count} PDDeployments at once ...")
            started = create_all(api, count, drain_seconds=1)

            def all_ready() -> bool:
                return all(n in observed.ready_at and n in observed.complete_at for n in started)

            ok = wait_until(observed, all_ready, args.timeout)
            apply_to_ready = [
                max(observed.ready_at[n], observed.complete_at[n]) - t0
                for n, t0 in started.items()
                if n in observed.ready_at and n in observed.complete_at
            ]
            result["apply_to_ready"] = summarize(apply_to_ready)
            result["apply_to_ready"]["not_ready"] = count - len(apply_to_ready)
            if not ok:
                print(
                    f"warning: {count - len(apply_to_ready)} deployments not Ready within {args.timeout:g}s"
                )
            time.sleep(2.0)  # quiet the cluster before the flips
            pods = instance_pods(api, NAMESPACE)

            rng = random.Random(7)
            names = sorted(started)
            sequential: list[float] = []
            missed = 0
            print(f"flipping readiness {args.sequential_flips} times, one at a time ...")
            for i in range(args.sequential_flips):
                deployment = rng.choice(names)
                pod = pods[f"{deployment}-{rng.choice(['prefill', 'decode'])}-{rng.randrange(2)}"]
                for value in (False, True):
                    latency = flip(api, observed, pod, deployment, value, timeout=10)
                    if latency is None:
                        missed += 1
                    else:
                        sequential.append(latency)
                if i % 10 == 9:
                    print(f"  {i + 1} done")
            result["readiness_to_table_sequential"] = {**summarize(sequential), "missed": missed}

            print(f"flipping one pod in each of the {count} deployments at once ...")
            burst: list[float] = []
            burst_missed = 0
            for value in (False, True):
                with ThreadPoolExecutor(max_workers=16) as pool:
                    latencies = list(
                        pool.map(
                            lambda n, v=value: flip(api, observed, pods[f"{n}-decode-0"], n, v, timeout=15),
                            names,
                        )
                    )
                burst += [x for x in latencies if x is not None]
                burst_missed += sum(1 for x in latencies if x is None)
            result["readiness_to_table_burst"] = {**summarize(burst), "missed": burst_missed}

            result["operator_metrics"] = scrape(metrics_port)
            rss.stop_flag.set()
            rss.join(timeout=2)
            result["peak_rss_mb"] = rss.peak / 2**20
            cpu = rss.process.cpu_times()
            result["operator_cpu_s"] = cpu.user + cpu.system
    finally:
        stop.set()
        print("cleaning up (namespace, bench nodes) ...")
        kubectl(
            "delete",
            "namespace",
            NAMESPACE,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=180s",
            check=False,
        )
        kubectl("delete", "node", "-l", POOL_LABEL, "--ignore-not-found", "--wait=false", check=False)

    out = RESULTS / f"operator-{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwritten {out.relative_to(REPO)} (operator log: {log_path})")
    return 0


def print_table(result: dict[str, Any]) -> None:
    a = result["apply_to_ready"]
    s = result["readiness_to_table_sequential"]
    b = result["readiness_to_table_burst"]
    rows = [
        ("apply -> Ready + complete table", a, TARGETS["apply_to_ready_p99_s"]),
        ("readiness -> ConfigMap (one at a time)", s, TARGETS["readiness_to_table_p99_s"]),
        (f"readiness -> ConfigMap ({result['deployments']} at once)", b, TARGETS["readiness_to_table_p99_s"]),
    ]
    print(f"\n{result['deployments']} PDDeployments x (2 prefill DP8 + 2 decode TP1)")
    print(
        f"{'measure':44} {'n':>5} {'p50 s':>8} {'p99 s':>8} {'max s':>8}"
        f" {'target p99':>11} {'p99/target':>11}"
    )
    for label, row, target in rows:
        print(
            f"{label:44} {row['n']:>5} {row['p50_s']:>8.3f} {row['p99_s']:>8.3f} {row['max_s']:>8.3f}"
            f" {target:>10.1f}s {row['p99_s'] / target:>11.2f}"
        )
    peak = result["peak_rss_mb"]
    target = TARGETS["peak_rss_mb"]
    print(
        f"{'operator peak RSS':44} {'':>5} {peak:>7.1f}M {'':>8} {'':>8}"
        f" {target:>10.0f}M {peak / target:>11.2f}"
    )
    m = result.get("operator_metrics", {})
    print(
        f"\noperator: {m.get('pdserve_operator_reconciles_total', 0):.0f} reconciles, "
        f"{m.get('pdserve_operator_routing_table_writes_total', 0):.0f} routing-table writes, "
        f"{m.get('pdserve_operator_requests_coalesced_total', 0):.0f} requests coalesced, "
        f"{m.get('pdserve_operator_reconcile_errors_total', 0):.0f} errors, "
        f"{m.get('pdserve_operator_api_request_seconds_count', 0):.0f} API requests, "
        f"{result.get('operator_cpu_s', float('nan')):.1f} s CPU"
    )
    count = m.get("pdserve_operator_api_request_seconds_count", 0)
    if count:
        mean = m.get("pdserve_operator_api_request_seconds_sum", 0) / count
        print(f"operator: API request latency mean {mean * 1000:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
