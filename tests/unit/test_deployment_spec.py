"""parse_spec / parse_pddeployment / load_manifest_file: defaults, and every error names its field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.spec.parse import (
    SpecError,
    load_manifest,
    load_manifest_file,
    parse_pddeployment,
    parse_spec,
)
from pdserve.deployment.spec.pddeployment import KVTransferSpec, PDDeployment, RoleSpec
from pdserve.routing import Connector, Role
from tests.support import specs

MINIMAL: dict[str, Any] = specs.manifest(
    metadata={"namespace": "serving"}, model="deepseek-ai/DeepSeek-R1", image="vllm/vllm-openai:v0.11.0"
)


def manifest(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"].update(spec)
    return doc


def error_of(obj: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_pddeployment(obj)
    return info.value


def test_minimal_manifest_gets_the_defaults() -> None:
    pdd = parse_pddeployment(MINIMAL)
    assert isinstance(pdd, PDDeployment)
    assert (pdd.name, pdd.namespace, pdd.uid, pdd.generation) == ("r1", "serving", "", 0)
    spec = pdd.spec
    assert spec.served_model_name == "deepseek-ai/DeepSeek-R1"
    assert (spec.engine, spec.gpu_resource) == ("vllm", "nvidia.com/gpu")
    assert spec.kv_transfer == KVTransferSpec("NixlConnector", None, {})
    assert spec.prefill == RoleSpec() == spec.decode
    assert (spec.router.replicas, spec.router.policy, spec.router.port) == (1, "flat-interleaved", 8000)
    assert (spec.rollout.max_unavailable, spec.rollout.drain_seconds) == (1, 30)


def test_issue_example_parses() -> None:
    pdd = parse_pddeployment(
        manifest(
            servedModelName="deepseek-r1",
            gpuResource="amd.com/gpu",
            kvTransfer={"connector": "MoRIIOConnector", "transferMode": "READ", "extraConfig": {}},
            prefill={
                "instances": 2,
                "dataParallel": 8,
                "tensorParallel": 1,
                "expertParallel": True,
                "args": [],
                "env": [],
                "resources": {},
                "nodeSelector": {},
                "tolerations": [],
                "affinity": {},
            },
            decode={"instances": 4, "dataParallel": 1, "tensorParallel": 8},
            router={
                "replicas": 2,
                "image": "",
                "policy": "flat-interleaved",
                "backlog": 4096,
                "port": 8000,
                "serviceType": "ClusterIP",
            },
            rollout={"maxUnavailable": 1, "drainSeconds": 30},
        )
    )
    spec = pdd.spec
    assert spec.served_model_name == "deepseek-r1"
    assert spec.kv_transfer.routing_connector == Connector("moriio", "READ")
    assert (spec.prefill.gpus_per_instance, spec.prefill.slots) == (8, 16)
    assert (spec.decode.gpus_per_instance, spec.decode.slots) == (8, 4)
    assert spec.role(Role.DECODE) is spec.decode
    assert spec.router.replicas == 2


def test_parsed_spec_does_not_alias_the_input() -> None:
    doc = manifest(prefill={"env": [{"name": "A", "value": "1"}], "resources": {"limits": {"cpu": "4"}}})
    pdd = parse_pddeployment(doc)
    doc["spec"]["prefill"]["env"][0]["value"] = "changed"
    doc["spec"]["prefill"]["resources"]["limits"]["cpu"] = "8"
    assert pdd.spec.prefill.env[0]["value"] == "1"
    assert pdd.spec.prefill.resources["limits"]["cpu"] == "4"


def test_sim_engine_needs_no_image() -> None:
    spec = parse_spec({"model": "m", "engine": "sim"})
    assert (spec.engine, spec.image) == ("sim", "")


@pytest.mark.parametrize(
    ("spec", "path", "reason"),
    [
        (
            {"prefill": {"dataParallel": "8"}},
            "spec.prefill.dataParallel",
            'expected an integer >= 1, got "8" (string)',
        ),
        (
            {"prefill": {"dataParallel": 0}},
            "spec.prefill.dataParallel",
            "expected an integer >= 1, got 0 (integer)",
        ),
        ({"decode": {"tensorParallel": 65}}, "spec.decode.tensorParallel", "expected an integer <= 64"),
        (
            {"decode": {"instances": True}},
            "spec.decode.instances",
            "expected an integer >= 0, got true (boolean)",
        ),
        ({"decode": {"instances": -1}}, "spec.decode.instances", "expected an integer >= 0"),
        ({"engine": "trtllm"}, "spec.engine", 'expected one of "vllm", "sim", got "trtllm" (string)'),
        ({"image": ""}, "spec.image", "required when engine is vllm"),
        ({"model": ""}, "spec.model", "must not be empty"),
        ({"model": 7}, "spec.model", "expected a string, got 7 (integer)"),
        ({"gpuResource": "gpu"}, "spec.gpuResource", "expected an extended resource name"),
        (
            {"kvTransfer": {"connector": "LMCache"}},
            "spec.kvTransfer.connector",
            'expected one of "NixlConnector"',
        ),
        (
            {"kvTransfer": {"connector": "MoRIIOConnector"}},
            "spec.kvTransfer.transferMode",
            "required with connector MoRIIOConnector (READ or WRITE)",
        ),
        (
            {"kvTransfer": {"connector": "MoRIIOConnector", "transferMode": "read"}},
            "spec.kvTransfer.transferMode",
            'expected one of "READ", "WRITE", got "read" (string)',
        ),
        (
            {"kvTransfer": {"transferMode": "READ"}},
            "spec.kvTransfer.transferMode",
            "only valid with connector MoRIIOConnector, not NixlConnector",
        ),
        (
            {
                "kvTransfer": {
                    "connector": "MoRIIOConnector",
                    "transferMode": "READ",
                    "extraConfig": {"notify_port": 70000},
                }
            },
            "spec.kvTransfer.extraConfig.notify_port",
            "expected a port number 1-65535, got 70000 (integer)",
        ),
        (
            {
                "kvTransfer": {
                    "connector": "MoRIIOConnector",
                    "transferMode": "WRITE",
                    "extraConfig": {"read_mode": "true"},
                }
            },
            "spec.kvTransfer.extraConfig.read_mode",
            "contradicts transferMode WRITE",
        ),
        ({"kvTransfer": {"extraConfig": []}}, "spec.kvTransfer.extraConfig", "expected an object, got list"),
        (
            {"prefill": {"expertParallel": True}},
            "spec.prefill.expertParallel",
            "needs more than one GPU per instance (dataParallel x tensorParallel > 1)",
        ),
        ({"prefill": {"expertParallel": "yes"}}, "spec.prefill.expertParallel", "expected true or false"),
        ({"decode": {"nodesPerInstance": 2}}, "spec.decode.nodesPerInstance", "unknown field"),
        ({"gpusPerNode": 0}, "spec.gpusPerNode", "expected an integer >= 1"),
        ({"decode": {"gpusPerNode": 65}}, "spec.decode.gpusPerNode", "expected an integer <= 64"),
        ({"decode": {"pipelineParallel": 0}}, "spec.decode.pipelineParallel", "expected an integer >= 1"),
        ({"multiNode": {"backend": "grove"}}, "spec.multiNode.backend", '"pods", "lws"'),
        ({"multiNode": {"apiServers": "all"}}, "spec.multiNode.apiServers", '"perNode", "leader"'),
        (
            {"multiNode": {"rpcPort": 8000}},
            "spec.multiNode.rpcPort",
            "must differ from the engines' HTTP port",
        ),
        ({"multiNode": {"gangTimeoutSeconds": 5}}, "spec.multiNode.gangTimeoutSeconds", ">= 10"),
        (
            {"gpusPerNode": 8, "prefill": {"dataParallel": 12}},
            "spec.prefill.dataParallel",
            "a pod holds 8 ranks, so dataParallel must be a multiple of 8 (for example 8 or 16)",
        ),
        (
            {"gpusPerNode": 8, "decode": {"dataParallel": 2, "tensorParallel": 16}},
            "spec.decode.dataParallel",
            "must be 1 when a rank is larger than a node",
        ),
        (
            {"decode": {"tensorParallel": 16, "gpusPerNode": 8}},
            "spec.decode.tensorParallel",
            "tensor parallelism across nodes needs pipelineParallel > 1",
        ),
        (
            {"gpusPerNode": 8, "prefill": {"tensorParallel": 4, "pipelineParallel": 3}},
            "spec.prefill.tensorParallel",
            "must be a multiple of gpusPerNode 8",
        ),
        ({"prefill": {"args": "--foo"}}, "spec.prefill.args", 'expected a list, got "--foo" (string)'),
        (
            {"prefill": {"args": ["--max-model-len", 4096]}},
            "spec.prefill.args[1]",
            "expected a string, got 4096",
        ),
        (
            {"prefill": {"env": [{"value": "1"}]}},
            "spec.prefill.env[0].name",
            "expected an environment variable name",
        ),
        ({"prefill": {"env": ["A=1"]}}, "spec.prefill.env[0]", "expected an object"),
        (
            {"decode": {"nodeSelector": {"gpu": 8}}},
            "spec.decode.nodeSelector.gpu",
            "expected a string, got 8",
        ),
        ({"decode": {"tolerations": {}}}, "spec.decode.tolerations", "expected a list, got object"),
        ({"decode": {"replicas": 3}}, "spec.decode.replicas", "unknown field; known fields: instances"),
        (
            {"decode": {"DataParallel": 3}},
            "spec.decode.DataParallel",
            'unknown field (did you mean "dataParallel"?)',
        ),
        ({"router": {"port": 0}}, "spec.router.port", "expected an integer >= 1, got 0"),
        ({"router": {"port": 65536}}, "spec.router.port", "expected an integer <= 65535"),
        ({"router": {"policy": "random"}}, "spec.router.policy", 'expected one of "flat-interleaved"'),
        (
            {"router": {"serviceType": "ExternalName"}},
            "spec.router.serviceType",
            'expected one of "ClusterIP"',
        ),
        ({"router": {"backlog": 0}}, "spec.router.backlog", "expected an integer >= 1"),
        ({"router": {"workers": 65}}, "spec.router.workers", "expected an integer <= 64"),
        (
            {"rollout": {"maxUnavailable": -1}},
            "spec.rollout.maxUnavailable",
            "expected an integer >= 0, got -1",
        ),
        (
            {"rollout": {"maxUnavailable": 0, "maxSurge": 0}},
            "spec.rollout",
            "maxSurge and maxUnavailable cannot both be 0",
        ),
        ({"rollout": {"nodeLossSeconds": -5}}, "spec.rollout.nodeLossSeconds", "expected an integer >= 0"),
        ({"rollout": {"drainSeconds": 3601}}, "spec.rollout.drainSeconds", "expected an integer <= 3600"),
        ({"rollout": None}, "spec.rollout", "expected an object, got null"),
        ({"replicas": 2}, "spec.replicas", "unknown field"),
        ({"prefill": {"resources": {"limits": {"cpu": Path("x")}}}}, "spec.prefill.resources", "not JSON"),
    ],
)
def test_spec_errors_name_the_field_and_the_reason(spec: dict[str, Any], path: str, reason: str) -> None:
    err = error_of(manifest(**spec))
    assert err.path == path
    assert reason in err.reason
    assert str(err).startswith(f"{path}: ")


def test_the_issue_style_message_reads_exactly() -> None:
    err = error_of(manifest(prefill={"dataParallel": "8"}))
    assert str(err) == 'spec.prefill.dataParallel: expected an integer >= 1, got "8" (string)'


def test_missing_model_is_named() -> None:
    doc = copy.deepcopy(MINIMAL)
    del doc["spec"]["model"]
    assert str(error_of(doc)) == "spec.model: required field is missing"


@pytest.mark.parametrize(
    ("change", "path", "reason"),
    [
        (
            {"apiVersion": "pdserve.io/v1"},
            "apiVersion",
            'expected "pdserve.io/v1alpha1", got "pdserve.io/v1"',
        ),
        ({"kind": "Deployment"}, "kind", 'expected "PDDeployment", got "Deployment" (string)'),
        ({"metadata": {}}, "metadata.name", "required"),
        ({"metadata": {"name": "R1"}}, "metadata.name", "lowercase letters"),
        ({"metadata": {"name": "1st"}}, "metadata.name", "starting with a letter"),
        ({"metadata": {"name": "a" * 51}}, "metadata.name", "at most 50 characters"),
        ({"metadata": {"name": "r1", "namespace": "Bad_NS"}}, "metadata.namespace", "expected a namespace"),
        ({"metadata": {"name": "r1", "labels": {"a": 1}}}, "metadata.labels.a", "expected a string"),
        ({"spec": None}, "spec", "expected an object, got null"),
        ({"metadata": "r1"}, "metadata", "expected an object"),
    ],
)
def test_object_errors(change: dict[str, Any], path: str, reason: str) -> None:
    doc = copy.deepcopy(MINIMAL)
    doc.update(change)
    err = error_of(doc)
    assert err.path == path
    assert reason in err.reason


def test_object_metadata_is_read() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["metadata"].update(uid="0a1b", generation=7, labels={"team": "infer"})
    pdd = parse_pddeployment(doc)
    assert (pdd.uid, pdd.generation, dict(pdd.labels)) == ("0a1b", 7, {"team": "infer"})


def test_namespace_defaults_for_files() -> None:
    doc = copy.deepcopy(MINIMAL)
    del doc["metadata"]["namespace"]
    assert parse_pddeployment(doc).namespace == "default"


# --- files -------------------------------------------------------------------------------------


def test_load_manifest_file(tmp_path: Path) -> None:
    path = tmp_path / "r1.yaml"
    path.write_text(
        "# a comment\n---\napiVersion: pdserve.io/v1alpha1\nkind: PDDeployment\nmetadata: {name: r1}\n"
        "spec:\n  model: m\n  engine: sim\n  decode: {instances: 3}\n---\n"
    )
    pdd = load_manifest_file(path)
    assert (pdd.name, pdd.spec.decode.instances) == ("r1", 3)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_manifest_file(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a directory"):
        load_manifest_file(tmp_path)


def test_yaml_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("apiVersion: pdserve.io/v1alpha1\nkind: PDDeployment\nspec:\n  model: [m\n  image: x\n")
    with pytest.raises(SpecError) as info:
        load_manifest_file(path)
    assert info.value.path == str(path)
    assert "not valid YAML: line 5" in info.value.reason


def test_several_documents_are_refused() -> None:
    text = "kind: PDDeployment\n---\nkind: PDDeployment\n"
    with pytest.raises(SpecError, match="expected exactly one PDDeployment document, found 2"):
        load_manifest(text)


def test_empty_file_is_refused() -> None:
    with pytest.raises(SpecError, match="found 0"):
        load_manifest("# nothing\n")


def test_wrong_kind_in_a_file() -> None:
    with pytest.raises(SpecError) as info:
        load_manifest("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {}\n")
    assert info.value.path == "apiVersion"


@pytest.mark.parametrize(
    ("spec", "path", "hint"),
    [
        ({"prefil": {"instances": 1}}, "spec.prefil", "prefill"),
        ({"decode": {"dataParalel": 2}}, "spec.decode.dataParalel", "dataParallel"),
        ({"decode": {"tensorparallel": 2}}, "spec.decode.tensorparallel", "tensorParallel"),
        ({"modle": "m"}, "spec.modle", "model"),
        ({"router": {"replcias": 2}}, "spec.router.replcias", "replicas"),
    ],
)
def test_a_near_miss_field_gets_a_suggestion(spec: dict[str, Any], path: str, hint: str) -> None:
    """Misspellings, not only case: within a couple of edits (a swap of neighbours is one)."""
    with pytest.raises(SpecError) as info:
        parse_pddeployment(manifest(**spec))
    assert (info.value.path, info.value.reason) == (path, f'unknown field (did you mean "{hint}"?)')


def test_a_far_field_lists_the_known_ones() -> None:
    with pytest.raises(SpecError) as info:
        parse_pddeployment(manifest(decode={"gpus": 8}))
    assert info.value.reason.startswith("unknown field; known fields: instances, ")
