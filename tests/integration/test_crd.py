"""The PDDeployment CRD on a real API server: defaults, CEL rules, enums and bounds, explain, scale, columns.

Each refused manifest is also refused by the Python parser (what ``pdserve up`` and
``pdserve render`` use), so a file means the same inside and outside a cluster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.routing_table import build_routing_table
from pdserve.deployment.spec import owned as pt
from pdserve.deployment.spec import vllm_compat
from pdserve.deployment.spec.parse import SpecError, parse_pddeployment
from pdserve.deployment.validate import problems
from pdserve.kv import moriio
from pdserve.kv.base import Rule
from tests.support.kube import KubeCluster, eventually
from tests.support.specs import ENGINE_TEMPLATE, manifest
from tests.unit.test_deployment_objects import CONNECTORS, SHAPES, all_ready, shape_manifest

pytestmark = pytest.mark.cluster

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "pddeployments.pdserve.io.yaml"
CRD_NAME = "pddeployments.pdserve.io"


@pytest.fixture(scope="session")
def crd(kube_cluster: KubeCluster) -> KubeCluster:
    """The CRD applied (idempotent: server-side apply of the same file) and served."""
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", CRD_PATH)
    kube_cluster.wait_established(CRD_NAME, timeout=60)
    eventually(
        lambda: kube_cluster.kubectl("get", "pdd", "-A", check=False).returncode == 0,
        timeout=60,
        message="the pdd resource in discovery",
    )
    return kube_cluster


def create(cluster: KubeCluster, namespace: str, obj: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj), check=check)


def get(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "pdd", name, "-n", namespace, "-o", "json")
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_valid_manifest_is_accepted_and_defaulted_like_the_parser(
    crd: KubeCluster, kube_namespace: str
) -> None:
    obj = manifest(
        kvTransfer={"connector": "MoRIIOConnector", "transferMode": "WRITE"}, gpuResource="amd.com/gpu"
    )
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "r1")
    spec = stored["spec"]
    assert spec["engine"] == "vllm"
    assert spec["kvTransfer"] == {"connector": "MoRIIOConnector", "transferMode": "WRITE", "extraConfig": {}}
    assert spec["prefill"] == {
        "instances": 1,
        "dataParallel": 1,
        "tensorParallel": 1,
        "expertParallel": False,
        "pipelineParallel": 1,
        "args": [],
        "env": [],
        "resources": {},
        "nodeSelector": {},
        "tolerations": [],
        "affinity": {},
        "shmSize": "8Gi",
        "startupTimeoutSeconds": 3600,
        "disruptionBudget": {"maxUnavailable": 1},
    }
    assert spec["decode"] == spec["prefill"]
    assert spec["router"] == {
        "replicas": 1,
        "image": "",
        "policy": "flat-interleaved",
        "backlog": 4096,
        "workers": 2,
        "port": 8000,
        "serviceType": "ClusterIP",
        "adminPort": 9000,
        "placement": "deployment",
    }
    assert spec["rollout"] == {"maxUnavailable": 1, "maxSurge": 1, "drainSeconds": 30, "nodeLossSeconds": 300}
    assert spec["multiNode"] == {
        "backend": "pods",
        "apiServers": "perNode",
        "gangTimeoutSeconds": 600,
        "rpcPort": 13345,
    }
    assert "gpusPerNode" not in spec and "gpusPerNode" not in spec["prefill"]
    # The operator's view of the stored object equals the file's view without an API server.
    from_server = parse_pddeployment(stored)
    assert from_server.spec == parse_pddeployment(obj).spec
    assert from_server.uid == stored["metadata"]["uid"] != ""
    assert from_server.namespace == kube_namespace


def test_preserved_fields_keep_their_content(crd: KubeCluster, kube_namespace: str) -> None:
    obj = manifest(
        kvTransfer={"connector": "NixlConnector", "extraConfig": {"backends": ["UCX"], "nested": {"a": 1}}},
        prefill={
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "resources": {"limits": {"memory": "200Gi"}},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "affinity": {"podAntiAffinity": {}},
        },
    )
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "r1")["spec"]
    assert stored["kvTransfer"]["extraConfig"] == {"backends": ["UCX"], "nested": {"a": 1}}
    assert stored["prefill"]["env"] == obj["spec"]["prefill"]["env"]
    assert stored["prefill"]["resources"] == {"limits": {"memory": "200Gi"}}
    assert stored["prefill"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]


BUDGET_MESSAGE = (
    "disruptionBudget.maxUnavailable: expected an integer from 0 to 1024 or a percentage from 0% to 100%"
)
REFUSED = [
    pytest.param(
        {"kvTransfer": {"connector": "MoRIIOConnector"}},
        "transferMode (READ or WRITE) is required with connector MoRIIOConnector",
        id="cel-moriio-needs-transfer-mode",
    ),
    pytest.param(
        {"kvTransfer": {"connector": "NixlConnector", "transferMode": "READ"}},
        "transferMode is only valid with connector MoRIIOConnector",
        id="cel-transfer-mode-only-moriio",
    ),
    pytest.param(
        {"prefill": {"expertParallel": True}},
        "expertParallel needs more than one GPU per instance",
        id="cel-expert-parallel",
    ),
    pytest.param(
        {"gpusPerNode": 8, "prefill": {"dataParallel": 12}},
        "prefill.dataParallel: an instance larger than a node (gpusPerNode) must fill whole nodes",
        id="cel-multi-node-dp-divides",
    ),
    pytest.param(
        {"decode": {"dataParallel": 6, "tensorParallel": 2, "gpusPerNode": 8}},
        "decode.dataParallel: an instance larger than a node (gpusPerNode) must fill whole nodes",
        id="cel-multi-node-dp-divides-role-override",
    ),
    pytest.param(
        {"gpusPerNode": 8, "decode": {"dataParallel": 2, "tensorParallel": 8, "pipelineParallel": 2}},
        "decode.dataParallel: must be 1 when a rank (tensorParallel x pipelineParallel) is larger",
        id="cel-multi-node-spanning-rank-dp1",
    ),
    pytest.param(
        {"gpusPerNode": 8, "prefill": {"tensorParallel": 16}},
        "prefill.tensorParallel: larger than a node (gpusPerNode): tensor parallelism across nodes needs "
        "pipelineParallel > 1",
        id="cel-multi-node-tp-within-node",
    ),
    pytest.param(
        {"gpusPerNode": 8, "prefill": {"tensorParallel": 4, "pipelineParallel": 3}},
        "prefill.tensorParallel: a rank larger than a node (tensorParallel x pipelineParallel) must be a "
        "multiple of gpusPerNode",
        id="cel-multi-node-whole-nodes",
    ),
    pytest.param({"multiNode": {"rpcPort": 8000}}, "multiNode.rpcPort must differ", id="cel-rpc-port"),
    pytest.param({"multiNode": {"backend": "grove"}}, 'Unsupported value: "grove"', id="enum-backend"),
    pytest.param({"multiNode": {"apiServers": "all"}}, 'Unsupported value: "all"', id="enum-api-servers"),
    pytest.param({"gpusPerNode": 0}, "should be greater than or equal to 1", id="bound-gpus-per-node"),
    pytest.param(
        {"multiNode": {"gangTimeoutSeconds": 5}}, "should be greater than or equal to 10", id="bound-gang"
    ),
    pytest.param({"image": ""}, "image is required when engine is vllm", id="cel-image"),
    pytest.param({"engine": "trtllm"}, 'Unsupported value: "trtllm"', id="enum-engine"),
    pytest.param({"router": {"policy": "random"}}, 'Unsupported value: "random"', id="enum-policy"),
    pytest.param(
        {"router": {"prefillPolicy": "cache_aware"}},
        'Unsupported value: "cache_aware"',
        id="enum-prefill-policy",
    ),
    pytest.param(
        {"kvTransfer": {"connector": "LMCache"}}, 'Unsupported value: "LMCache"', id="enum-connector"
    ),
    pytest.param(
        {"router": {"serviceType": "ExternalName"}},
        'Unsupported value: "ExternalName"',
        id="enum-service-type",
    ),
    pytest.param({"router": {"port": 0}}, "should be greater than or equal to 1", id="bound-port"),
    pytest.param(
        {"rollout": {"maxUnavailable": -1}}, "should be greater than or equal to 0", id="bound-max-unavail"
    ),
    pytest.param(
        {"rollout": {"maxUnavailable": 0, "maxSurge": 0}},
        "maxSurge and maxUnavailable cannot both be 0",
        id="no-surge-no-unavailable",
    ),
    pytest.param(
        {"rollout": {"nodeLossSeconds": 86401}}, "should be less than or equal to 86400", id="bound-node-loss"
    ),
    *[
        pytest.param(
            {"decode": {"disruptionBudget": {"maxUnavailable": value}}},
            BUDGET_MESSAGE,
            id=f"cel-disruption-budget-{value}",
        )
        for value in (-1, 1025, "1", "101%", "50 %", "")
    ],
    pytest.param(
        {"prefill": {"disruptionBudget": {"maxUnavailable": 1.5}}},
        "must be of type",  # int-or-string admits no fractions
        id="type-disruption-budget",
    ),
    pytest.param({"prefill": {"tensorParallel": 65}}, "should be less than or equal to 64", id="bound-tp"),
    pytest.param({"decode": {"instances": -1}}, "should be greater than or equal to 0", id="bound-instances"),
    pytest.param({"prefill": {"dataParallel": "8"}}, "must be of type integer", id="type-dp"),
    pytest.param({"gpuResource": "gpu"}, "should match", id="pattern-gpu-resource"),
    pytest.param({"model": ""}, "should be at least 1 chars long", id="min-length-model"),
]


@pytest.mark.parametrize(("spec", "message"), REFUSED)
def test_invalid_manifest_is_refused_with_the_rules_message(
    crd: KubeCluster, kube_namespace: str, spec: dict[str, Any], message: str
) -> None:
    assert_refused(crd, kube_namespace, spec, message)


@pytest.mark.parametrize(
    "spec",
    [
        {
            "gpusPerNode": 8,
            "prefill": {"dataParallel": 16, "expertParallel": True},
            "decode": {"dataParallel": 32},
        },
        {"gpusPerNode": 8, "decode": {"tensorParallel": 8, "pipelineParallel": 2}},
        {"gpusPerNode": 8, "decode": {"tensorParallel": 16, "pipelineParallel": 2}},
        {
            "prefill": {"dataParallel": 8, "tensorParallel": 2, "gpusPerNode": 8},
            "multiNode": {"backend": "lws"},
        },
        {"decode": {"dataParallel": 12}},  # no gpusPerNode: the operator decides with the nodes' count
    ],
    ids=["deepseek", "tp8-pp2", "tp16-pp2", "role-override-lws", "no-gpus-per-node"],
)
def test_multi_node_shapes_are_accepted_like_the_parser(
    crd: KubeCluster, kube_namespace: str, spec: dict[str, Any]
) -> None:
    obj = manifest(**spec)
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "r1")
    assert parse_pddeployment(stored).spec == parse_pddeployment(obj).spec


@pytest.mark.parametrize("value", [0, 1, 3, 1024, "0%", "25%", "100%"])
def test_disruption_budget_values_are_stored_as_written(
    crd: KubeCluster, kube_namespace: str, value: object
) -> None:
    obj = manifest(prefill={"instances": 3, "disruptionBudget": {"maxUnavailable": value}})
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "r1")
    assert stored["spec"]["prefill"]["disruptionBudget"] == {"maxUnavailable": value}
    assert parse_pddeployment(stored).spec.prefill.disruption_budget.max_unavailable == value


def test_name_rule(crd: KubeCluster, kube_namespace: str) -> None:
    obj = manifest(name="a" * 51)
    proc = create(crd, kube_namespace, obj, check=False)
    assert proc.returncode != 0
    assert "metadata.name must be at most 50 characters" in proc.stderr, proc.stderr
    with pytest.raises(SpecError):
        parse_pddeployment(obj)
    create(crd, kube_namespace, manifest(name="a" * 50))


def test_kubectl_explain_reads_well(crd: KubeCluster) -> None:
    def explain() -> str | None:
        out = crd.kubectl("explain", "pdd.spec.prefill", check=False)
        return out.stdout if out.returncode == 0 and "dataParallel" in out.stdout else None

    text = eventually(explain, timeout=60, message="kubectl explain pdd.spec.prefill")
    assert "Each instance is one vLLM server" in text
    fields = (
        "instances",
        "dataParallel",
        "tensorParallel",
        "expertParallel",
        "pipelineParallel",
        "gpusPerNode",
    )
    for field in (*fields, "env"):
        assert field in text
    detail = crd.kubectl("explain", "pdd.spec.kvTransfer.transferMode").stdout
    assert "MoRIIOConnector only" in detail
    assert "READ" in detail and "WRITE" in detail


def test_kubectl_scale_sets_decode_instances(crd: KubeCluster, kube_namespace: str) -> None:
    create(crd, kube_namespace, manifest(decode={"instances": 1}))
    crd.kubectl("scale", "pdd", "r1", "-n", kube_namespace, "--replicas", "3")
    stored = get(crd, kube_namespace, "r1")
    assert stored["spec"]["decode"]["instances"] == 3
    assert stored["spec"]["prefill"]["instances"] == 1
    scale = json.loads(
        crd.kubectl(
            "get", "--raw", f"/apis/pdserve.io/v1alpha1/namespaces/{kube_namespace}/pddeployments/r1/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3


def test_printer_columns_and_category(crd: KubeCluster, kube_namespace: str) -> None:
    create(crd, kube_namespace, manifest())
    status = {
        "observedGeneration": 1,
        "routingGeneration": 4,
        "servedGeneration": 3,
        "routers": {"ready": 2, "current": 1, "summary": "1/2"},
        "prefill": {"instances": 2, "readyInstances": 2, "slots": 16, "readySlots": 16, "summary": "2/2"},
        "decode": {"instances": 4, "readyInstances": 3, "slots": 4, "readySlots": 3, "summary": "3/4"},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Serving",
                "message": "every role has a routable instance",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    crd.kubectl(
        "patch", "pdd", "r1", "-n", kube_namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    out = crd.kubectl("get", "pdd", "-n", kube_namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "READY", "PREFILL", "DECODE", "P-SLOTS", "D-SLOTS", "ROUTERS", "AGE"]
    assert out[1].split()[:7] == ["r1", "True", "2/2", "3/4", "16", "3", "1/2"]
    stored = json.loads(crd.kubectl("get", "pdd", "r1", "-n", kube_namespace, "-o", "json").stdout)
    assert (stored["status"]["servedGeneration"], stored["status"]["routers"]["current"]) == (3, 1)
    wide = crd.kubectl("get", "pdd", "-n", kube_namespace, "-o", "wide").stdout.splitlines()
    assert "MODEL" in wide[0].split() and "CONNECTOR" in wide[0].split()
    assert (
        "pddeployment.pdserve.io/r1"
        in crd.kubectl("get", "pdserve", "-n", kube_namespace, "-o", "name").stdout
    )


def test_status_schema_refuses_a_bad_condition(crd: KubeCluster, kube_namespace: str) -> None:
    create(crd, kube_namespace, manifest())
    bad = {"status": {"conditions": [{"type": "Ready", "status": "Maybe"}]}}
    proc = crd.kubectl(
        "patch", "pdd", "r1", "-n", kube_namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(bad), check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert 'Unsupported value: "Maybe"' in proc.stderr


def test_spec_update_bumps_generation_but_status_does_not(crd: KubeCluster, kube_namespace: str) -> None:
    create(crd, kube_namespace, manifest())
    first = get(crd, kube_namespace, "r1")["metadata"]["generation"]
    crd.kubectl(
        "patch", "pdd", "r1", "-n", kube_namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"observedGeneration": first}}),
    )  # fmt: skip
    assert get(crd, kube_namespace, "r1")["metadata"]["generation"] == first
    crd.kubectl(
        "patch",
        "pdd",
        "r1",
        "-n",
        kube_namespace,
        "--type=merge",
        "-p",
        '{"spec":{"prefill":{"instances":2}}}',
    )
    assert get(crd, kube_namespace, "r1")["metadata"]["generation"] == first + 1


def test_rendered_manifests_are_valid_kubernetes_objects(crd: KubeCluster, kube_namespace: str) -> None:
    """Every golden shape with both connectors, and the sim engine, pass the API server's validation."""
    items: list[dict[str, Any]] = []
    shapes = [(s, c) for s in SHAPES for c in CONNECTORS]
    for n, (shape, connector) in enumerate(shapes):
        doc = shape_manifest(shape, connector)
        doc["metadata"].update(name=f"s{n}-{connector}", namespace=kube_namespace)
        pdd = parse_pddeployment(doc)
        items += render_all(pdd, build_routing_table(pdd, all_ready(pdd), None))
    sim = manifest("sim", engine="sim", image="", prefill={"instances": 2, "dataParallel": 2})
    sim["metadata"]["namespace"] = kube_namespace
    items += render_all(parse_pddeployment(sim))
    proc = crd.kubectl(
        "apply", "--dry-run=server", "--server-side", "-n", kube_namespace, "-f", "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(items)


# --- pod templates ---------------------------------------------------------------------------------

#: The unit tests' production template with every other pod field a platform team may set.
PRODUCTION_TEMPLATE: dict[str, Any] = {
    "metadata": ENGINE_TEMPLATE["metadata"],
    "spec": {
        **ENGINE_TEMPLATE["spec"],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
            }
        ],
        "serviceAccountName": "engines",
        "schedulerName": "default-scheduler",
        "securityContext": {"fsGroup": 1000},
        "volumes": [{"name": "extra", "emptyDir": {}}],
        "initContainers": [{"name": "warm", "image": "busybox", "command": ["true"]}],
        "containers": [
            {
                "name": "engine",
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "envFrom": [{"secretRef": {"name": "extra-env"}}],
                "volumeMounts": [{"name": "extra", "mountPath": "/extra"}],
                "resources": {"requests": {"memory": "400Gi"}, "limits": {"rdma/ib": "8"}},
                "securityContext": {"capabilities": {"add": ["SYS_NICE"]}},
            },
            {
                "name": "shipper",
                "image": "fluent/fluent-bit:3.0",
                "args": ["-c", "/x"],
                "ports": [{"containerPort": 2020}],
            },
        ],
    },
}


