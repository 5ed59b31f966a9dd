"""Routing-table lag on the test cluster: how soon every router serves what the operator wrote.

Not a test: it prints figures next to their targets and writes
``bench/results/routing-lag-<timestamp>.json`` and ``routing-lag-latest.md``. Run with
``make bench-routing`` (after ``make cluster-up``) or ``python -m bench.routing_lag_bench``.

Two measures, each for routers that watch their ConfigMap through the API server (``watch``)
and for routers that read the table from a file (``file``), side by side in one run:

1. *write -> served*: the bench patches a routing ConfigMap (no operator running) and times
   until every router's ``/routing/served`` shows the new generation;
2. *NotReady -> out of every table*: ``pdserve operator`` runs; the bench sets an engine pod's
   Ready condition to False (and back) and times until every router serves a generation where
   that instance is not routable (routable again).

Then, with the pods really running on the pod runner's node (``engine: sim``, two router pods
deployed by the operator): a rollout of 3 decode instances under streaming load sent to the
router pods' IPs: wall time from the template change until every router serves the three new
pods, and the failed requests (target 0).

For ``file`` the bench plays the kubelet at its very best: its own watch copies every new
ConfigMap content into the file at once, with the kubelet's atomic ``..data`` swap. A real
kubelet adds its sync period (60-90 s by default) on top, so the ``file`` figures here are a
lower bound of what a mounted ConfigMap gives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.operator_bench import Kubectl, instance_pods, kubeconfig_path, operator_process, percentile
from bench.proxy_start_bench import table_json
from tests.support.kube import grant_router_access, kubectl_for, router_kubeconfig
from tests.support.load import Load
from tests.support.procs import free_port
from tests.support.specs import sim_manifest, vllm_manifest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NS_WRITE = "pdserve-bench-lag-write"
NS_FLIP = "pdserve-bench-lag-flip"
NS_ROLL = "pdserve-bench-lag-rollout"
CONFIGMAP = "lag-routing"
PDD = "lag"
TARGETS = {"write_to_served_p99_s": 0.5, "notready_to_served_p99_s": 1.0}
POLL_S = 0.005


def log(message: str) -> None:
    print(f"[routing-lag {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- routers -------------------------------------------------------------------------------------


@dataclass
class Router:
    variant: str  # "watch" | "file"
    port: int
    proc: subprocess.Popen[bytes]

    def served(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/routing/served", timeout=1) as r:
                return dict(json.loads(r.read()))
        except (OSError, ValueError):
            return None


@contextmanager
def router(variant: str, source_args: list[str], log_path: Path) -> Iterator[Router]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "proxy", *source_args]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with log_path.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    r = Router(variant, port, proc)
    try:
        deadline = time.monotonic() + 60
        while r.served() is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"router ({variant}) did not start; see {log_path}")
            time.sleep(0.05)
        yield r
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def time_until(
    routers: list[Router], ok: Callable[[dict[str, Any]], bool], t0: float, timeout: float
) -> dict[str, float]:
    """Per variant: seconds from ``t0`` until its slowest router first served a view ``ok`` accepts."""
    pending = {id(r): r for r in routers}
    seen: dict[int, float] = {}
    deadline = t0 + timeout
    while pending and time.monotonic() < deadline:
        for key, r in list(pending.items()):
            view = r.served()
            if view is not None and ok(view):
                seen[key] = time.monotonic() - t0
                del pending[key]
        time.sleep(POLL_S)
    lags: dict[str, float] = {}
    for r in routers:
        lag = seen.get(id(r), float("inf"))
        lags[r.variant] = max(lags.get(r.variant, 0.0), lag)
    return lags


# --- the file variant's stand-in kubelet ---------------------------------------------------------


class Mirror(threading.Thread):
    """Copies the ConfigMap's routing.json into ``directory`` the moment its watch sees it, with
    the kubelet's layout (``..<stamp>/`` + atomic ``..data`` symlink swap)."""

    def __init__(self, api: Any, namespace: str, name: str, directory: Path) -> None:
        super().__init__(daemon=True)
        self.api, self.namespace, self.name, self.directory = api, namespace, name, directory
        self.stop = threading.Event()
        self.file = directory / "routing.json"

    def write(self, text: str) -> None:
        stamp = self.directory / f"..{time.time_ns()}"
        stamp.mkdir()
        (stamp / "routing.json").write_text(text)
        tmp = self.directory / "..data_tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(stamp.name)
        os.replace(tmp, self.directory / "..data")
        if not self.file.is_symlink():
            self.file.symlink_to("..data/routing.json")

    def run(self) -> None:
        from kubernetes import client, watch

        core = client.CoreV1Api(self.api)
        version = None
        while not self.stop.is_set():
            try:
                make_watch: Any = watch.Watch
                stream = make_watch().stream(
                    core.list_namespaced_config_map,
                    self.namespace,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=version,
                    timeout_seconds=5,
                )
                for ev in stream:
                    obj = ev["object"]
                    version = obj.metadata.resource_version
                    text = (obj.data or {}).get("routing.json")
                    if text and ev["type"] in ("ADDED", "MODIFIED"):
                        self.write(text)
            except Exception:
                version = None
                time.sleep(0.2)


