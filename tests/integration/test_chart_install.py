"""The chart and the examples on a real API server, as users run them (the test cluster: kwok
makes GPU pods Ready, the pod runner runs every other pod as local processes).

* Every example is valid against the CRD as the API server enforces it (schema and CEL).
* README's cluster path, with the ``engine: sim`` twin of its first example: ``helm install
  --wait`` brings the operator up as the chart's pods (in-cluster service account, leader
  election through the release's Lease, liveness probe), the example becomes Ready and a request
  is served through its router pod, a GPU example is placed and routed on kwok's GPU nodes (the
  chart's RBAC covers everything the operator does), and uninstalling as README says leaves
  nothing of the release.
* A production values file installs and serves without leaking secrets (the operator runs from
  the venv with the chart's ServiceAccount token: the values pin it to a node pool the test
  cluster does not have).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kube import LOGS, REPO, KubeCluster, eventually, gpu_pool
from tests.support.pdstack import http
from tests.support.procs import spawn_pdserve

pytestmark = pytest.mark.cluster

CHART = REPO / "charts" / "pdserve"
CRD = CHART / "crds" / "pddeployments.pdserve.io.yaml"
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


@pytest.fixture
def crd(kube_cluster: KubeCluster) -> None:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", CRD)
    kube_cluster.wait_established("pddeployments.pdserve.io", timeout=60)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_example_is_valid_on_the_api_server(
    kube_cluster: KubeCluster, kube_namespace: str, crd: None, example: Path
) -> None:
    result = kube_cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", kube_namespace, "-f", example, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "(server dry run)" in result.stdout


def _token_kubeconfig(kube_cluster: KubeCluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount, nothing else."""
    admin = yaml.safe_load(kube_cluster.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    token = kube_cluster.kubectl(
        "create", "token", service_account, "-n", namespace, "--duration=1h"
    ).stdout.strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": service_account}}],
        "current-context": "sa",
    }
    # A relative certificate-authority path in the admin kubeconfig is relative to that file.
    ca = cluster["cluster"].get("certificate-authority")
    if ca and not Path(ca).is_absolute():
        cluster["cluster"]["certificate-authority"] = str((kube_cluster.kubeconfig.parent / ca).resolve())
    path.write_text(yaml.safe_dump(config))
    return path


def _get(kube_cluster: KubeCluster, namespace: str, *what: str) -> dict[str, Any]:
    out = kube_cluster.kubectl("get", *what, "-n", namespace, "-o", "json").stdout
    return dict(json.loads(out))


def _model_cache(kube_cluster: KubeCluster, ns: str) -> str:
    """What README has users create before a GPU example: the claim hf-cache (bound to a hostPath
    volume: the test cluster has no storage provisioner). Returns the volume's name."""
    pv = f"hf-cache-{ns}"[:63]
    storage = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "300Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": "/tmp/pdserve-hf-cache"},
                "claimRef": {"namespace": ns, "name": "hf-cache"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "hf-cache", "namespace": ns},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "300Gi"}},
            },
        },
    ]
    kube_cluster.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": storage})
    )
    return pv


def _operator_logs(kube_cluster: KubeCluster, ns: str, release: str) -> str:
    """Every operator container's output, restarts included (the pod runner's files; on another
    cluster, kubectl logs)."""
    files = sorted((LOGS / "pods").glob(f"{ns}_{release}-*_operator.log"))
    if files:
        return "\n".join(f.read_text(errors="replace") for f in files)
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
    return kube_cluster.kubectl("logs", "-n", ns, "-l", selector, "--tail=-1", check=False).stdout


def _ready_pods(kube_cluster: KubeCluster, ns: str, selector: str) -> list[dict[str, Any]]:
    pods = _get(kube_cluster, ns, "pods", "-l", selector)["items"]
    return [
        p
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    ]


#: What a namespace holds before anything is installed, and what the test itself created.
NOT_THE_RELEASES = {("ConfigMap", "kube-root-ca.crt"), ("ServiceAccount", "default"), ("Secret", "hf-token")}
KINDS = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,leases,poddisruptionbudgets,pddeployments"


