"""vLLM compatibility rules read from vLLM 0.32: refusals, exemptions, and agreement with the CRD's CEL."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.deployment.spec import vllm_compat
from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.deployment.validate import problems
from pdserve.kv import moriio
from tests.support.specs import pdd_of

REPO = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((REPO / "crds" / "pddeployments.pdserve.io.yaml").read_text())
SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
MORIIO = {"connector": "MoRIIOConnector", "transferMode": "READ"}


@pytest.mark.parametrize(("p", "d"), [(1, 8), (8, 1), (4, 2), (2, 4), (3, 3), (2, 6)])
def test_tensor_parallel_sizes_that_divide_are_accepted(p: int, d: int) -> None:
    assert problems(pdd_of(prefill={"tensorParallel": p}, decode={"tensorParallel": d}), None) == []


@pytest.mark.parametrize(("p", "d"), [(8, 3), (3, 8), (4, 6), (6, 4)])
def test_tensor_parallel_sizes_that_do_not_divide_are_refused(p: int, d: int) -> None:
    found = problems(pdd_of(prefill={"tensorParallel": p}, decode={"tensorParallel": d}), None)
    assert found == [f"spec.{vllm_compat.TP_RATIO.message}"]


def test_moriio_needs_amd_gpus_and_no_instance_with_both_dp_and_tp() -> None:
    assert problems(pdd_of(kvTransfer=MORIIO), None) == [f"spec.{moriio.AMD_ONLY.rule.message}"]
    amd = {"kvTransfer": MORIIO, "gpuResource": "amd.com/gpu"}
    assert problems(pdd_of(**amd, decode={"dataParallel": 8}), None) == []
    assert problems(pdd_of(**amd, decode={"tensorParallel": 8}), None) == []
    found = problems(pdd_of(**amd, prefill={"dataParallel": 2, "tensorParallel": 4}), None)
    assert found == [f"spec.{moriio.NOT_DP_AND_TP.rule.message}"]
    # NIXL has no such limit: its listener is per DP rank and serves every TP rank.
    assert problems(pdd_of(prefill={"dataParallel": 2, "tensorParallel": 4}), None) == []


@pytest.mark.parametrize(
    ("p", "d", "ok"),
    [
        ("16", "16", True),
        ("16", "32", True),
        ("16", "64", True),
        ("32", "16", False),
        ("16", "48", True),
        ("32", "48", False),
    ],
)
def test_nixl_block_sizes(p: str, d: str, ok: bool) -> None:
    pdd = pdd_of(prefill={"args": [f"--block-size={p}"]}, decode={"args": ["--block-size", d]})
    found = problems(pdd, None)
    assert (found == []) is ok, found
    if not ok:
        assert found == [
            f"spec.prefill.args, spec.decode.args: --block-size {p} on prefill and {d} on decode; with "
            "NixlConnector the prefill's block size must be at most the decode's and divide it"
        ]
    assert problems(pdd_of(prefill={"args": ["--block-size", "32"]}), None) == []  # one side: vLLM's default


def test_cache_dtype_and_dtype_must_match() -> None:
    found = problems(pdd_of(prefill={"args": ["--kv-cache-dtype", "fp8"]}), None)
    assert found == [
        "spec.prefill.args, spec.decode.args: --kv-cache-dtype is fp8 on prefill and auto on decode; set "
        "the same on both (vLLM's KV handshake refuses a mismatch)"
    ]
    same = {"args": ["--kv-cache-dtype=fp8", "--dtype", "bfloat16"]}
    assert problems(pdd_of(prefill=same, decode=same), None) == []
    assert (
        len(
            problems(
                pdd_of(prefill={"args": ["--dtype", "float16"]}, decode={"args": ["--dtype", "bfloat16"]}),
                None,
            )
        )
        == 1
    )


def test_the_simulator_is_exempt() -> None:
    pdd = pdd_of(
        engine="sim", image="", kvTransfer=MORIIO, prefill={"tensorParallel": 3}, decode={"tensorParallel": 2}
    )
    assert problems(pdd, None) == []


def test_every_example_passes_every_rule() -> None:
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        assert problems(load_manifest_file(path), None) == [], path


def test_cel_rules_carry_the_rules_messages() -> None:
    messages = {r["message"] for r in SPEC["x-kubernetes-validations"]}
    for rule in vllm_compat.RULES:
        assert (rule.message in messages) is rule.cel, rule.id
        assert rule.source.startswith(("vllm/", "docs/")), rule.id


def test_the_reference_lists_every_rule_with_its_source() -> None:
    text = (REPO / "docs" / "reference.md").read_text()
    for rule in vllm_compat.RULES:
        assert f"| `{rule.id}` |" in text
        assert rule.source.split()[0] in text