# --- measures ------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if v != float("inf")]
    return {
        "n": len(values),
        "missed": len(values) - len(finite),
        "p50_s": percentile(finite, 0.5),
        "p99_s": percentile(finite, 0.99),
        "max_s": max(finite) if finite else float("nan"),
    }


def measure_writes(api: Any, routers: list[Router], writes: int) -> dict[str, list[float]]:
    from kubernetes import client

    core = client.CoreV1Api(api)
    doc = json.loads(table_json())
    lags: dict[str, list[float]] = {"watch": [], "file": []}
    for i in range(writes):
        doc["generation"] = 100 + i
        body = {"data": {"routing.json": json.dumps(doc)}}
        t0 = time.monotonic()
        core.patch_namespaced_config_map(CONFIGMAP, NS_WRITE, body)
        gen = doc["generation"]

        def served_new(view: dict[str, Any], gen: int = gen) -> bool:
            return bool(view.get("generation") == gen)

        for variant, lag in time_until(routers, served_new, t0, 10).items():
            lags[variant].append(lag)
        time.sleep(0.1)
    return lags


def pdd_manifest() -> dict[str, Any]:
    # engine vllm asks for GPUs: its pods run on kwok's nodes, whose Ready condition the bench sets.
    return vllm_manifest(
        PDD,
        metadata={"namespace": NS_FLIP},
        model="Qwen/Qwen3-0.6B",
        prefill={"instances": 2, "dataParallel": 2, "tensorParallel": 1},
        decode={"instances": 2, "dataParallel": 1, "tensorParallel": 1},
    )


def routable(view: dict[str, Any], pod: str) -> bool:
    row = (view.get("instances") or {}).get(pod)
    return bool(row and row.get("in_table") and row.get("routable"))


