"""Manifest builders: golden files for the RFC's five shapes with both connectors, plus the invariants.

Regenerate the golden files with ``PDSERVE_UPDATE_GOLDEN=1 pytest tests/unit/test_deployment_objects.py``
and review the diff: it is exactly what changes in users' clusters.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.cli import to_yaml
from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.render.defaults import (
    ENGINE_PRESTOP_SECONDS,
    ENGINE_TERMINATION_GRACE_SECONDS,
    ROUTER_PRESTOP_SECONDS,
    ROUTER_SHUTDOWN_GRACE_SECONDS,
)
from pdserve.deployment.render.engine_pod import (
    instance_pod,
    instance_pod_revision,
    pod_parallel_sizes,
    template_hash,
)
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.names import role_selector, selector_string
from pdserve.deployment.render.router import router_deployment, router_rbac, router_service
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table, routing_configmap
from pdserve.deployment.render.static_objects import desired_static_objects, engine_service
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.deployment.spec.pddeployment import DEFAULT_IMAGE, MAX_NAME_LENGTH, PDDeployment
from pdserve.routing import Role, build_slot_table, load_routing_table
from tests.support import specs

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "render"
UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"
UID = "5f0c2b8e-1d7a-4c1e-9a53-2b7d3c9e8f10"

TP8 = {"dataParallel": 1, "tensorParallel": 8}
DP8EP = {"dataParallel": 8, "tensorParallel": 1, "expertParallel": True}
#: The RFC's shapes: (prefill instances, prefill role) : (decode instances, decode role).
SHAPES = {
    "1P_TP8-1D_TP8": ((1, TP8), (1, TP8)),
    "2P_TP8-1D_DP8EP": ((2, TP8), (1, DP8EP)),
    "2P_TP8-2D_TP8": ((2, TP8), (2, TP8)),
    "2P_DP8EP-3D_DP8EP": ((2, DP8EP), (3, DP8EP)),
    "2P_DP8EP-4D_TP8": ((2, DP8EP), (4, TP8)),
}
CONNECTORS = {
    "nixl": ({"connector": "NixlConnector"}, "nvidia.com/gpu"),
    "moriio": ({"connector": "MoRIIOConnector", "transferMode": "READ"}, "amd.com/gpu"),
    "mooncake": ({"connector": "MooncakeConnector"}, "nvidia.com/gpu"),
}


def shape_manifest(shape: str, connector: str, **extra: Any) -> dict[str, Any]:
    (p_count, p_role), (d_count, d_role) = SHAPES[shape]
    kv, gpu = CONNECTORS[connector]
    spec = {
        "model": "deepseek-ai/DeepSeek-R1",
        "servedModelName": "deepseek-r1",
        "image": "vllm/vllm-openai:v0.11.0",
        "gpuResource": gpu,
        "kvTransfer": kv,
        "prefill": {"instances": p_count, **p_role},
        "decode": {"instances": d_count, **d_role},
        "router": {"replicas": 2},
    }
    return specs.manifest(
        "r1", metadata={"namespace": "serving", "uid": UID, "generation": 1}, **{**spec, **extra}
    )


def all_ready(pdd: PDDeployment) -> list[ObservedInstance]:
    return [
        ObservedInstance(role, i, f"{pdd.name}-{role.value}-{i}", f"10.0.{n}.{i + 10}", ready=True)
        for n, role in enumerate((Role.PREFILL, Role.DECODE))
        for i in range(pdd.spec.role(role).instances)
    ]


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("shape", SHAPES)
def test_golden_render(shape: str, connector: str) -> None:
    pdd = parse_pddeployment(shape_manifest(shape, connector))
    table = build_routing_table(pdd, all_ready(pdd), None)
    text = to_yaml(render_all(pdd, table))
    golden = GOLDEN / f"{shape}-{connector}.yaml"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSERVE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} differs; review and regenerate with PDSERVE_UPDATE_GOLDEN=1"
    )


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("shape", SHAPES)
def test_shape_invariants(shape: str, connector: str) -> None:
    pdd = parse_pddeployment(shape_manifest(shape, connector))
    spec = pdd.spec
    table = build_routing_table(pdd, all_ready(pdd), None)
    objects = render_all(pdd, table)
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert len(pods) == spec.prefill.instances + spec.decode.instances
    for pod in pods:
        role = Role(pod["metadata"]["labels"]["pdserve.io/role"])
        rs = spec.role(role)
        container = pod["spec"]["containers"][0]
        args = container["args"]
        assert container["command"] == ["vllm", "serve"]
        assert args[0] == spec.model
        assert _flag(args, "--data-parallel-size") == str(rs.data_parallel)
        assert _flag(args, "--tensor-parallel-size") == str(rs.tensor_parallel)
        assert ("--enable-expert-parallel" in args) == rs.expert_parallel
        kv = json.loads(_flag(args, "--kv-transfer-config"))
        assert kv["kv_connector"] == spec.kv_transfer.connector
        gpus = str(rs.data_parallel * rs.tensor_parallel)
        assert container["resources"]["requests"][spec.gpu_resource] == gpus
        assert container["resources"]["limits"][spec.gpu_resource] == gpus
    # The ConfigMap is the proxy's contract, read back with the proxy's parser.
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    parsed = load_routing_table(configmap["data"]["routing.json"])
    assert parsed == table
    slots = build_slot_table(parsed)
    assert len(slots.prefill) == spec.prefill.slots
    assert len(slots.decode) == spec.decode.slots
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["labels"]["pdserve.io/deployment"] == "r1"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdserve-operator"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pdserve.io/v1alpha1",
                "kind": "PDDeployment",
                "name": "r1",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def pdd_of(**spec: Any) -> PDDeployment:
    return parse_pddeployment(shape_manifest("2P_DP8EP-4D_TP8", "nixl", **spec))


def test_pod_identity_and_labels() -> None:
    pdd = pdd_of()
    pod = instance_pod(pdd, Role.DECODE, 3)
    meta = pod["metadata"]
    assert meta["name"] == "r1-decode-3"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": "r1",
        "app.kubernetes.io/component": "decode",
        "app.kubernetes.io/managed-by": "pdserve-operator",
        "pdserve.io/deployment": "r1",
        "pdserve.io/role": "decode",
        "pdserve.io/instance": "3",
        "pdserve.io/template-hash": template_hash(pdd, Role.DECODE),
        "pdserve.io/tier": "engine",
    }
    spec = pod["spec"]
    assert (spec["hostname"], spec["subdomain"], spec["restartPolicy"]) == (
        "decode-3",
        "r1-engines",
        "Always",
    )
    assert spec["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    # The role selector (scale subresource) matches exactly this role's pods.
    selector = role_selector(pdd, Role.DECODE)
    assert all(meta["labels"][k] == v for k, v in selector.items())
    assert selector_string(selector) == "pdserve.io/deployment=r1,pdserve.io/role=decode"
    prefill = instance_pod(pdd, Role.PREFILL, 0)["metadata"]["labels"]
    assert not all(prefill.get(k) == v for k, v in selector.items())


def test_pod_records_the_sizes_it_runs() -> None:
    pdd = pdd_of(prefill={"instances": 1, "dataParallel": 4, "tensorParallel": 2})
    pod = instance_pod(pdd, Role.PREFILL, 0)
    assert pod["metadata"]["annotations"] == {
        "pdserve.io/dp-size": "4",
        "pdserve.io/tp-size": "2",
        "pdserve.io/revision": pairing_revision(pdd, Role.PREFILL),
    }
    assert pod_parallel_sizes(pod) == (4, 2)
    assert instance_pod_revision(pod) == pairing_revision(pdd, Role.PREFILL)
    # The annotations are not part of the template: adding them rolls no pod.
    assert "dp-size" not in json.dumps(pod["spec"]) and "revision" not in json.dumps(pod["spec"])
    del pod["metadata"]["annotations"]  # a pod created before revisions: the table uses the spec's
    assert instance_pod_revision(pod) is None


@pytest.mark.parametrize("engine", ["vllm", "sim"])
def test_pods_without_the_annotations_are_read_from_the_engine_flags(engine: str) -> None:
    pdd = pdd_of(engine=engine, decode={"instances": 1, "dataParallel": 8, "tensorParallel": 1})
    pod = instance_pod(pdd, Role.DECODE, 0)
    del pod["metadata"]["annotations"]  # a pod created before the annotations existed
    assert pod_parallel_sizes(pod) == (8, 1)
    pod["spec"]["containers"][0]["args"] = ["serve", "--data-parallel-size", "x"]
    assert pod_parallel_sizes(pod) == (None, None)
    assert pod_parallel_sizes({"metadata": {"annotations": {"pdserve.io/dp-size": "0"}}}) == (None, None)


def test_probes_are_patient_enough_for_model_loading() -> None:
    container = instance_pod(pdd_of(), Role.PREFILL, 0)["spec"]["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_nixl_side_channel_host_is_the_pod_ip() -> None:
    env = instance_pod(pdd_of(), Role.PREFILL, 0)["spec"]["containers"][0]["env"]
    assert {
        "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    } in env


def test_user_args_env_and_placement_are_carried() -> None:
    pdd = pdd_of(
        prefill={
            "instances": 1,
            "dataParallel": 2,
            "args": ["--max-model-len=32768", "--enforce-eager"],
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "resources": {"limits": {"memory": "200Gi"}, "requests": {"cpu": "16"}},
            "nodeSelector": {"pool": "mi300"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
            },
        }
    )
    pod = instance_pod(pdd, Role.PREFILL, 0)
    container = pod["spec"]["containers"][0]
    assert container["args"][-2:] == ["--max-model-len=32768", "--enforce-eager"]
    assert container["env"][-1]["name"] == "HF_TOKEN"
    assert container["resources"] == {
        "limits": {"memory": "200Gi", "nvidia.com/gpu": "2"},
        "requests": {"cpu": "16", "nvidia.com/gpu": "2"},
    }
    assert pod["spec"]["nodeSelector"] == {"pool": "mi300"}
    assert pod["spec"]["tolerations"][0]["key"] == "gpu"
    assert "nodeAffinity" in pod["spec"]["affinity"]
    # Rendering twice gives equal, independent objects (the operator mutates what it applies).
    again = instance_pod(pdd, Role.PREFILL, 0)
    assert again == pod
    again["spec"]["containers"][0]["resources"]["limits"]["memory"] = "1Gi"
    assert pdd.spec.prefill.resources["limits"]["memory"] == "200Gi"


def test_moriio_kv_transfer_config_per_role() -> None:
    pdd = parse_pddeployment(shape_manifest("1P_TP8-1D_TP8", "moriio"))
    configs = {}
    for role in Role:
        args = instance_pod(pdd, role, 0)["spec"]["containers"][0]["args"]
        configs[role] = json.loads(_flag(args, "--kv-transfer-config"))
    assert configs[Role.PREFILL]["kv_role"] == "kv_producer"
    assert configs[Role.DECODE]["kv_role"] == "kv_consumer"
    extra = configs[Role.PREFILL]["kv_connector_extra_config"]
    assert extra["read_mode"] is True
    assert extra["proxy_ip"] == ""  # no discovery heartbeat: the routing table is the discovery
    for key in ("handshake_port", "notify_port", "http_port", "proxy_ping_port"):
        assert isinstance(extra[key], int)
    env = instance_pod(pdd, Role.DECODE, 0)["spec"]["containers"][0]["env"]
    assert {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env


def test_extra_config_is_merged_last() -> None:
    pdd = parse_pddeployment(
        shape_manifest(
            "1P_TP8-1D_TP8",
            "moriio",
            kvTransfer={
                "connector": "MoRIIOConnector",
                "transferMode": "WRITE",
                "extraConfig": {"notify_port": 62000, "backend": "xgmi"},
            },
        )
    )
    args = instance_pod(pdd, Role.DECODE, 0)["spec"]["containers"][0]["args"]
    extra = json.loads(_flag(args, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert (extra["notify_port"], extra["backend"], extra["read_mode"]) == (62000, "xgmi", False)


@pytest.mark.parametrize(("role", "kv_role"), [(Role.PREFILL, "kv_producer"), (Role.DECODE, "kv_consumer")])
def test_nixl_kv_transfer_config(role: Role, kv_role: str) -> None:
    # vLLM 0.32 deprecates kv_both for NixlConnector: the prefill produces, the decode consumes.
    pdd = pdd_of(kvTransfer={"connector": "NixlConnector", "extraConfig": {"backends": ["UCX"]}})
    args = instance_pod(pdd, role, 0)["spec"]["containers"][0]["args"]
    assert json.loads(_flag(args, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }


def test_sim_engine_pod() -> None:
    pdd = pdd_of(engine="sim", image="", prefill={"instances": 1, "dataParallel": 4, "tensorParallel": 2})
    container = instance_pod(pdd, Role.PREFILL, 0)["spec"]["containers"][0]
    assert container["image"] == DEFAULT_IMAGE
    assert container["command"] == ["pdserve", "sim"]
    args = container["args"]
    assert _flag(args, "--role") == "prefill"
    assert _flag(args, "--dp-size") == "4"
    assert _flag(args, "--tp-size") == "2"
    assert _flag(args, "--port") == "8000"
    assert _flag(args, "--host") == "0.0.0.0"
    assert _flag(args, "--model") == "deepseek-r1"
    assert _flag(args, "--instance-name") == "r1-prefill-0"
    assert _flag(args, "--kv-host") == "$(POD_IP)"
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])  # the sim needs no GPUs
    assert any(e["name"] == "POD_IP" for e in container["env"])


def test_sim_image_follows_the_router_image() -> None:
    pdd = pdd_of(engine="sim", image="", router={"image": "registry.local/pdserve:dev"})
    assert instance_pod(pdd, Role.DECODE, 0)["spec"]["containers"][0]["image"] == "registry.local/pdserve:dev"


def test_router_deployment() -> None:
    pdd = pdd_of(router={"replicas": 3, "policy": "least-outstanding", "backlog": 1024, "port": 9100})
    dep = router_deployment(pdd)
    assert dep["metadata"]["name"] == "r1-router"
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
    container = pod["spec"]["containers"][0]
    assert container["image"] == DEFAULT_IMAGE
    assert container["command"] == ["pdserve"]
    args = container["args"]
    assert args[0] == "proxy"
    # The table comes from a watch of the ConfigMap in the pod's own namespace (downward API).
    assert _flag(args, "--routing-configmap") == "$(POD_NAMESPACE)/r1-routing"
    assert "--routing-file" not in args
    assert container["env"][0] == {
        "name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    }
    assert (_flag(args, "--port"), _flag(args, "--policy"), _flag(args, "--backlog")) == (
        "9100",
        "least-outstanding",
        "1024",
    )
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # Metrics, /debug/* and profiling on the admin port, which the Service does not expose.
    assert _flag(args, "--admin-port") == "9000"
    assert {"name": "admin", "containerPort": 9000, "protocol": "TCP"} in container["ports"]
    assert router_service(pdd)["spec"]["ports"] == [
        {"name": "http", "port": 9100, "targetPort": "http", "protocol": "TCP"}
    ]
    assert "volumeMounts" not in container and "volumes" not in pod["spec"]
    # Its token is how it watches: the account the Role is bound to, mounted.
    assert pod["spec"]["serviceAccountName"] == "r1-router"
    assert pod["spec"]["automountServiceAccountToken"] is True


def test_router_shuts_down_cleanly() -> None:
    """preStop sleeps while the endpoints drop it; the grace covers the sleep and the streams."""
    pod = router_deployment(pdd_of())["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SECONDS}}}
    grace = float(_flag(container["args"], "--shutdown-grace-seconds") or 0)
    assert grace == ROUTER_SHUTDOWN_GRACE_SECONDS
    assert pod["terminationGracePeriodSeconds"] >= ROUTER_PRESTOP_SECONDS + grace


def test_engine_pods_leave_the_tables_before_sigterm() -> None:
    for engine in ("sim", "vllm"):
        pod = instance_pod(pdd_of(engine=engine), Role.DECODE, 0)["spec"]
        container = pod["containers"][0]
        assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": ENGINE_PRESTOP_SECONDS}}}
        assert pod["terminationGracePeriodSeconds"] == ENGINE_TERMINATION_GRACE_SECONDS
        assert pod["terminationGracePeriodSeconds"] > ENGINE_PRESTOP_SECONDS
        assert pod["automountServiceAccountToken"] is False  # an engine never calls the API


def test_router_rbac_reads_only_its_routing_configmap() -> None:
    pdd = pdd_of()
    account, role, binding = router_rbac(pdd)
    assert {o["metadata"]["name"] for o in (account, role, binding)} == {"r1-router"}
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["r1-routing"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    rbac = "rbac.authorization.k8s.io"
    assert binding["roleRef"] == {"apiGroup": rbac, "kind": "Role", "name": "r1-router"}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "r1-router", "namespace": pdd.namespace}
    ]
    for obj in (account, role, binding):  # garbage-collected with the PDDeployment
        assert obj["metadata"]["ownerReferences"][0]["uid"] == pdd.uid


def test_services() -> None:
    pdd = pdd_of(router={"port": 9100, "serviceType": "LoadBalancer"})
    svc = router_service(pdd)
    assert svc["metadata"]["name"] == "r1"
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9100, "targetPort": "http", "protocol": "TCP"}]
    router_labels = router_deployment(pdd)["spec"]["template"]["metadata"]["labels"]
    assert all(router_labels[k] == v for k, v in svc["spec"]["selector"].items())
    headless = engine_service(pdd)
    assert headless["metadata"]["name"] == "r1-engines"
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = instance_pod(pdd, Role.PREFILL, 0)["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in headless["spec"]["selector"].items())
    assert not all(router_labels.get(k) == v for k, v in headless["spec"]["selector"].items())
    assert [(o["kind"], o["metadata"]["name"]) for o in desired_static_objects(pdd)] == [
        ("Service", "r1-engines"),
        ("Service", "r1"),
        ("ServiceAccount", "r1-router"),
        ("Role", "r1-router"),
        ("RoleBinding", "r1-router"),
        ("Deployment", "r1-router"),
        ("PodDisruptionBudget", "r1-prefill"),
        ("PodDisruptionBudget", "r1-decode"),
    ]


def test_routing_configmap_holds_the_table_json() -> None:
    pdd = pdd_of()
    table = build_routing_table(pdd, all_ready(pdd), None)
    cm = routing_configmap(pdd, table)
    assert cm["metadata"]["name"] == "r1-routing"
    assert cm["data"] == {"routing.json": table.to_json()}
    assert cm["metadata"]["labels"]["app.kubernetes.io/component"] == "routing"


def test_render_all_without_a_table_has_an_empty_one() -> None:
    objects = render_all(pdd_of())
    table = load_routing_table(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["routing.json"])
    assert (table.prefill, table.decode, table.generation) == ((), (), 1)
    assert [o["kind"] for o in objects[:9]] == [
        "Service",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "ConfigMap",
    ]


def test_no_owner_reference_without_uid() -> None:
    doc = shape_manifest("1P_TP8-1D_TP8", "nixl")
    del doc["metadata"]["uid"]
    for obj in render_all(parse_pddeployment(doc)):
        assert "ownerReferences" not in obj["metadata"]


# --- template hash -----------------------------------------------------------------------------


def _hash(role: Role = Role.PREFILL, **spec: Any) -> str:
    return template_hash(pdd_of(**spec), role)


def _role(**changes: Any) -> dict[str, Any]:
    return {"instances": 2, **DP8EP, **changes}


def test_template_hash_is_stable_and_short() -> None:
    assert _hash() == _hash()
    assert len(_hash()) == 10
    assert _hash(Role.PREFILL) != _hash(Role.DECODE)


def test_template_hash_ignores_the_instance_count_and_the_other_role() -> None:
    base = _hash(prefill=_role())
    assert _hash(prefill=_role(instances=7)) == base
    assert _hash(prefill=_role(instances=0)) == base
    assert _hash(prefill=_role(), decode={"instances": 9, **TP8, "args": ["--x"]}) == base
    assert _hash(prefill=_role(), router={"replicas": 5, "policy": "least-outstanding"}) == base
    assert _hash(prefill=_role(), rollout={"maxUnavailable": 3, "drainSeconds": 5}) == base


@pytest.mark.parametrize(
    "change",
    [
        {"image": "vllm/vllm-openai:v0.12.0"},
        {"model": "deepseek-ai/DeepSeek-V3"},
        {"servedModelName": "other"},
        {"kvTransfer": {"connector": "NixlConnector", "extraConfig": {"backends": ["UCX"]}}},
        {"prefill": _role(args=["--enforce-eager"])},
        {"prefill": _role(env=[{"name": "A", "value": "1"}])},
        {"prefill": _role(resources={"limits": {"memory": "1Ti"}})},
        {"prefill": _role(dataParallel=4)},
        {"prefill": _role(dataParallel=4, tensorParallel=2)},
        {"prefill": _role(expertParallel=False)},
        {"prefill": _role(nodeSelector={"pool": "a"})},
        {"prefill": _role(tolerations=[{"operator": "Exists"}])},
    ],
)
def test_template_hash_changes_with_what_defines_a_pod(change: dict[str, Any]) -> None:
    assert _hash(**change) != _hash(prefill=_role())


def test_objects_are_fresh_copies() -> None:
    pdd = pdd_of()
    first = render_all(pdd)
    second = copy.deepcopy(first)
    first[5]["spec"]["replicas"] = 99
    assert render_all(pdd) == second


def test_longest_name_and_highest_index_give_valid_hostnames() -> None:
    doc = shape_manifest("1P_TP8-1D_TP8", "nixl", prefill={"instances": 1024, **TP8})
    doc["metadata"]["name"] = "a" * MAX_NAME_LENGTH
    pdd = parse_pddeployment(doc)
    for role in Role:
        spec = instance_pod(pdd, role, 1023)["spec"]
        assert len(spec["hostname"]) <= 63 and len(spec["subdomain"]) <= 63
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", spec["hostname"])