def test_a_production_pod_template_is_stored_as_written_and_renders_valid_pods(
    crd: KubeCluster, kube_namespace: str
) -> None:
    obj = manifest(prefill={"template": PRODUCTION_TEMPLATE}, decode={"template": PRODUCTION_TEMPLATE})
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "r1")
    assert stored["spec"]["prefill"]["template"] == PRODUCTION_TEMPLATE
    pdd = parse_pddeployment(stored)
    assert problems(pdd, None) == []
    items = [o for o in render_all(pdd) if o["kind"] == "Pod"]
    # Admission checks that what the template names exists (cluster-scoped ones applied idempotently).
    crd.kubectl("create", "serviceaccount", "engines", "-n", kube_namespace)
    cluster_objects = [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": "inference-critical"},
            "value": 1000000,
        },
        {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": "nvidia"},
            "handler": "nvidia",
        },
    ]
    crd.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": cluster_objects})
    )
    dry_run(crd, kube_namespace, items)


def _owned_cases() -> list[Any]:
    engine = [
        ("hostname", {"spec": {"hostname": "x"}}, pt.ENGINE_POD_OWNED["hostname"]),
        ("subdomain", {"spec": {"subdomain": "x"}}, pt.ENGINE_POD_OWNED["subdomain"]),
        ("restartPolicy", {"spec": {"restartPolicy": "Never"}}, pt.ENGINE_POD_OWNED["restartPolicy"]),
        *[
            (key, {"spec": {"containers": [{"name": "engine", key: value}]}}, pt.ENGINE_OWNED[key])
            for key, value in [
                ("image", "x"),
                ("command", ["sh"]),
                ("args", ["--port", "1"]),
                ("ports", [{"containerPort": 1}]),
                ("startupProbe", {"exec": {"command": ["true"]}}),
                ("readinessProbe", {"exec": {"command": ["true"]}}),
                ("livenessProbe", {"exec": {"command": ["true"]}}),
            ]
        ],
        (
            "env",
            {"spec": {"containers": [{"name": "engine", "env": [{"name": "VLLM_HOST_IP", "value": "1"}]}]}},
            pt.ENGINE_ENV_OWNED.owned,
        ),
        (
            "mount",
            {
                "spec": {
                    "containers": [
                        {"name": "engine", "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}
                    ]
                }
            },
            pt.ENGINE_MOUNTS_OWNED.owned,
        ),
        ("volume", {"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, pt.ENGINE_VOLUMES_OWNED.owned),
        ("label", {"metadata": {"labels": {"pdserve.io/role": "x"}}}, pt.LABELS_OWNED),
        ("annotation", {"metadata": {"annotations": {"pdserve.io/dp-size": "9"}}}, pt.ANNOTATIONS_OWNED),
    ]
    router = [
        ("router-sa", {"spec": {"serviceAccountName": "x"}}, pt.ROUTER_POD_OWNED["serviceAccountName"]),
        *[
            (
                f"router-{key}",
                {"spec": {"containers": [{"name": "router", key: value}]}},
                pt.ROUTER_OWNED[key],
            )
            for key, value in [
                ("image", "x"),
                ("args", ["--port", "1"]),
                ("readinessProbe", {"tcpSocket": {"port": 1}}),
            ]
        ],
        (
            "router-volume",
            {"spec": {"volumes": [{"name": "routing", "emptyDir": {}}]}},
            pt.ROUTER_VOLUMES_OWNED.owned,
        ),
    ]
    cases = [pytest.param("decode", t, o, id=n) for n, t, o in engine]
    return cases + [pytest.param("router", t, o, id=n) for n, t, o in router]


@pytest.mark.parametrize(("section", "template", "owned"), _owned_cases())
def test_an_owned_template_field_is_refused_by_the_api_server_and_by_pdserve_alike(
    crd: KubeCluster, kube_namespace: str, section: str, template: dict[str, Any], owned: pt.Owned
) -> None:
    obj = manifest(**{section: {"template": template}})
    proc = create(crd, kube_namespace, obj, check=False)
    assert proc.returncode != 0, f"accepted: {template}"
    assert owned.message in " ".join(proc.stderr.split()), proc.stderr
    # The operator and `pdserve render` refuse the same object with the same words, after the role's path.
    assert problems(parse_pddeployment(obj), None) == [f"spec.{section}.{owned.message}"]


def test_kubectl_explain_documents_the_pod_template(crd: KubeCluster) -> None:
    def explain() -> str | None:
        out = crd.kubectl("explain", "pdd.spec.decode.template.spec", check=False)
        return out.stdout if out.returncode == 0 and "tolerations" in out.stdout else None

    text = " ".join(
        eventually(explain, timeout=60, message="kubectl explain pdd.spec.decode.template.spec").split()
    )
    assert "strategic-merge" in text
    for field in (
        "containers",
        "volumes",
        "nodeSelector",
        "tolerations",
        "affinity",
        "imagePullSecrets",
        "priorityClassName",
        "runtimeClassName",
        "schedulerName",
        "topologySpreadConstraints",
    ):
        assert field in text, field
    engine = " ".join(crd.kubectl("explain", "pdd.spec.decode.template.spec.containers").stdout.split())
    assert "engine is pdserve's container" in engine
    router = " ".join(crd.kubectl("explain", "pdd.spec.router.template").stdout.split())
    assert "each router pod" in router


# --- model storage and credentials -------------------------------------------------------------

STORAGE_REFUSED = [
    pytest.param(
        {"modelCache": {}},
        "modelCache: set exactly one of persistentVolumeClaim, ephemeral, hostPath, emptyDir",
        id="cache-none",
    ),
    pytest.param(
        {"modelCache": {"emptyDir": {}, "hostPath": {"path": "/x"}}},
        "modelCache: set exactly one of persistentVolumeClaim, ephemeral, hostPath, emptyDir",
        id="cache-two",
    ),
    pytest.param(
        {"modelCache": {"hostPath": {"path": "x"}}}, "should match '^/'", id="cache-relative-host-path"
    ),
    pytest.param(
        {"modelCache": {"persistentVolumeClaim": {}}}, "claimName: Required value", id="cache-no-claim"
    ),
    pytest.param({"hfTokenSecretRef": {"name": "hf"}}, "key: Required value", id="token-no-key"),
    pytest.param({"hfTokenSecretRef": {"name": "hf", "key": "a b"}}, "should match", id="token-bad-key"),
    pytest.param(
        {"model": "pvc://weights/../etc"},
        "model: expected pvc://<claim>/<path inside the claim> (a PVC name, no '..')",
        id="pvc-model-parent",
    ),
    pytest.param(
        {"model": "pvc://Weights/x"},
        "model: expected pvc://<claim>/<path inside the claim> (a PVC name, no '..')",
        id="pvc-model-bad-claim",
    ),
]


@pytest.mark.parametrize(("spec", "message"), STORAGE_REFUSED)
def test_invalid_storage_is_refused_by_the_api_server_and_the_parser(
    crd: KubeCluster, kube_namespace: str, spec: dict[str, Any], message: str
) -> None:
    assert_refused(crd, kube_namespace, spec, message)


def test_storage_fields_are_stored_and_render_valid_pods(crd: KubeCluster, kube_namespace: str) -> None:
    caches = [
        {"persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": True}},
        {
            "ephemeral": {
                "volumeClaimTemplate": {
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
                }
            }
        },
        {"hostPath": {"path": "/mnt/hf", "type": "DirectoryOrCreate"}},
        {"emptyDir": {"sizeLimit": "10Gi"}},
    ]
    items: list[dict[str, Any]] = []
    for n, cache in enumerate(caches):
        obj = manifest(
            f"s{n}",
            model="pvc://weights/Llama-3.3-70B-Instruct" if n % 2 else "meta-llama/Llama-3.3-70B-Instruct",
            modelCache=cache,
            hfTokenSecretRef={"name": "hf-token", "key": "token"},
        )
        create(crd, kube_namespace, obj)
        stored = get(crd, kube_namespace, f"s{n}")
        assert stored["spec"]["modelCache"] == cache
        pdd = parse_pddeployment(stored)
        assert pdd.spec == parse_pddeployment(obj).spec
        items += [o for o in render_all(pdd) if o["kind"] == "Pod"]
    dry_run(crd, kube_namespace, items)


def test_shm_size_must_be_a_quantity(crd: KubeCluster, kube_namespace: str) -> None:
    obj = manifest(decode={"shmSize": "8GB"})
    proc = create(crd, kube_namespace, obj, check=False)
    assert proc.returncode != 0
    assert "spec.decode.shmSize: Invalid value" in proc.stderr, proc.stderr
    with pytest.raises(SpecError):
        parse_pddeployment(obj)


# --- router security -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param(
            {"router": {"port": 9000}},
            "adminPort must differ from port: the client Service must not reach the admin endpoints",
            id="admin-port-default-collides",
        ),
        pytest.param(
            {"router": {"adminPort": 8000}},
            "adminPort must differ from port: the client Service must not reach the admin endpoints",
            id="admin-port-collides",
        ),
        pytest.param(
            {"router": {"apiKeySecretRef": {"name": "k"}}}, "key: Required value", id="router-key-no-key"
        ),
        pytest.param(
            {"engineApiKeySecretRef": {"key": "k"}}, "name: Required value", id="engine-key-no-name"
        ),
        pytest.param(
            {"router": {"adminPort": 0}}, "should be greater than or equal to 1", id="admin-port-bound"
        ),
    ],
)
def test_invalid_router_security_is_refused(
    crd: KubeCluster, kube_namespace: str, spec: dict[str, Any], message: str
) -> None:
    assert_refused(crd, kube_namespace, spec, message)