def test_the_readme_cluster_path_with_the_sim_twin_of_its_example(
    kube_cluster: KubeCluster, kube_namespace: str, crd: None
) -> None:
    ns = kube_namespace
    release = f"pdserve-{secrets.token_hex(3)}"
    operator = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
    pv = _model_cache(kube_cluster, ns)
    kube_cluster.kubectl("create", "secret", "generic", "hf-token", "-n", ns, "--from-literal=token=hf_test")
    try:
        # README: `helm install pdserve charts/pdserve ... --wait`. Here in the test's namespace and
        # watching only it: other tests' namespaces hold PDDeployments of their own operators.
        kube_cluster.helm(
            "install", release, CHART, "--namespace", ns,
            "--set", "operator.scope=namespaced", "--set", f"operator.namespaces={{{ns}}}",
            "--wait", "--timeout", "5m",
            timeout=360,
        )  # fmt: skip
        pods = _ready_pods(kube_cluster, ns, operator)
        assert len(pods) == 2, "both operator replicas run as pods and are Ready"
        lease = f"{release}-operator"
        holder = eventually(
            lambda: _get(kube_cluster, ns, "lease", lease)["spec"].get("holderIdentity") or None,
            timeout=60,
            message=f"a leader holding the Lease {lease}",
        )
        assert str(holder).rsplit("_", 1)[0] in {p["metadata"]["name"] for p in pods}

        # README: apply the example (its engine: sim twin) and, on kwok's GPU nodes, a GPU one.
        first = yaml.safe_load((REPO / "examples" / "first" / "qwen3-8b-sim.yaml").read_text())
        for example in ("first/qwen3-8b-sim.yaml", "nixl/1p-tp8-1d-tp8.yaml"):
            kube_cluster.kubectl("apply", "-n", ns, "-f", REPO / "examples" / example)
        names = [first["metadata"]["name"], "nixl-1p-tp8-1d-tp8"]
        _wait_ready(kube_cluster, ns, names, lambda: _operator_logs(kube_cluster, ns, release))
        for name in names:
            table = json.loads(_get(kube_cluster, ns, "configmap", f"{name}-routing")["data"]["routing.json"])
            assert all(i["ready"] for i in table["prefill"] + table["decode"])
            kube_cluster.kubectl("get", "pdb", f"{name}-prefill", f"{name}-decode", "-n", ns)

        # README: send a request. Through the Service on a real cluster; here to the router pod's
        # IP (the API gives loopback pod IPs no endpoints), which is where the Service sends it.
        (router,) = _ready_pods(
            kube_cluster, ns, f"pdserve.io/deployment={names[0]},app.kubernetes.io/component=router"
        )
        url = f"http://{router['status']['podIP']}:8000"
        answer = http(
            "POST", url + "/v1/completions", {"model": "qwen3-8b", "prompt": "Hello", "max_tokens": 8}
        )
        assert answer.status == 200, answer.body
        assert answer.json()["choices"][0]["text"]
        assert [m["id"] for m in http("GET", url + "/v1/models").json()["data"]] == ["qwen3-8b"]

        logs = _operator_logs(kube_cluster, ns, release)
        assert "Forbidden" not in logs, "the chart's RBAC must cover everything the operator does"
        assert "became leader" in logs, "the chart's Role must let the operator hold its Lease"

        # README: uninstall. The PDDeployments first (the operator removes what it made), then the
        # release; what is left is the namespace's own and the test's (Secret, claim).
        kube_cluster.kubectl("delete", "pdd", "--all", "-n", ns, "--wait=true", "--timeout=120s")
        eventually(
            lambda: not _get(kube_cluster, ns, "pods", "-l", "pdserve.io/deployment")["items"],
            timeout=120,
            message="every pod of the PDDeployments gone",
        )
        kube_cluster.helm("uninstall", release, "--namespace", ns, "--wait", "--timeout", "2m", timeout=180)
        eventually(
            lambda: not _get(kube_cluster, ns, "pods", "-l", operator)["items"],
            timeout=120,
            message="the operator pods gone",
        )
        left = {
            (o["kind"], o["metadata"]["name"])
            for o in _get(kube_cluster, ns, KINDS)["items"]
            if (o["kind"], o["metadata"]["name"]) not in NOT_THE_RELEASES
            and o["kind"] not in ("PersistentVolumeClaim",)
        }
        # The Lease the operator wrote stays, as every controller's does; README's uninstall deletes
        # the release namespace, which takes it along.
        assert left == {("Lease", lease)}, left
        cluster_wide = kube_cluster.kubectl(
            "get",
            "clusterroles,clusterrolebindings",
            "-l",
            f"app.kubernetes.io/instance={release}",
            "-o",
            "name",
        ).stdout
        assert not cluster_wide.strip(), cluster_wide
    finally:
        kube_cluster.helm("uninstall", release, "--namespace", ns, check=False, timeout=180)
        kube_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def _wait_ready(
    kube_cluster: KubeCluster,
    ns: str,
    names: list[str],
    logs: Callable[[], str],
    alive: Callable[[], bool] = lambda: True,
) -> None:
    def all_ready() -> bool:
        assert alive(), f"the operator exited:\n{logs()[-4000:]}"
        for name in names:
            status = _get(kube_cluster, ns, "pdd", name).get("status", {})
            ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
            if not ready or ready[0]["status"] != "True":
                return False
        return True

    try:
        eventually(all_ready, timeout=120, interval=0.5, message=f"{names} Ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- operator log ---\n{logs()[-4000:]}") from None


