"""Pod templates: the strategic merge, the fields pdserve owns, and agreement with the CRD's CEL rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.deployment.render.engine_pod import instance_pod, template_hash
from pdserve.deployment.render.router import router_deployment
from pdserve.deployment.spec import owned as pt
from pdserve.deployment.spec.parse import SpecError
from pdserve.deployment.spec.podtemplate import PodTemplate, merge_metadata, merge_pod_spec, parse_template
from pdserve.deployment.validate import problems
from pdserve.routing import Role
from tests.support.specs import ENGINE_TEMPLATE, pdd_of

CRD = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "crds" / "pddeployments.pdserve.io.yaml").read_text()
)
SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]

RENDERED: dict[str, Any] = {
    "containers": [
        {
            "name": "engine",
            "image": "vllm",
            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            "resources": {"requests": {"cpu": "4", "nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}},
            "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
        }
    ],
    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    "tolerations": [{"key": "a", "operator": "Exists"}],
    "nodeSelector": {"pool": "gpu"},
}


# --- the merge ---------------------------------------------------------------------------------


def test_containers_merge_by_name_and_their_lists_by_key() -> None:
    fragment = {
        "containers": [
            {
                "name": "engine",
                "env": [
                    {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    {"name": "C", "value": "3"},
                ],
                "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                "resources": {"requests": {"cpu": "16", "memory": "200Gi"}, "limits": {"rdma/hca": "1"}},
                "securityContext": {"capabilities": {"add": ["SYS_PTRACE", "IPC_LOCK"]}, "runAsUser": 0},
            },
            {"name": "sidecar", "image": "busybox"},
        ]
    }
    out = merge_pod_spec(RENDERED, fragment)
    engine, sidecar = out["containers"]
    assert engine["image"] == "vllm"
    # env by name: an entry replaces the rendered one whole (value and valueFrom are a union)
    assert engine["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "C", "value": "3"},
    ]
    assert engine["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "models", "mountPath": "/models", "readOnly": True},
    ]
    assert engine["resources"] == {
        "requests": {"cpu": "16", "nvidia.com/gpu": "8", "memory": "200Gi"},
        "limits": {"nvidia.com/gpu": "8", "rdma/hca": "1"},
    }
    # capabilities.add is unioned, so the connector's IPC_LOCK stays
    assert engine["securityContext"] == {"capabilities": {"add": ["IPC_LOCK", "SYS_PTRACE"]}, "runAsUser": 0}
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    assert RENDERED["containers"][0]["env"][1] == {"name": "B", "value": "2"}  # the input is untouched


def test_pod_level_lists_and_maps() -> None:
    fragment = {
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
            {"name": "x", "emptyDir": {}},
        ],
        "tolerations": [
            {"key": "a", "operator": "Exists"},
            {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        ],
        "nodeSelector": {"zone": "z1"},
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": "inference",
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
        },
    }
    out = merge_pod_spec(RENDERED, fragment)
    assert out["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "x", "emptyDir": {}},
    ]
    # tolerations are appended, an identical one kept once
    assert out["tolerations"] == [
        {"key": "a", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
    ]
    assert out["nodeSelector"] == {"pool": "gpu", "zone": "z1"}
    assert out["imagePullSecrets"] == [{"name": "regcred"}]
    assert out["priorityClassName"] == "inference"
    assert "requiredDuringSchedulingIgnoredDuringExecution" in out["affinity"]["nodeAffinity"]


def test_a_volume_replaces_the_rendered_one_so_it_never_has_two_sources() -> None:
    base = {"volumes": [{"name": "cache", "emptyDir": {}}]}
    out = merge_pod_spec(base, {"volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "c"}}]})
    assert out["volumes"] == [{"name": "cache", "persistentVolumeClaim": {"claimName": "c"}}]


def test_null_removes_a_key_and_scalars_replace() -> None:
    base = {
        "containers": [{"name": "engine", "resources": {"requests": {"cpu": "4", "memory": "8Gi"}}}],
        "a": 1,
    }
    out = merge_pod_spec(
        base, {"containers": [{"name": "engine", "resources": {"requests": {"cpu": None}}}], "a": None}
    )
    assert out == {"containers": [{"name": "engine", "resources": {"requests": {"memory": "8Gi"}}}]}


def test_ports_merge_by_port_and_protocol_and_spread_constraints_by_key() -> None:
    base = {
        "containers": [{"name": "x", "ports": [{"containerPort": 80, "name": "a"}]}],
        "topologySpreadConstraints": [
            {"topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule", "maxSkew": 1}
        ],
    }
    fragment = {
        "containers": [
            {
                "name": "x",
                "ports": [
                    {"containerPort": 80, "protocol": "TCP", "hostPort": 80},
                    {"containerPort": 80, "protocol": "UDP"},
                ],
            }
        ],
        "topologySpreadConstraints": [
            {"topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule", "maxSkew": 2},
            {"topologyKey": "host", "whenUnsatisfiable": "ScheduleAnyway", "maxSkew": 1},
        ],
    }
    out = merge_pod_spec(base, fragment)
    assert out["containers"][0]["ports"] == [
        {"containerPort": 80, "name": "a", "protocol": "TCP", "hostPort": 80},
        {"containerPort": 80, "protocol": "UDP"},
    ]
    assert [c["maxSkew"] for c in out["topologySpreadConstraints"]] == [2, 1]


def test_metadata_adds_labels_and_annotations() -> None:
    meta = {"name": "p", "labels": {"pdserve.io/role": "decode"}}
    out = merge_metadata(meta, PodTemplate({"team": "a"}, {"note": "x"}))
    assert out == {
        "name": "p",
        "labels": {"team": "a", "pdserve.io/role": "decode"},
        "annotations": {"note": "x"},
    }


# --- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "path", "reason"),
    [
        ({"spec": {"containers": [{"image": "x"}]}}, "t.spec.containers[0].name", "required"),
        ({"spec": {"containers": {"name": "engine"}}}, "t.spec.containers", "expected a list"),
        (
            {"spec": {"volumes": [{"name": "a"}, {"name": "a"}]}},
            "t.spec.volumes[1].name",
            'duplicate name "a"',
        ),
        (
            {"spec": {"containers": [{"name": "engine", "env": [{"value": "1"}]}]}},
            "t.spec.containers[0].env[0].name",
            "required",
        ),
        ({"metadata": {"labels": {"a": 1}}}, "t.metadata.labels.a", "expected a string"),
        ({"metadata": {"name": "x"}}, "t.metadata.name", "unknown field"),
        ({"kind": "Pod"}, "t.kind", "unknown field"),
    ],
)
def test_parse_errors_name_the_field(template: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_template(template, "t")
    assert info.value.path == path
    assert reason in info.value.reason


def test_parsed_template_does_not_alias_the_input() -> None:
    raw = {"spec": {"nodeSelector": {"a": "b"}}}
    parsed = parse_template(raw, "t")
    raw["spec"]["nodeSelector"]["a"] = "changed"
    assert parsed.spec == {"nodeSelector": {"a": "b"}}


# --- owned fields ------------------------------------------------------------------------------

ENGINE_CASES = [
    ({"spec": {"hostname": "x"}}, pt.ENGINE_POD_OWNED["hostname"]),
    ({"spec": {"subdomain": "x"}}, pt.ENGINE_POD_OWNED["subdomain"]),
    ({"spec": {"restartPolicy": "Never"}}, pt.ENGINE_POD_OWNED["restartPolicy"]),
    *[
        ({"spec": {"containers": [{"name": "engine", key: value}]}}, pt.ENGINE_OWNED[key])
        for key, value in [
            ("image", "x"),
            ("command", ["sh"]),
            ("args", ["--port", "1"]),
            ("ports", []),
            ("startupProbe", {}),
            ("readinessProbe", {}),
            ("livenessProbe", {}),
        ]
    ],
    (
        {"spec": {"containers": [{"name": "engine", "env": [{"name": "POD_IP", "value": "1"}]}]}},
        pt.ENGINE_ENV_OWNED.owned,
    ),
    (
        {
            "spec": {
                "containers": [{"name": "engine", "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}]
            }
        },
        pt.ENGINE_MOUNTS_OWNED.owned,
    ),
    ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, pt.ENGINE_VOLUMES_OWNED.owned),
    ({"metadata": {"labels": {"pdserve.io/role": "x"}}}, pt.LABELS_OWNED),
    ({"metadata": {"labels": {"app.kubernetes.io/component": "x"}}}, pt.LABELS_OWNED),
    ({"metadata": {"annotations": {"pdserve.io/draining-since": "x"}}}, pt.ANNOTATIONS_OWNED),
]


@pytest.mark.parametrize(("template", "owned"), ENGINE_CASES, ids=lambda v: getattr(v, "field", ""))
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_owned_engine_field_is_refused_with_its_message(
    template: dict[str, Any], owned: pt.Owned, role: str
) -> None:
    found = problems(pdd_of(**{role: {"template": template}}), None)
    assert found == [f"spec.{role}.{owned.message}"]


@pytest.mark.parametrize(
    ("template", "owned"),
    [
        ({"spec": {"serviceAccountName": "x"}}, pt.ROUTER_POD_OWNED["serviceAccountName"]),
        ({"spec": {"containers": [{"name": "router", "args": []}]}}, pt.ROUTER_OWNED["args"]),
        (
            {"spec": {"containers": [{"name": "router", "readinessProbe": {}}]}},
            pt.ROUTER_OWNED["readinessProbe"],
        ),
        ({"spec": {"volumes": [{"name": "routing", "emptyDir": {}}]}}, pt.ROUTER_VOLUMES_OWNED.owned),
        ({"metadata": {"labels": {"pdserve.io/x": "y"}}}, pt.LABELS_OWNED),
    ],
)
def test_an_owned_router_field_is_refused_with_its_message(template: dict[str, Any], owned: pt.Owned) -> None:
    assert problems(pdd_of(router={"template": template}), None) == [f"spec.router.{owned.message}"]


def test_the_same_fields_on_a_sidecar_or_another_container_are_allowed() -> None:
    template = {
        "spec": {
            "containers": [
                {
                    "name": "sidecar",
                    "image": "x",
                    "args": ["a"],
                    "ports": [{"containerPort": 9}],
                    "readinessProbe": {},
                },
                {"name": "engine", "env": [{"name": "UCX_TLS", "value": "rc,cuda_copy"}]},
            ],
            "volumes": [{"name": "models", "emptyDir": {}}],
            "nodeSelector": {"gpu": "h100"},
            "serviceAccountName": "engines",
        },
        "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/x": "y"}},
    }
    assert (
        problems(
            pdd_of(prefill={"template": template}, router={"template": {"spec": {"priorityClassName": "x"}}}),
            None,
        )
        == []
    )


def test_the_gpu_count_stays_pdserves() -> None:
    template = {
        "spec": {"containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}
    }
    found = problems(pdd_of(decode={"tensorParallel": 4, "template": template}), None)
    assert found == [
        "spec.decode.template.spec.containers[engine].resources.limits[nvidia.com/gpu]: pdserve requests "
        "dataParallel x tensorParallel = 4 GPUs per instance, got 2; remove it from resources"
    ]
    same = {"spec": {"containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}}
    assert problems(pdd_of(decode={"tensorParallel": 4, "template": same}), None) == []


def test_merge_directives_are_refused() -> None:
    template = {"spec": {"containers": [{"name": "engine", "env": [{"$patch": "delete", "name": "A"}]}]}}
    found = problems(pdd_of(prefill={"template": template}), None)
    assert found == [f"spec.prefill.template.spec.containers[0].env[0].$patch: {pt.DIRECTIVE_REASON}"]


def _cel_messages(schema: dict[str, Any]) -> set[str]:
    out = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        out |= {r["message"] for r in node.get("x-kubernetes-validations", [])}
        stack += list((node.get("properties") or {}).values())
        if isinstance(node.get("items"), dict):
            stack.append(node["items"])
    return out


def test_the_crds_cel_messages_are_the_owned_fields_messages() -> None:
    """The API server and ``pdserve render`` say the same thing for the same mistake."""
    engine = {o.message for o in [*pt.ENGINE_POD_OWNED.values(), *pt.ENGINE_OWNED.values()]}
    engine |= {pt.ENGINE_ENV_OWNED.owned.message, pt.ENGINE_MOUNTS_OWNED.owned.message}
    engine |= {pt.ENGINE_VOLUMES_OWNED.owned.message, pt.LABELS_OWNED.message, pt.ANNOTATIONS_OWNED.message}
    for role in ("prefill", "decode"):
        assert _cel_messages(SPEC[role]["properties"]["template"]) == engine
    router = {o.message for o in [*pt.ROUTER_POD_OWNED.values(), *pt.ROUTER_OWNED.values()]}
    router |= {pt.ROUTER_VOLUMES_OWNED.owned.message, pt.LABELS_OWNED.message, pt.ANNOTATIONS_OWNED.message}
    assert _cel_messages(SPEC["router"]["properties"]["template"]) == router
    env_rule = next(
        r["rule"]
        for r in SPEC["prefill"]["properties"]["template"]["properties"]["spec"]["x-kubernetes-validations"]
        if r["message"] == pt.ENGINE_ENV_OWNED.owned.message
    )
    assert all(f"'{name}'" in env_rule for name in pt.ENGINE_ENV_OWNED.names)


# --- rendering ---------------------------------------------------------------------------------


def test_a_role_template_reaches_its_pods_only() -> None:
    pdd = pdd_of(prefill={"template": ENGINE_TEMPLATE, "tensorParallel": 8})
    pod = instance_pod(pdd, Role.PREFILL, 0)
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"]["pdserve.io/role"] == "prefill"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "inference"
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["runtimeClassName"] == "nvidia"
    engine, shipper = spec["containers"]
    assert engine["name"] == "engine" and shipper["name"] == "log-shipper"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in engine["env"]
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "8"}
    assert engine["resources"]["requests"]["memory"] == "400Gi"
    assert engine["command"] == ["vllm", "serve"]
    decode = instance_pod(pdd, Role.DECODE, 0)
    assert "imagePullSecrets" not in decode["spec"] and "team" not in decode["metadata"]["labels"]


def test_a_template_change_changes_the_roles_template_hash_only() -> None:
    base = pdd_of()
    changed = pdd_of(decode={"template": {"spec": {"priorityClassName": "high"}}})
    labelled = pdd_of(decode={"template": {"metadata": {"labels": {"team": "ml"}}}})
    assert template_hash(changed, Role.PREFILL) == template_hash(base, Role.PREFILL)
    hashes = {template_hash(p, Role.DECODE) for p in (base, changed, labelled)}
    assert len(hashes) == 3
    assert template_hash(pdd_of(decode={"template": {}}), Role.DECODE) == template_hash(base, Role.DECODE)


def test_the_router_template_reaches_the_router_pods() -> None:
    template = copy.deepcopy(ENGINE_TEMPLATE)
    template["spec"]["containers"][0]["name"] = "router"
    pdd = pdd_of(router={"template": template})
    pod = router_deployment(pdd)["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    router, shipper = pod["spec"]["containers"]
    assert router["command"] == ["pdserve"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in router["env"]
    assert shipper["image"] == "fluent/fluent-bit:3.0"
    assert pod["spec"]["tolerations"] == ENGINE_TEMPLATE["spec"]["tolerations"]
    assert router["env"][0]["name"] == "POD_NAMESPACE"  # the rendered env stays beside the template's
    assert pod["spec"]["serviceAccountName"] == "r1-router"