def test_keys_are_stored_as_references_and_render_valid_objects(
    crd: KubeCluster, kube_namespace: str
) -> None:
    obj = manifest(
        router={"apiKeySecretRef": {"name": "router-key", "key": "api-key"}, "port": 8080, "adminPort": 9100},
        engineApiKeySecretRef={"name": "engine-key", "key": "api-key"},
    )
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "r1")
    pdd = parse_pddeployment(stored)
    assert pdd.spec == parse_pddeployment(obj).spec
    items = [o for o in render_all(pdd) if o["kind"] in ("Pod", "Deployment", "Service")]
    dry_run(crd, kube_namespace, items)


# --- what vLLM accepts between prefill and decode (vllm_compat.py) ------------------------------------

ADMISSION_REFUSED = [
    pytest.param(
        {"prefill": {"tensorParallel": 8}, "decode": {"tensorParallel": 3}}, vllm_compat.TP_RATIO, id="tp-8-3"
    ),
    pytest.param(
        {"prefill": {"tensorParallel": 4}, "decode": {"tensorParallel": 6}}, vllm_compat.TP_RATIO, id="tp-4-6"
    ),
    pytest.param(
        {"kvTransfer": {"connector": "MoRIIOConnector", "transferMode": "READ"}},
        moriio.AMD_ONLY.rule,
        id="moriio-nvidia",
    ),
    pytest.param(
        {
            "kvTransfer": {"connector": "MoRIIOConnector", "transferMode": "WRITE"},
            "gpuResource": "amd.com/gpu",
            "decode": {"dataParallel": 2, "tensorParallel": 2},
        },
        moriio.NOT_DP_AND_TP.rule,
        id="moriio-dp-and-tp",
    ),
]


