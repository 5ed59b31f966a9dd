"""The chart and the examples on a real API server (the test cluster; kwok makes pods Ready).

* Every example is valid against the CRD as the API server enforces it (schema and CEL).
* ``helm install`` (namespaced scope) creates the release's objects, and the operator, run with
  the chart's own ServiceAccount token (so the chart's RBAC is what is tested), brings example
  PDDeployments to Ready. The operator's image cannot run on kwok (its pods run no process), so
  it runs from the venv as ``pdserve operator``, the same program the image's entrypoint runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kube import REPO, KubeCluster, eventually, gpu_pool

pytestmark = pytest.mark.cluster

CHART = REPO / "charts" / "pdserve"
CRD = CHART / "crds" / "pddeployments.pdserve.io.yaml"
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))
READY_EXAMPLES = ["sim/quickstart.yaml", "nixl/1p-tp8-1d-tp8.yaml"]


@pytest.fixture
def crd(kube_cluster: KubeCluster) -> None:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", CRD)
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/pddeployments.pdserve.io", "--timeout=60s"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_example_is_valid_on_the_api_server(
    kube_cluster: KubeCluster, kube_namespace: str, crd: None, example: Path
) -> None:
    result = kube_cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", kube_namespace, "-f", example, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "(server dry run)" in result.stdout


@pytest.fixture
def release(kube_cluster: KubeCluster, kube_namespace: str, crd: None) -> Iterator[str]:
    name = f"pdserve-{secrets.token_hex(3)}"
    kube_cluster.helm(
        "install",
        name,
        CHART,
        "--namespace",
        kube_namespace,
        "--set",
        "operator.scope=namespaced",
        "--set",
        f"operator.namespaces={{{kube_namespace}}}",
        timeout=180,
    )
    try:
        yield name
    finally:
        kube_cluster.helm("uninstall", name, "--namespace", kube_namespace, check=False, timeout=180)


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


def test_helm_install_then_an_example_becomes_ready(
    kube_cluster: KubeCluster, kube_namespace: str, release: str, tmp_path: Path
) -> None:
    ns = kube_namespace
    manifest = kube_cluster.helm("get", "manifest", release, "--namespace", ns).stdout
    rendered = [d for d in yaml.safe_load_all(manifest) if d]
    kinds = sorted({d["kind"] for d in rendered})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    # Every object of the release exists on the server, where the chart said.
    for doc in rendered:
        where = (
            ["-n", doc["metadata"].get("namespace", ns)]
            if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding")
            else []
        )
        kube_cluster.kubectl("get", doc["kind"], doc["metadata"]["name"], *where)
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    service_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["operator", f"--namespace={ns}"]

    with _operator(kube_cluster, ns, service_account, args, tmp_path) as (operator, log):
        _serve_examples(kube_cluster, ns, operator, log)


def _serve_examples(kube_cluster: KubeCluster, ns: str, operator: subprocess.Popen[bytes], log: Path) -> None:
    for example in READY_EXAMPLES:
        kube_cluster.kubectl("apply", "-n", ns, "-f", REPO / "examples" / example)
    names = [yaml.safe_load((REPO / "examples" / e).read_text())["metadata"]["name"] for e in READY_EXAMPLES]
    _wait_ready(kube_cluster, ns, names, operator, log)
    for name in names:
        table = json.loads(_get(kube_cluster, ns, "configmap", f"{name}-routing")["data"]["routing.json"])
        assert all(i["ready"] for i in table["prefill"] + table["decode"])
        kube_cluster.kubectl("get", "pdb", f"{name}-prefill", f"{name}-decode", "-n", ns)  # the chart's RBAC
    text = log.read_text()
    assert "Forbidden" not in text, "the chart's RBAC must cover everything the operator does"
    assert "became leader" in text, "the chart's Role must let the operator hold its Lease"


def _wait_ready(
    kube_cluster: KubeCluster, ns: str, names: list[str], operator: subprocess.Popen[bytes], log: Path
) -> None:
    def all_ready() -> bool:
        assert operator.poll() is None, f"operator exited {operator.returncode}:\n{log.read_text()}"
        for name in names:
            status = _get(kube_cluster, ns, "pdd", name).get("status", {})
            ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
            if not ready or ready[0]["status"] != "True":
                return False
        return True

    try:
        eventually(all_ready, timeout=120, interval=0.5, message=f"{names} Ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- operator log ---\n{log.read_text()[-4000:]}") from None


@contextlib.contextmanager
def _operator(
    kube_cluster: KubeCluster, ns: str, service_account: str, args: list[str], tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``pdserve operator`` with the chart's arguments, authenticated as the chart's ServiceAccount."""
    kubeconfig = _token_kubeconfig(kube_cluster, ns, service_account, tmp_path / "sa.kubeconfig")
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                *args,
                "--metrics-port=0",
                "--liveness-port=0",
                f"--kubeconfig={kubeconfig}",
                "--log-format=plain",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            # What the chart's downward API gives the pod: the leader election's identity and the
            # namespace of its Lease (so the chart's Role for the Lease is what is tested).
            env={
                **os.environ,
                "KUBECONFIG": str(kubeconfig),
                "PYTHONUNBUFFERED": "1",
                "POD_NAME": f"{service_account}-0",
                "POD_NAMESPACE": ns,
            },
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
            _wait_ready(kube_cluster, ns, ["llama"], operator, log)
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