def measure_flips(api: Any, routers: list[Router], pods: list[str], flips: int) -> dict[str, list[float]]:
    from kubernetes import client

    core = client.CoreV1Api(api)
    lags: dict[str, list[float]] = {"watch": [], "file": []}
    for i in range(flips):
        pod = pods[i % len(pods)]
        for ready in (False, True):
            body = {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
            t0 = time.monotonic()
            core.patch_namespaced_pod_status(pod, NS_FLIP, body)

            def shows(view: dict[str, Any], pod: str = pod, want: bool = ready) -> bool:
                return routable(view, pod) is want

            result = time_until(routers, shows, t0, 10)
            if not ready:
                for variant, lag in result.items():
                    lags[variant].append(lag)
            time.sleep(0.2)
    return lags


def wait_instance_pods(api: Any, namespace: str, instances: list[str], timeout: float) -> list[str]:
    """The pod names of these instances, once the operator has created them all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = instance_pods(api, namespace)
        if all(i in names for i in instances):
            return [names[i] for i in instances]
        time.sleep(0.2)
    raise SystemExit(f"the operator did not create {instances} within {timeout:g}s")


def wait_all_routable(routers: list[Router], pods: list[str], timeout: float) -> None:
    t0 = time.monotonic()
    lags = time_until(routers, lambda v: all(routable(v, p) for p in pods), t0, timeout)
    if any(lag == float("inf") for lag in lags.values()):
        raise SystemExit(f"routers never served all of {pods} as routable within {timeout:g}s")


def rollout_manifest(decode: int) -> dict[str, Any]:
    return sim_manifest(
        PDD,
        metadata={"namespace": NS_ROLL},
        prefill={"instances": 1, "dataParallel": 2},
        decode={"instances": decode, "dataParallel": 1},
        router={"replicas": 2},
        rollout={"maxUnavailable": 1, "drainSeconds": 30},
    )


def live_pods(api: Any, selector: str) -> list[Any]:
    from kubernetes import client

    items: list[Any] = client.CoreV1Api(api).list_namespaced_pod(NS_ROLL, label_selector=selector).items
    return [p for p in items if p.metadata.deletion_timestamp is None]


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def router_targets(api: Any) -> list[str]:
    selector = f"pdserve.io/deployment={PDD},app.kubernetes.io/component=router"
    return [f"{p.status.pod_ip}:8000" for p in live_pods(api, selector) if is_ready(p) and p.status.pod_ip]


def rollout_served(api: Any, decode: int, old: set[str]) -> bool:
    """Every decode pod new and Ready, and both router pods serving exactly those."""
    pods = live_pods(api, f"pdserve.io/deployment={PDD},pdserve.io/role=decode")
    if len(pods) != decode or any(p.metadata.uid in old or not is_ready(p) for p in pods):
        return False
    targets = router_targets(api)
    names = {p.metadata.name for p in pods}
    for target in targets:
        try:
            with urllib.request.urlopen(f"http://{target}/routing/served", timeout=2) as r:
                view = json.loads(r.read())
        except OSError:
            return False
        routable = {n for n, row in view["instances"].items() if row["role"] == "decode" and row["routable"]}
        if routable != names:
            return False
    return len(targets) == 2


def measure_rollout(api: Any, kubectl: Kubectl, decode: int, concurrency: int) -> dict[str, Any]:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    deadline = time.monotonic() + 180
    while not rollout_served(api, decode, set()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{NS_ROLL}/{PDD} never served {decode} decode pods through 2 routers")
        time.sleep(0.5)
    old = {p.metadata.uid for p in live_pods(api, f"pdserve.io/deployment={PDD},pdserve.io/role=decode")}
    with Load(lambda: router_targets(api), concurrency) as load:
        time.sleep(2)
        t0 = time.monotonic()
        patch = {
            "spec": {"decode": {"template": {"metadata": {"annotations": {"bench/rev": str(time.time())}}}}}
        }
        custom.patch_namespaced_custom_object("pdserve.io", "v1alpha1", NS_ROLL, "pddeployments", PDD, patch)
        deadline = t0 + 600
        while not rollout_served(api, decode, old):
            if time.monotonic() > deadline:
                raise SystemExit("the rollout did not finish within 600 s")
            time.sleep(0.2)
        wall = time.monotonic() - t0
        time.sleep(1)
        result = load.stop()
    return {
        "decode_instances": decode,
        "concurrency": concurrency,
        "wall_s": wall,
        "ok": result.ok,
        "failed": len(result.failed),
        "failures": result.failed[:5],
    }


# --- main ----------------------------------------------------------------------------------------


def start_routers(
    stack: ExitStack, admin: Path, namespace: str, configmap: str, work: Path, count: int, api: Any
) -> list[Router]:
    kubectl = kubectl_for(admin)
    grant_router_access(kubectl, namespace, "lag-router", configmap)
    token_kubeconfig = router_kubeconfig(kubectl, namespace, "lag-router", work)
    mirror_dir = work / f"mirror-{namespace}"
    mirror_dir.mkdir()
    mirror = Mirror(api, namespace, configmap, mirror_dir)
    mirror.start()
    stack.callback(mirror.stop.set)
    deadline = time.monotonic() + 30
    while not mirror.file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"ConfigMap {namespace}/{configmap} never appeared")
        time.sleep(0.05)
    routers = []
    for i in range(count):
        watch_args = [
            "--routing-configmap",
            f"{namespace}/{configmap}",
            "--kubeconfig",
            str(token_kubeconfig),
        ]
        routers.append(stack.enter_context(router("watch", watch_args, work / f"watch-{namespace}-{i}.log")))
        file_args = ["--routing-file", str(mirror.file)]
        routers.append(stack.enter_context(router("file", file_args, work / f"file-{namespace}-{i}.log")))
    return routers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", type=int, default=2, help="routers per variant")
    parser.add_argument("--writes", type=int, default=40)
    parser.add_argument("--flips", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=32, help="streams during the rollout")
    args = parser.parse_args(argv)

    from kubernetes import config

    admin = kubeconfig_path()
    kubectl = Kubectl(admin)
    new_client: Any = config.new_client_from_config
    api = new_client(config_file=str(admin))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"timestamp": stamp, "cpus": os.cpu_count(), "targets": TARGETS}
    result["routers_per_variant"] = args.routers
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/pddeployments.pdserve.io", "--timeout=60s")
    with tempfile.TemporaryDirectory(prefix="pdserve-routing-lag-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        for ns in (NS_WRITE, NS_FLIP):
            kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout=120s")
            kubectl("create", "namespace", ns)
            stack.callback(
                kubectl, "delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False
            )

        log(f"1/2 write -> served: {args.routers} watch + {args.routers} file routers, {args.writes} writes")
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIGMAP, "namespace": NS_WRITE},
            "data": {"routing.json": table_json()},
        }
        kubectl("apply", "-f", "-", input=json.dumps(cm))
        with ExitStack() as phase:
            routers = start_routers(phase, admin, NS_WRITE, CONFIGMAP, work, args.routers, api)
            writes = measure_writes(api, routers, args.writes)
        result["write_to_served"] = {v: summarize(x) for v, x in writes.items()}

        log(f"2/2 NotReady -> served: the operator, a PDDeployment on kwok nodes, {args.flips} flips")
        stack.enter_context(operator_process(admin, work / "operator.log", NS_FLIP))
        kubectl("apply", "-f", "-", input=json.dumps(pdd_manifest()))
        routers = start_routers(stack, admin, NS_FLIP, f"{PDD}-routing", work, args.routers, api)
        instances = [f"{PDD}-prefill-0", f"{PDD}-prefill-1", f"{PDD}-decode-0", f"{PDD}-decode-1"]
        pods = wait_instance_pods(api, NS_FLIP, instances, 120)
        wait_all_routable(routers, pods, 120)
        flips = measure_flips(api, routers, pods, args.flips)
        result["notready_to_served"] = {v: summarize(x) for v, x in flips.items()}

        log(f"3/3 rollout of 3 decode instances under c={args.concurrency} streaming load (pod runner)")
        kubectl("delete", "namespace", NS_ROLL, "--ignore-not-found", "--wait=true", "--timeout=120s")
        kubectl("create", "namespace", NS_ROLL)
        stack.callback(
            kubectl, "delete", "namespace", NS_ROLL, "--ignore-not-found", "--wait=false", check=False
        )
        stack.enter_context(operator_process(admin, work / "operator-rollout.log", NS_ROLL))
        kubectl("apply", "-f", "-", input=json.dumps(rollout_manifest(3)))
        result["rollout"] = measure_rollout(api, kubectl, 3, args.concurrency)

    (RESULTS / f"routing-lag-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "routing-lag-latest.md").write_text(markdown(result, args))
    print(markdown(result, args))
    return 0


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Routing-table lag: written -> served by every router",
        "",
        f"Run {result['timestamp']} on {result['cpus']} CPU(s), the test cluster's API server on loopback, "
        f"{result['routers_per_variant']} routers per variant (`python -m bench.routing_lag_bench "
        f"--routers {args.routers} --writes {args.writes} --flips {args.flips}`). `watch` = "
        "`--routing-configmap` (list + watch through the API server); `file` = `--routing-file` fed by a "
        "stand-in kubelet that copies each new ConfigMap content at once (a real kubelet adds its "
        "60-90 s sync period: `file` is a lower bound). Lag = until the slowest router of the variant "
        f"serves it; polled every {POLL_S * 1000:g} ms.",
        "",
        "| measure | variant | n | missed | p50 s | p99 s | max s | target p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for measure, target in (
        ("write_to_served", "write_to_served_p99_s"),
        ("notready_to_served", "notready_to_served_p99_s"),
    ):
        for variant, s in result[measure].items():
            lines.append(
                f"| {measure} | {variant} | {s['n']} | {s['missed']} | {s['p50_s']:.3f} | {s['p99_s']:.3f} "
                f"| {s['max_s']:.3f} | {TARGETS[target] if variant == 'watch' else '-'} |"
            )
    r = result["rollout"]
    lines += [
        "",
        f"Rollout of {r['decode_instances']} decode instances (template change; maxUnavailable 1; "
        f"pods run by the pod runner, 2 router pods) under c={r['concurrency']} streaming completions "
        f"sent to the router pods' IPs: **{r['wall_s']:.1f} s** from the change until both routers serve "
        f"the three new pods; {r['ok']} requests answered whole, **{r['failed']} failed** (target 0).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