@pytest.mark.parametrize(("spec", "rule"), ADMISSION_REFUSED)
def test_an_admission_rule_is_refused_by_the_api_server_and_by_pdserve_alike(
    crd: KubeCluster, kube_namespace: str, spec: dict[str, Any], rule: Rule
) -> None:
    obj = manifest(**spec)
    proc = create(crd, kube_namespace, obj, check=False)
    assert proc.returncode != 0, f"accepted: {spec}"
    assert rule.message in " ".join(proc.stderr.split()), proc.stderr
    assert problems(parse_pddeployment(obj), None) == [f"spec.{rule.message}"]


ADMISSION_ACCEPTED = [
    pytest.param({"prefill": {"tensorParallel": 8}, "decode": {"tensorParallel": 1}}, id="tp-8-1"),
    pytest.param({"prefill": {"tensorParallel": 2}, "decode": {"tensorParallel": 4}}, id="tp-2-4"),
    pytest.param(
        {"engine": "sim", "image": "", "prefill": {"tensorParallel": 3}, "decode": {"tensorParallel": 2}},
        id="sim-exempt",
    ),
    pytest.param(
        {
            "kvTransfer": {"connector": "MoRIIOConnector", "transferMode": "READ"},
            "gpuResource": "amd.com/gpu",
            "prefill": {"dataParallel": 8, "expertParallel": True},
            "decode": {"tensorParallel": 8},
        },
        id="moriio-amd-dp8-tp8",
    ),
    pytest.param({"prefill": {"dataParallel": 2, "tensorParallel": 4}}, id="nixl-dp-and-tp"),
]


