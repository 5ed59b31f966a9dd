"""validate.problems: rules beyond the schema, each message naming the field and what to do."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.validate import problems
from tests.support import specs


def pdd_of(**spec: Any) -> PDDeployment:
    shape = {
        "prefill": {"instances": 2, "dataParallel": 8, "expertParallel": True},
        "decode": {"instances": 1, "tensorParallel": 8},
    }
    return specs.pdd_of(**{"image": "vllm/vllm-openai:v0.11.0", **shape, **spec})


def test_a_fitting_deployment_has_no_problems() -> None:
    assert problems(pdd_of(), [8, 8, 4]) == []
    assert problems(pdd_of(), None) == []  # nodes unknown: that check is skipped


def test_an_instance_larger_than_uniform_nodes_is_split_by_their_count() -> None:
    assert problems(pdd_of(decode={"tensorParallel": 8, "pipelineParallel": 2}), [8, 8]) == []
    found = problems(pdd_of(decode={"tensorParallel": 16}), [8, 8, 0])
    assert found == [
        "spec.decode.tensorParallel: 16 is larger than a node (gpusPerNode 8): tensor parallelism across "
        "nodes needs pipelineParallel > 1 (for example tensorParallel 8, pipelineParallel 2) "
        "(gpusPerNode 8: the nodes' allocatable nvidia.com/gpu)"
    ]


def test_nodes_of_different_sizes_need_gpus_per_node_for_a_larger_instance() -> None:
    big = {"dataParallel": 16, "expertParallel": True}
    assert problems(pdd_of(prefill=big), [4, 8, 8]) == [
        "spec.gpusPerNode is required: nodes have 4 and 8 nvidia.com/gpu"
    ]
    assert problems(pdd_of(prefill=big, gpusPerNode=8), [4, 8, 8]) == []
    assert problems(pdd_of(prefill={**big, "gpusPerNode": 4}), [4, 8]) == []


def test_a_pod_larger_than_every_node() -> None:
    found = problems(pdd_of(gpusPerNode=16, prefill={"dataParallel": 32}), [8, 8])
    assert found == [
        "spec.prefill: a pod of an instance needs 16 nvidia.com/gpu, but the largest node has 8; "
        "set gpusPerNode to 8 or less"
    ]


def test_no_node_with_the_gpu_resource() -> None:
    found = problems(pdd_of(), [0, 0])
    assert len(found) == 2
    assert (
        found[0]
        == "spec.prefill: an instance needs 8 nvidia.com/gpu, but no node has allocatable nvidia.com/gpu"
    )
    assert problems(pdd_of(), []) == found


def test_group_flags_are_refused_in_args() -> None:
    for flag in ("--data-parallel-start-rank", "--headless", "--nnodes", "--pipeline-parallel-size"):
        found = problems(pdd_of(decode={"args": [flag, "1"]}), None)
        assert len(found) == 1 and found[0].startswith(f"spec.decode.args[0]: {flag} is set by pdserve (")


def test_decode_sidecar_with_a_multi_node_decode_is_refused() -> None:
    found = problems(
        pdd_of(gpusPerNode=8, decode={"dataParallel": 16}, router={"placement": "decode-sidecar"}), None
    )
    assert found == [
        "spec.router.placement: decode-sidecar is not supported with multi-node decode instances "
        "(2 pods each with gpusPerNode 8); use placement deployment"
    ]


def test_gpu_request_in_resources_must_be_the_pods_share() -> None:
    spec = {
        "gpusPerNode": 8,
        "prefill": {"dataParallel": 16, "resources": {"limits": {"nvidia.com/gpu": "16"}}},
    }
    found = problems(pdd_of(**spec), None)
    assert found == [
        "spec.prefill.resources.limits[nvidia.com/gpu]: pdserve requests dataParallel x tensorParallel = 16 "
        "GPUs per instance, 8 in each of its 2 pods, got 16; remove it from resources"
    ]


def test_zero_instances_and_sim_need_no_gpus() -> None:
    assert problems(pdd_of(prefill={"instances": 0, "dataParallel": 8}, decode={"instances": 0}), []) == []
    assert problems(pdd_of(engine="sim", image=""), []) == []


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--port", "--port"),
        ("--port=9000", "--port"),
        ("--data-parallel-size", "--data-parallel-size"),
        ("-tp", "-tp"),
        ("--kv-transfer-config", "--kv-transfer-config"),
        ("--served-model-name=x", "--served-model-name"),
        ("--enable-expert-parallel", "--enable-expert-parallel"),
    ],
)
def test_flags_pdserve_owns_are_refused(arg: str, flag: str) -> None:
    found = problems(pdd_of(decode={"args": ["--enforce-eager", arg, "1"]}), None)
    assert len(found) == 1
    assert found[0].startswith(f"spec.decode.args[1]: {flag} is set by pdserve (")
    assert found[0].endswith("remove it from args")


def test_sim_owned_flags() -> None:
    found = problems(
        pdd_of(engine="sim", image="", prefill={"args": ["--ttft-ms", "5", "--dp-size", "2"]}), None
    )
    assert found == [
        "spec.prefill.args[2]: --dp-size is set by pdserve (set dataParallel); remove it from args"
    ]


def test_other_args_pass() -> None:
    assert problems(pdd_of(prefill={"args": ["--max-model-len=32768", "--portable"]}), None) == []


def test_env_pdserve_owns_is_refused() -> None:
    found = problems(pdd_of(prefill={"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "x"}]}), None)
    assert found == [
        "spec.prefill.env[0]: VLLM_NIXL_SIDE_CHANNEL_HOST is set by pdserve to the pod IP; remove it from env"
    ]


def test_gpu_count_in_resources_must_agree() -> None:
    found = problems(
        pdd_of(decode={"tensorParallel": 8, "resources": {"limits": {"nvidia.com/gpu": 4}}}), None
    )
    assert found == [
        "spec.decode.resources.limits[nvidia.com/gpu]: pdserve requests dataParallel x tensorParallel = 8 "
        "GPUs per instance, got 4; remove it from resources"
    ]
    same = pdd_of(decode={"tensorParallel": 8, "resources": {"requests": {"nvidia.com/gpu": "8"}}})
    assert problems(same, None) == []


def test_moriio_needs_amd_gpus_for_vllm() -> None:
    kv = {"connector": "MoRIIOConnector", "transferMode": "READ"}
    found = problems(pdd_of(kvTransfer=kv), None)
    assert found == [
        "spec.kvTransfer.connector: MoRIIOConnector moves KV between AMD GPUs (ROCm): set gpuResource to "
        "amd.com/gpu, or use NixlConnector"
    ]
    assert problems(pdd_of(kvTransfer=kv, gpuResource="amd.com/gpu"), [8]) == []
    assert problems(pdd_of(kvTransfer=kv, engine="sim", image=""), None) == []


def test_routers_and_sim_engines_run_the_operators_image_unless_the_spec_names_one() -> None:
    from pdserve.deployment.render.groups import render_all
    from pdserve.deployment.validate import with_pdserve_image

    mine = "registry.example.com/pdserve:0.1.0"
    pdd = with_pdserve_image(pdd_of(engine="sim", image=""), mine)
    images = {
        c["image"]
        for obj in render_all(pdd)
        if obj["kind"] in ("Pod", "Deployment")
        for c in (obj["spec"].get("template", {}).get("spec") or obj["spec"])["containers"]
    }
    assert images == {mine}
    named = pdd_of(engine="sim", image="", router={"image": "other:1"})
    assert with_pdserve_image(named, mine) == named