@contextlib.contextmanager
def _operator(
    kube_cluster: KubeCluster, ns: str, service_account: str, args: list[str], tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``pdserve operator`` with the chart's arguments, authenticated as the chart's ServiceAccount."""
    kubeconfig = _token_kubeconfig(kube_cluster, ns, service_account, tmp_path / "sa.kubeconfig")
    log = tmp_path / "operator.log"
    operator = spawn_pdserve(
        [*args, "--metrics-port=0", "--liveness-port=0", f"--kubeconfig={kubeconfig}", "--log-format=plain"],
        log,
        # What the chart's downward API gives the pod: the leader election's identity and the
        # namespace of its Lease (so the chart's Role for the Lease is what is tested).
        env={"KUBECONFIG": str(kubeconfig), "POD_NAME": f"{service_account}-0", "POD_NAMESPACE": ns},
    )
    try:
        yield operator, log
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(5)


# --- a production install --------------------------------------------------------------------------

PRODUCTION_VALUES = CHART / "ci" / "production-values.yaml"


@pytest.fixture
def pool_nodes(kube_cluster: KubeCluster) -> Iterator[list[str]]:
    with gpu_pool(kube_cluster, 2, labels={"node-pool.example.com/name": "h100"}) as names:
        yield names


def test_a_production_values_file_installs_and_serves_without_leaking_secrets(
    kube_cluster: KubeCluster, kube_namespace: str, crd: None, pool_nodes: list[str], tmp_path: Path
) -> None:
    """Taints and a node pool, a PVC model cache, a gated model's token, engine and router keys, an
    image pull secret and network policies: installed, Ready, and no key in status, events or logs."""
    ns = kube_namespace
    values = {name: f"{name}-{secrets.token_hex(12)}" for name in ("hf-token", "engine-key", "router-key")}
    for name, value in values.items():
        key = "token" if name == "hf-token" else "api-key"
        kube_cluster.kubectl("create", "secret", "generic", name, "-n", ns, f"--from-literal={key}={value}")
    kube_cluster.kubectl(
        "create", "secret", "docker-registry", "regcred", "-n", ns,
        "--docker-server=registry.example.com", "--docker-username=u", "--docker-password=p",
    )  # fmt: skip
    pv = _model_cache(kube_cluster, ns)
    name = f"pdserve-{secrets.token_hex(3)}"
    try:
        # The test cluster has no Prometheus Operator CRDs: the monitors the production values turn
        # on are checked against the rendered pods in tests/unit/test_chart_monitoring.py.
        kube_cluster.helm(
            "install", name, CHART, "--namespace", ns, "--values", PRODUCTION_VALUES,
            "--set", "operator.scope=namespaced", "--set", f"operator.namespaces={{{ns}}}",
            "--set", "metrics.serviceMonitor.enabled=false", "--set", "metrics.podMonitors.enabled=false",
            timeout=180,
        )  # fmt: skip
        manifest = [
            d for d in yaml.safe_load_all(kube_cluster.helm("get", "manifest", name, "-n", ns).stdout) if d
        ]
        assert {"NetworkPolicy", "PDDeployment"} <= {d["kind"] for d in manifest}
        for policy in ("engines", "routers"):
            kube_cluster.kubectl("get", "networkpolicy", f"{name}-{policy}", "-n", ns)
        (deployment,) = [d for d in manifest if d["kind"] == "Deployment"]
        pod_spec = deployment["spec"]["template"]["spec"]
        assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}]
        args = pod_spec["containers"][0]["args"]
        with _operator(kube_cluster, ns, pod_spec["serviceAccountName"], args, tmp_path) as (operator, log):
            _wait_ready(kube_cluster, ns, ["llama"], log.read_text, alive=lambda: operator.poll() is None)
            pods = _get(kube_cluster, ns, "pods", "-l", "pdserve.io/deployment=llama,pdserve.io/tier=engine")[
                "items"
            ]
            assert len(pods) == 2
            # The engines landed on the tainted pool (their template tolerates it and selects it).
            assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(pool_nodes)
            for pod in pods:
                claims = [
                    v["persistentVolumeClaim"]["claimName"]
                    for v in pod["spec"]["volumes"]
                    if "persistentVolumeClaim" in v
                ]
                assert claims == ["hf-cache"]
            pdd = _get(kube_cluster, ns, "pdd", "llama")
            events = kube_cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
            everything = {
                "status": json.dumps(pdd.get("status", {})),
                "events": events,
                "operator log": log.read_text(),
                "pods": json.dumps(pods),
                "router": kube_cluster.kubectl(
                    "get", "deployment", "llama-router", "-n", ns, "-o", "json"
                ).stdout,
            }
        for where, text in everything.items():
            for secret, value in values.items():
                assert value not in text, f"{secret} leaked into {where}"
        assert "Forbidden" not in everything["operator log"]
    finally:
        kube_cluster.helm("uninstall", name, "--namespace", ns, check=False, timeout=180)
        kube_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