@pytest.mark.parametrize("spec", ADMISSION_ACCEPTED)
def test_what_vllm_accepts_is_accepted(crd: KubeCluster, kube_namespace: str, spec: dict[str, Any]) -> None:
    obj = manifest(**spec)
    create(crd, kube_namespace, obj)
    assert problems(parse_pddeployment(get(crd, kube_namespace, "r1")), None) == []


def dry_run(crd: KubeCluster, namespace: str, items: list[dict[str, Any]]) -> None:
    """Every object passes the API server's validation and admission (nothing is stored)."""
    proc = crd.kubectl(
        "apply", "--dry-run=server", "--server-side", "-n", namespace, "-f", "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def assert_refused(crd: KubeCluster, namespace: str, spec: dict[str, Any], message: str) -> None:
    """The API server refuses the spec with ``message``, and so does the parser (files mean the same)."""
    obj = manifest(**spec)
    proc = create(crd, namespace, obj, check=False)
    assert proc.returncode != 0, f"accepted: {spec}"
    assert message in proc.stderr, proc.stderr
    with pytest.raises(SpecError):
        parse_pddeployment(obj)


# --- spec.autoscaling (issue 27) -------------------------------------------------------------------

AUTOSCALING: dict[str, Any] = {
    "prefill": {"maxInstances": 4},
    "decode": {"maxInstances": 4},
    "objectives": {"ttftMilliseconds": 2000, "itlMilliseconds": 50},
}


def autoscaling(**change: Any) -> dict[str, Any]:
    return {"autoscaling": {**AUTOSCALING, **change}}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param(
            autoscaling(prefill={"minInstances": 5, "maxInstances": 4}),
            "minInstances must not exceed maxInstances",
            id="min-above-max",
        ),
        pytest.param(
            autoscaling(prefillPerDecode={"min": 2, "max": 1}),
            "prefillPerDecode.min must not exceed prefillPerDecode.max",
            id="ratio-min-above-max",
        ),
        pytest.param(
            autoscaling(
                prefill={"maxInstances": 1},
                decode={"minInstances": 4, "maxInstances": 4},
                prefillPerDecode={"min": 0.5},
            ),
            "prefillPerDecode.min: unreachable",
            id="ratio-unreachable",
        ),
        pytest.param(
            autoscaling(decode={"minInstances": 1}),
            "spec.autoscaling.decode.maxInstances: Required value",
            id="no-max",
        ),
        pytest.param(
            autoscaling(objectives={"ttftMilliseconds": 2000}),
            "spec.autoscaling.objectives.itlMilliseconds: Required value",
            id="no-itl-objective",
        ),
        pytest.param(
            autoscaling(objectives={**AUTOSCALING["objectives"], "percentile": 100}),
            # the API server prints the CRD's maximum 99.9 as 99
            "spec.autoscaling.objectives.percentile in body should be less than or equal to 99",
            id="percentile-100",
        ),
        pytest.param(
            autoscaling(
                behavior={"scaleUp": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}]}}
            ),
            'Unsupported value: "Pods"',
            id="hpa-pods-is-instances-here",
        ),
    ],
)
def test_an_autoscaling_that_cannot_hold_is_refused_by_the_api_server_and_the_parser(
    crd: KubeCluster, kube_namespace: str, spec: dict[str, Any], message: str
) -> None:
    assert_refused(crd, kube_namespace, spec, message)


