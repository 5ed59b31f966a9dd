"""Model storage and credentials: spec.modelCache, spec.hfTokenSecretRef and pvc:// models."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.spec.parse import SpecError
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.spec.storage import HF_CACHE
from pdserve.deployment.validate import problems
from pdserve.routing import Role
from tests.support import specs


def pdd_of(**spec: Any) -> PDDeployment:
    return specs.pdd_of(**{"model": "meta-llama/Llama-3.1-8B-Instruct", **spec})


def engine(pdd: PDDeployment, role: Role = Role.DECODE) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = instance_pod(pdd, role, 0)["spec"]
    return pod, pod["containers"][0]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        (
            {"persistentVolumeClaim": {"claimName": "hf-cache"}},
            {"persistentVolumeClaim": {"claimName": "hf-cache"}},
        ),
        (
            {"hostPath": {"path": "/mnt/nvme/hf", "type": "DirectoryOrCreate"}},
            {"hostPath": {"path": "/mnt/nvme/hf", "type": "DirectoryOrCreate"}},
        ),
        ({"emptyDir": {"sizeLimit": "200Gi"}}, {"emptyDir": {"sizeLimit": "200Gi"}}),
        (
            {
                "ephemeral": {
                    "volumeClaimTemplate": {
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": "300Gi"}},
                        }
                    }
                }
            },
            {
                "ephemeral": {
                    "volumeClaimTemplate": {
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": "300Gi"}},
                        }
                    }
                }
            },
        ),
    ],
)
def test_the_model_cache_is_mounted_where_vllm_keeps_the_hf_cache(
    cache: dict[str, Any], volume: dict[str, Any]
) -> None:
    pdd = pdd_of(modelCache=cache)
    for role in Role:
        pod, container = engine(pdd, role)
        assert {"name": "model-cache", **volume} in pod["volumes"]
        assert {"name": "model-cache", "mountPath": HF_CACHE} in container["volumeMounts"]
        assert env_of(container)["HF_HOME"] == "/root/.cache/huggingface"
        assert "HF_HUB_OFFLINE" not in env_of(container)  # a hub model is still downloaded (once)


def test_a_read_only_claim_is_mounted_read_only() -> None:
    _, container = engine(pdd_of(modelCache={"persistentVolumeClaim": {"claimName": "c", "readOnly": True}}))
    assert {"name": "model-cache", "mountPath": HF_CACHE, "readOnly": True} in container["volumeMounts"]


def test_the_hf_token_comes_from_its_secret_and_never_as_a_value() -> None:
    pdd = pdd_of(hfTokenSecretRef={"name": "hf", "key": "token"})
    _, container = engine(pdd)
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def test_a_pvc_model_is_mounted_read_only_and_served_offline() -> None:
    pdd = pdd_of(model="pvc://llama-weights/Llama-3.3-70B-Instruct", servedModelName="llama-3.3-70b")
    pod, container = engine(pdd)
    assert container["args"][0] == "/mnt/models/Llama-3.3-70B-Instruct"
    assert {
        "name": "model-pvc",
        "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True},
    } in pod["volumes"]
    assert {"name": "model-pvc", "mountPath": "/mnt/models", "readOnly": True} in container["volumeMounts"]
    assert env_of(container)["HF_HUB_OFFLINE"] == "1"
    root = engine(pdd_of(model="pvc://weights"))[1]
    assert root["args"][0] == "/mnt/models"


def test_a_local_path_is_served_offline_as_is() -> None:
    _, container = engine(pdd_of(model="/models/llama"))
    assert container["args"][0] == "/models/llama"
    assert env_of(container)["HF_HUB_OFFLINE"] == "1"
    assert not any(
        v["name"] in ("model-cache", "model-pvc")
        for v in instance_pod(pdd_of(model="/m"), Role.DECODE, 0)["spec"]["volumes"]
    )


def test_the_simulator_gets_no_storage() -> None:
    pdd = pdd_of(
        engine="sim", image="", modelCache={"emptyDir": {}}, hfTokenSecretRef={"name": "hf", "key": "t"}
    )
    pod, container = engine(pdd)
    assert [v["name"] for v in pod["volumes"]] == ["dshm"]
    assert not {"HF_HOME", "HF_TOKEN"} & set(env_of(container))


def test_hf_home_and_the_token_are_pdserves_once_the_spec_sets_them() -> None:
    template = {"spec": {"containers": [{"name": "engine", "env": [{"name": "HF_TOKEN", "value": "x"}]}]}}
    assert problems(pdd_of(decode={"template": template}), None) == []  # the user's own token: fine
    found = problems(pdd_of(decode={"template": template}, hfTokenSecretRef={"name": "hf", "key": "t"}), None)
    assert found == [
        "spec.decode.template.spec.containers[engine].env[0]: HF_TOKEN is set by pdserve from "
        "spec.hfTokenSecretRef"
    ]
    found = problems(
        pdd_of(prefill={"env": [{"name": "HF_HOME", "value": "/x"}]}, modelCache={"emptyDir": {}}), None
    )
    assert found == [
        "spec.prefill.env[0]: HF_HOME is set by pdserve to /root/.cache/huggingface, where "
        "spec.modelCache is mounted; remove it from env"
    ]
    mount = {
        "spec": {"containers": [{"name": "engine", "volumeMounts": [{"name": "x", "mountPath": HF_CACHE}]}]}
    }
    found = problems(pdd_of(prefill={"template": mount}, modelCache={"emptyDir": {}}), None)
    assert found == [
        "spec.prefill.template.spec.containers[engine].volumeMounts[0].mountPath: /root/.cache/huggingface "
        "is where pdserve mounts spec.modelCache (the Hugging Face cache)"
    ]


@pytest.mark.parametrize(
    ("spec", "path", "reason"),
    [
        (
            {"modelCache": {}},
            "spec.modelCache",
            "set exactly one of persistentVolumeClaim, ephemeral, hostPath, emptyDir",
        ),
        (
            {"modelCache": {"emptyDir": {}, "hostPath": {"path": "/x"}}},
            "spec.modelCache",
            "set exactly one of persistentVolumeClaim, ephemeral, hostPath, emptyDir "
            "(got hostPath, emptyDir)",
        ),
        ({"modelCache": {"nfs": {}}}, "spec.modelCache.nfs", "unknown field"),
        (
            {"modelCache": {"persistentVolumeClaim": {}}},
            "spec.modelCache.persistentVolumeClaim.claimName",
            "required",
        ),
        (
            {"modelCache": {"persistentVolumeClaim": {"claimName": "Bad_Name"}}},
            "spec.modelCache.persistentVolumeClaim.claimName",
            "expected a PersistentVolumeClaim name",
        ),
        (
            {"modelCache": {"hostPath": {"path": "relative"}}},
            "spec.modelCache.hostPath.path",
            "expected an absolute path",
        ),
        (
            {"modelCache": {"ephemeral": {"volumeClaimTemplate": {}}}},
            "spec.modelCache.ephemeral.volumeClaimTemplate.spec",
            "expected an object",
        ),
        ({"hfTokenSecretRef": {"name": "hf"}}, "spec.hfTokenSecretRef.key", "required"),
        (
            {"hfTokenSecretRef": {"name": "hf", "key": "a b"}},
            "spec.hfTokenSecretRef.key",
            "expected a Secret key",
        ),
        ({"model": "pvc://Bad/x"}, "spec.model", "expected pvc://<claim>/<path inside the claim>"),
        ({"model": "pvc://weights/../etc"}, "spec.model", "no '..'"),
    ],
)
def test_storage_errors_name_the_field(spec: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        pdd_of(**spec)
    assert info.value.path == path
    assert reason in info.value.reason
