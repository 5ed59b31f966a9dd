"""The ``vllm`` stand-in accepts every command line the operator renders and refuses what it does not know."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.routing import Role
from pdserve.sim import vllm_cli
from tests.support import specs

TP8 = {"dataParallel": 1, "tensorParallel": 8}
DP8EP = {"dataParallel": 8, "tensorParallel": 1, "expertParallel": True}
TP2DP2 = {"dataParallel": 2, "tensorParallel": 2}
KV = {
    "nixl": ({"connector": "NixlConnector"}, "nvidia.com/gpu"),
    "moriio": ({"connector": "MoRIIOConnector", "transferMode": "READ"}, "amd.com/gpu"),
}
SHAPES = {"tp8": (TP8, TP8), "dp8ep-tp8": (DP8EP, TP8), "tp2dp2": (TP2DP2, TP2DP2)}
#: Engine flags a user adds through args, as the examples and docs do.
USER_ARGS = [
    "--max-model-len", "4096", "--enforce-eager", "--dtype", "bfloat16", "--block-size", "16",
    "--kv-cache-dtype", "auto", "--gpu-memory-utilization=0.9", "--trust-remote-code", "--max_num_seqs", "64",
]  # fmt: skip


def manifest(connector: str, shape: str, **extra: Any) -> dict[str, Any]:
    kv, gpu = KV[connector]
    prefill, decode = SHAPES[shape]
    if connector == "moriio" and any(
        r["dataParallel"] > 1 and r["tensorParallel"] > 1 for r in (prefill, decode)
    ):
        pytest.skip("MoRIIO refuses DP and TP together")
    spec = {
        "model": "Qwen/Qwen3-0.6B",
        "servedModelName": "qwen",
        "engine": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "gpuResource": gpu,
        "kvTransfer": kv,
        "prefill": {"instances": 1, **prefill, "args": USER_ARGS},
        "decode": {"instances": 2, **decode},
    }
    metadata = {"namespace": "serving", "uid": "u", "generation": 1}
    return specs.manifest("m", metadata=metadata, **{**spec, **extra})


def engine_argv(pod: dict[str, Any]) -> list[str]:
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    return [*engine["command"], *engine["args"]]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("connector", KV)
def test_every_rendered_vllm_command_is_accepted(connector: str, shape: str) -> None:
    pdd = parse_pddeployment(manifest(connector, shape))
    for role in (Role.PREFILL, Role.DECODE):
        argv = engine_argv(instance_pod(pdd, role, 0))
        assert argv[:2] == ["vllm", "serve"]
        serve = vllm_cli.parse(argv[2:])
        rs = pdd.spec.role(role)
        assert (serve.role, serve.dp, serve.tp) == (role.value, rs.data_parallel, rs.tensor_parallel)
        assert serve.model == "qwen"
        assert serve.connector == KV[connector][0]["connector"]
        sim = vllm_cli.sim_argv(serve, {"POD_IP": "127.128.128.9", "HOSTNAME": "m-decode-0"})
        assert sim[sim.index("--host") + 1] == "127.128.128.9"
        assert sim[sim.index("--instance-name") + 1] == "m-decode-0"


def test_a_pod_template_changing_the_engine_keeps_its_command_accepted() -> None:
    # Templates may not set the engine's args (validate.py); extra flags go through the role's args.
    template = {"spec": {"containers": [{"name": "engine", "env": [{"name": "X", "value": "1"}]}]}}
    pdd = parse_pddeployment(manifest("nixl", "tp8", decode={"instances": 1, **TP8, "template": template}))
    argv = engine_argv(instance_pod(pdd, Role.DECODE, 0))
    assert vllm_cli.parse(argv[2:]).role == "decode"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["m", "--no-such-flag"], "--no-such-flag"),
        (["m", "--max-model-len", "9", "--bogus=1"], "--bogus=1"),
        (["m", "--max-model"], "--max-model"),  # no abbreviations
        (["m", "--kv-transfer-config", "{"], "not JSON"),
        (
            ["m", "--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'],
            "LMCache",
        ),
        (["m", "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both","x":1}'], "x"),
        (["m", "-pp", "2"], "pipeline"),
        ([], "model"),
    ],
)
def test_unknown_arguments_are_refused(args: list[str], named: str) -> None:
    with pytest.raises(vllm_cli.Refused, match=named):
        vllm_cli.parse(args)


def test_the_entry_point_exits_2_naming_the_argument() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.sim.vllm_cli", "serve", "m", "--frobnicate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--frobnicate" in out.stderr


@pytest.mark.parametrize("shape", SHAPES)
def test_rendered_sim_commands_parse_with_the_simulators_own_parser(shape: str) -> None:
    import argparse

    from pdserve.sim import cli as sim_cli

    doc = manifest("nixl", shape)
    doc["spec"].update(engine="sim")
    doc["spec"].pop("image")
    doc["spec"]["prefill"]["args"] = ["--ttft-ms", "5"]  # a sim role's args are the simulator's flags
    pdd = parse_pddeployment(doc)
    for role in (Role.PREFILL, Role.DECODE):
        argv = engine_argv(instance_pod(pdd, role, 0))
        assert argv[:2] == ["pdserve", "sim"]
        parser = argparse.ArgumentParser(exit_on_error=False)
        sim_cli.configure(parser)
        args = parser.parse_args([a.replace("$(POD_IP)", "127.128.128.3") for a in argv[2:]])
        rs = pdd.spec.role(role)
        assert (args.role, args.dp_size, args.tp_size) == (role.value, rs.data_parallel, rs.tensor_parallel)


def test_engine_flags_reach_the_simulator_under_their_names() -> None:
    serve = vllm_cli.parse(
        [
            "m", "--max-num-seqs", "64", "--max_num_batched_tokens=512", "--block-size", "32",
            "--num-gpu-blocks-override", "100", "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details", "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_producer",'
            '"kv_connector_extra_config":{"kv_lease_duration":12}}',
        ]
    )  # fmt: skip
    argv = vllm_cli.sim_argv(serve, {"PDSERVE_SIM_PROFILE": "cpu-tiny-llama"})
    tail = argv[argv.index("--max-num-seqs") :]
    assert tail == [
        "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--block-size", "32",
        "--num-gpu-blocks-override", "100", "--kv-lease-duration", "12", "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details", "--profile", "cpu-tiny-llama",
    ]  # fmt: skip
    parser = __import__("argparse").ArgumentParser()
    vllm_cli.sim_cli.configure(parser)
    args = parser.parse_args(argv)
    assert (args.max_num_seqs, args.block_size, args.enable_prefix_caching) == (64, 32, False)
    assert args.profile == "cpu-tiny-llama" and args.kv_lease_duration == 12


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--enable-prefix-caching", "--no-enable-prefix-caching"], "together"),
        (
            ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer",'
             '"kv_connector_extra_config":{"kv_lease_duration":-1}}'],
            "kv_lease_duration",
        ),
    ],
)  # fmt: skip
def test_bad_engine_flags_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(vllm_cli.Refused, match=message):
        vllm_cli.parse(["m", *args])