def test_autoscaling_is_stored_with_hpas_defaults_like_the_parser(
    crd: KubeCluster, kube_namespace: str
) -> None:
    obj = manifest("scaled", **autoscaling())
    create(crd, kube_namespace, obj)
    stored = get(crd, kube_namespace, "scaled")["spec"]["autoscaling"]
    assert stored == {
        "prefill": {"minInstances": 1, "maxInstances": 4},
        "decode": {"minInstances": 1, "maxInstances": 4},
        "objectives": {
            "ttftMilliseconds": 2000,
            "itlMilliseconds": 50,
            "percentile": 90,
            "windowSeconds": 60,
        },
        "syncPeriodSeconds": 15,
        "behavior": {
            "scaleUp": {
                "stabilizationWindowSeconds": 0,
                "selectPolicy": "Max",
                "tolerance": 0.1,
                "policies": [
                    {"type": "Percent", "value": 100, "periodSeconds": 15},
                    {"type": "Instances", "value": 4, "periodSeconds": 15},
                ],
            },
            "scaleDown": {
                "stabilizationWindowSeconds": 300,
                "selectPolicy": "Max",
                "tolerance": 0.1,
                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
            },
        },
    }
    parsed = parse_pddeployment({**obj, "spec": {**obj["spec"], "autoscaling": stored}}).spec.autoscaling
    assert parsed == parse_pddeployment(obj).spec.autoscaling  # the parser applies the same defaults
