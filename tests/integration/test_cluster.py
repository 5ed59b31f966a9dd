"""The Kubernetes test control plane (hack/cluster) behaves like a real cluster.

Each test asserts behaviour a broken control plane would get wrong: version wiring, kwok fake
GPU nodes, scheduling and pod readiness, CEL validation in CRDs, garbage collection and namespace
deletion (both done by kube-controller-manager).
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import KubeCluster, KubeCommandError, eventually

pytestmark = pytest.mark.cluster

KUBE_VERSION = "v1.36.3"
GPU = "nvidia.com/gpu"
GPU_NODES = [f"gpu-node-{i}" for i in range(4)]  # registered by hack/cluster/up


def get_json(cluster: KubeCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def not_found(cluster: KubeCluster, *args: str) -> bool:
    out = cluster.kubectl("get", *args, "-o", "name", check=False)
    if out.returncode == 0:
        return False
    assert "NotFound" in out.stderr, out.stderr
    return True


def test_kubectl_and_server_report_pinned_version(kube_cluster: KubeCluster) -> None:
    out = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    assert out["clientVersion"]["gitVersion"] == KUBE_VERSION
    assert out["clientVersion"]["gitTreeState"] == "clean"
    if kube_cluster.is_local:
        assert out["serverVersion"]["gitVersion"] == KUBE_VERSION
        assert (out["serverVersion"]["major"], out["serverVersion"]["minor"]) == ("1", "36")
    else:
        assert out["serverVersion"]["major"] == "1"


def test_helm_is_built_for_this_kubernetes(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    out = kube_cluster.helm("version", "--short")
    assert out.stdout.startswith("v3.21."), out.stdout
    # `helm template` renders against the Kubernetes version baked in at build time; an unstamped
    # build would say v1.20.0.
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\n"
        "data: {kube: '{{ .Capabilities.KubeVersion.Version }}'}\n"
    )
    rendered = kube_cluster.helm("template", "probe", str(chart)).stdout
    assert "kube: 'v1.36.0'" in rendered, rendered


def test_fake_gpu_nodes_are_ready_with_gpus(local_cluster: KubeCluster, kube_api: Any) -> None:
    # Other tests (e.g. benchmarks) may add kwok nodes of their own: look at ours only.
    nodes = [
        n
        for n in get_json(local_cluster, "nodes", "-l", "type=kwok")["items"]
        if n["metadata"]["name"] in GPU_NODES
    ]
    names = sorted(n["metadata"]["name"] for n in nodes)
    assert names == GPU_NODES, names
    for node in nodes:
        name = node["metadata"]["name"]
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", (name, node["status"]["conditions"])
        assert node["status"]["allocatable"][GPU] == "8", (name, node["status"]["allocatable"])
        assert node["status"]["capacity"][GPU] == "8", name
        # Only GPU pods (which ExtendedResourceToleration lets tolerate it) land here.
        gpu_taint = {"key": GPU, "value": "present", "effect": "NoSchedule"}
        assert node["spec"].get("taints") == [gpu_taint], (name, node["spec"].get("taints"))
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"

    # The Python client sees the same through the kube_api fixture.
    from kubernetes import client

    listed = client.CoreV1Api(kube_api).list_node(label_selector="type=kwok")
    ours = [n for n in listed.items if n.metadata.name in GPU_NODES]
    assert sorted(n.metadata.name for n in ours) == names
    assert all(n.status.allocatable[GPU] == "8" for n in ours)


def deployment_manifest(name: str, replicas: int, gpus: int) -> str:
    return textwrap.dedent(
        f"""\
        apiVersion: apps/v1
        kind: Deployment
        metadata:
          name: {name}
        spec:
          replicas: {replicas}
          selector:
            matchLabels: {{app: {name}}}
          template:
            metadata:
              labels: {{app: {name}}}
            spec:
              affinity:
                nodeAffinity:
                  requiredDuringSchedulingIgnoredDuringExecution:
                    nodeSelectorTerms:
                    - matchExpressions:
                      - {{key: kubernetes.io/hostname, operator: In, values: [{", ".join(GPU_NODES)}]}}
              containers:
              - name: main
                image: registry.invalid/pdserve/never-pulled:0
                resources:
                  requests: {{cpu: "1", memory: 1Gi, {GPU}: "{gpus}"}}
                  limits: {{{GPU}: "{gpus}"}}
        """
    )


def test_deployment_pods_are_scheduled_and_become_ready(
    kube_cluster: KubeCluster, local_namespace: str
) -> None:
    kube_cluster.apply(deployment_manifest("gpu-app", replicas=3, gpus=4), namespace=local_namespace)

    def ready_pods() -> list[dict[str, Any]] | None:
        pods = get_json(kube_cluster, "pods", "-n", local_namespace, "-l", "app=gpu-app")["items"]
        ok = [
            p
            for p in pods
            if p["status"].get("phase") == "Running"
            and p["status"].get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ]
        return ok if len(ok) == 3 else None

    pods = eventually(ready_pods, timeout=60, message="3 Running and Ready pods of Deployment gpu-app")
    for pod in pods:
        assert pod["spec"]["nodeName"] in GPU_NODES, pod["spec"].get("nodeName")
        ipaddress.ip_address(pod["status"]["podIP"])  # a real address, not a placeholder
    # 4 GPUs each on 8-GPU nodes: the scheduler can fit at most two of them per node.
    per_node: dict[str, int] = {}
    for pod in pods:
        per_node[pod["spec"]["nodeName"]] = per_node.get(pod["spec"]["nodeName"], 0) + 1
    assert max(per_node.values()) <= 2, per_node

    # The deployment controller sees them too.
    eventually(
        lambda: (
            get_json(kube_cluster, "deployment", "gpu-app", "-n", local_namespace)["status"].get(
                "readyReplicas"
            )
            == 3
        ),
        timeout=30,
        message="Deployment gpu-app readyReplicas == 3",
    )


def test_pod_asking_for_more_gpus_than_a_node_has_stays_pending(
    kube_cluster: KubeCluster, local_namespace: str
) -> None:
    kube_cluster.apply(deployment_manifest("too-big", replicas=1, gpus=9), namespace=local_namespace)

    def unschedulable() -> dict[str, Any] | None:
        pods = get_json(kube_cluster, "pods", "-n", local_namespace, "-l", "app=too-big")["items"]
        for pod in pods:
            for cond in pod["status"].get("conditions", []):
                if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return {"pod": pod, "cond": cond}
        return None

    found = eventually(unschedulable, timeout=60, message="the 9-GPU pod to be marked Unschedulable")
    assert f"Insufficient {GPU}" in found["cond"]["message"], found["cond"]
    assert not found["pod"]["spec"].get("nodeName")


CRD = textwrap.dedent(
    """\
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata:
      name: widgets.test.pdserve.io
    spec:
      group: test.pdserve.io
      scope: Namespaced
      names: {plural: widgets, singular: widget, kind: Widget, listKind: WidgetList}
      versions:
      - name: v1
        served: true
        storage: true
        schema:
          openAPIV3Schema:
            type: object
            properties:
              spec:
                type: object
                required: [replicas, maxReplicas]
                properties:
                  replicas: {type: integer, minimum: 0}
                  maxReplicas: {type: integer, minimum: 0}
                x-kubernetes-validations:
                - rule: "self.replicas <= self.maxReplicas"
                  message: "replicas must not exceed maxReplicas"
    """
)


def widget(name: str, replicas: int, max_replicas: int) -> str:
    return json.dumps(
        {
            "apiVersion": "test.pdserve.io/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "maxReplicas": max_replicas},
        }
    )


def test_crd_cel_rule_rejects_bad_object(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    kube_cluster.apply(CRD)
    try:
        kube_cluster.wait_established("widgets.test.pdserve.io", timeout=30)
        # Discovery may lag the Established condition by a moment.
        eventually(
            lambda: (
                kube_cluster.kubectl(
                    "create", "-n", kube_namespace, "-f", "-", input=widget("good", 1, 2)
                ).returncode
                == 0
            ),
            timeout=30,
            message="creating a valid Widget",
        )
        with pytest.raises(KubeCommandError) as err:
            kube_cluster.kubectl("create", "-n", kube_namespace, "-f", "-", input=widget("bad", 3, 2))
        assert "replicas must not exceed maxReplicas" in err.value.stderr
        assert not_found(kube_cluster, "widget", "bad", "-n", kube_namespace)
        assert get_json(kube_cluster, "widget", "good", "-n", kube_namespace)["spec"]["replicas"] == 1
        # Updates go through the same rule.
        with pytest.raises(KubeCommandError) as err:
            kube_cluster.kubectl(
                "patch",
                "widget",
                "good",
                "-n",
                kube_namespace,
                "--type=merge",
                "-p",
                '{"spec":{"replicas":5}}',
            )
        assert "replicas must not exceed maxReplicas" in err.value.stderr
    finally:
        kube_cluster.kubectl("delete", "crd", "widgets.test.pdserve.io", "--ignore-not-found", check=False)


def test_deleting_owner_garbage_collects_dependents(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    kube_cluster.kubectl("create", "configmap", "owner", "-n", ns, "--from-literal=k=v")
    uid = get_json(kube_cluster, "configmap", "owner", "-n", ns)["metadata"]["uid"]
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
        },
        "data": {"k": "v"},
    }
    kube_cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(dependent))
    kube_cluster.kubectl("create", "configmap", "bystander", "-n", ns, "--from-literal=k=v")

    kube_cluster.kubectl("delete", "configmap", "owner", "-n", ns)
    eventually(
        lambda: not_found(kube_cluster, "configmap", "dependent", "-n", ns),
        timeout=60,
        message="the garbage collector to delete ConfigMap dependent",
    )
    # Objects without the owner reference stay.
    assert not not_found(kube_cluster, "configmap", "bystander", "-n", ns)


def test_namespace_deletion_completes(kube_cluster: KubeCluster) -> None:
    name = f"t-ns-delete-{secrets.token_hex(3)}"
    kube_cluster.kubectl("create", "namespace", name)
    try:
        kube_cluster.kubectl("create", "configmap", "content", "-n", name, "--from-literal=k=v")
        kube_cluster.kubectl("delete", "namespace", name, "--wait=false")
        eventually(
            lambda: not_found(kube_cluster, "namespace", name),
            timeout=90,
            interval=0.5,
            message=f"namespace {name} to be deleted by the namespace controller",
        )
    finally:
        kube_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
