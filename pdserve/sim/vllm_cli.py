"""A ``vllm`` stand-in: ``vllm serve MODEL ...`` as the operator renders it, served by the simulator.

The test cluster's pod runner puts this first on an engine pod's PATH as ``vllm``, so an
``engine: vllm`` pod runs without a GPU. It knows a fixed set of vLLM 0.32 ``serve`` options
(:data:`MAPPED` changes what the simulator does, :data:`ACCEPTED` is vLLM tuning with no effect
on a simulator) and **refuses every other argument** (exit 2, naming it), so a flag the renderer
gets wrong fails a test instead of being ignored. Like vLLM it also accepts ``--flag=value`` and
underscores in flag names, and refuses a ``--kv-transfer-config`` that is not JSON or names a
connector or role the simulator does not simulate.

What maps where: ``--kv-transfer-config`` ``kv_role`` → ``--role`` (kv_producer: prefill,
kv_consumer: decode, kv_both: both); ``--data-parallel-size``/``--tensor-parallel-size`` →
``--dp-size``/``--tp-size``; the first ``--served-model-name`` (else MODEL) → ``--model``;
``--max-model-len``; ``--api-key`` → the simulator's key (as ``VLLM_API_KEY``); the engine flags
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``, ``--num-gpu-blocks-override``,
``--[no-]enable-prefix-caching``, ``--enable-prompt-tokens-details`` and
``kv_connector_extra_config.kv_lease_duration`` go to the simulator's flags of the same names, which
time answers with a step engine when ``$PDSERVE_SIM_PROFILE`` names a profile (vLLM has no flag for
it: the pod runner or local mode sets it), and change nothing without one; ``--otlp-traces-endpoint``
and ``--collect-detailed-traces`` go to the simulator's, which traces as vLLM does
(pdserve.sim.spans). The listen address is ``--host``, else ``$POD_IP`` (vLLM's default is every
address; here pods share one network namespace), else 127.0.0.1. The instance name is the
``engine_id`` of ``--kv-transfer-config``, else ``$HOSTNAME`` (the pod name). ``kv_connector`` →
``--kv-connector`` (the simulator plays that connector), and its side channel is advertised where
the connector's vLLM reads it (pdserve.kv: NIXL at ``$VLLM_NIXL_SIDE_CHANNEL_HOST``, else
``$VLLM_HOST_IP``, else the listen address, and ``$VLLM_NIXL_SIDE_CHANNEL_PORT``, else 5600);
without a connector, NIXL's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve import kv
from pdserve.sim import cli as sim_cli
from pdserve.wire import vllm

VERSION = f"{vllm.VERSION}+pdserve.sim"
CONNECTORS = kv.crd_names()
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
#: vLLM 0.32's KVTransferConfig fields (vllm/config/kv_transfer.py).
KV_TRANSFER_FIELDS = {
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
}

#: Options that change what the simulator does: (flags, argparse keyword arguments).
MAPPED: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--model",), {"dest": "model_flag"}),
    (("--host",), {}),
    (("--port",), {"type": int, "default": 8000}),
    (("--served-model-name",), {"nargs": "+"}),
    (("--data-parallel-size", "-dp"), {"type": int, "default": 1}),
    (("--tensor-parallel-size", "-tp"), {"type": int, "default": 1}),
    (("--pipeline-parallel-size", "-pp"), {"type": int, "default": 1}),
    (("--max-model-len",), {"type": int}),
    (("--kv-transfer-config",), {}),
    (("--api-key",), {}),
    (("--max-num-seqs",), {"type": int}),
    (("--max-num-batched-tokens",), {"type": int}),
    (("--block-size",), {"type": int}),
    (("--num-gpu-blocks-override",), {"type": int}),
    (("--enable-prefix-caching",), {"action": "store_true", "default": None}),
    (("--no-enable-prefix-caching",), {"action": "store_true"}),
    (("--enable-prompt-tokens-details",), {"action": "store_true"}),
    (("--otlp-traces-endpoint",), {}),
    (("--collect-detailed-traces",), {"nargs": "+", "choices": ("all", "model", "worker")}),
]
#: The environment variable naming the simulator's performance profile (``pdserve sim --profile``).
PROFILE_ENV = "PDSERVE_SIM_PROFILE"
#: vLLM 0.32 options that tune a real engine and mean nothing to a simulator: accepted, ignored.
ACCEPTED_VALUED = (
    "--dtype",
    "--kv-cache-dtype",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--tokenizer",
    "--tokenizer-mode",
    "--tokenizer-revision",
    "--revision",
    "--code-revision",
    "--quantization",
    "--chat-template",
    "--hf-overrides",
    "--hf-config-path",
    "--mamba-ssm-cache-dtype",
    "--compilation-config",
    "--seed",
    "--download-dir",
    "--load-format",
    "--uvicorn-log-level",
    "--max-logprobs",
    "--generation-config",
    "--override-generation-config",
    "--distributed-executor-backend",
    "--swap-space",
    "--cpu-offload-gb",
    "--limit-mm-per-prompt",
    "--tool-call-parser",
    "--reasoning-parser",
    "--api-server-count",
)
ACCEPTED_VALUED_SHORT = {"--optimization-level": "-O"}
ACCEPTED_SWITCHES = (
    "--enforce-eager",
    "--trust-remote-code",
    "--enable-expert-parallel",
    "--disable-log-stats",
    "--enable-log-requests",
    "--disable-uvicorn-access-log",
    "--enable-auto-tool-choice",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--disable-custom-all-reduce",
)


class Refused(Exception):
    """An argument the stand-in does not know or cannot simulate; exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print usage and exit; say it our way
        raise Refused(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vllm serve", allow_abbrev=False, add_help=False)
    p.add_argument("model", nargs="?")
    for flags, kwargs in MAPPED:
        p.add_argument(*flags, **kwargs)
    for flag in ACCEPTED_VALUED:
        p.add_argument(flag)
    for flag, short in ACCEPTED_VALUED_SHORT.items():
        p.add_argument(flag, short)
    for flag in ACCEPTED_SWITCHES:
        p.add_argument(flag, action="store_true")
    return p


def _normalise(args: Sequence[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser: ``--max_model_len`` is ``--max-model-len``."""
    out = []
    for arg in args:
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            arg = flag.replace("_", "-") + eq + value
        out.append(arg)
    return out


@dataclass(frozen=True)
class Serve:
    """What a parsed ``vllm serve`` command means to the simulator."""

    model: str
    role: str
    dp: int
    tp: int
    port: int
    host: str | None
    max_model_len: int | None
    api_key: str | None
    connector: str | None
    engine_id: str | None = None
    #: The step engine's flags, as ``pdserve sim`` arguments (vLLM's names).
    engine_args: tuple[str, ...] = ()
    #: ``--otlp-traces-endpoint`` and ``--collect-detailed-traces``, as ``pdserve sim`` arguments.
    tracing_args: tuple[str, ...] = ()


def parse(args: Sequence[str]) -> Serve:
    """Parse ``vllm serve`` arguments (after ``serve``); raises :class:`Refused`."""
    ns = parser().parse_args(_normalise(args))
    model = ns.model or ns.model_flag
    if not model:
        raise Refused("the model is missing (vllm serve MODEL)")
    if ns.model and ns.model_flag and ns.model != ns.model_flag:
        raise Refused(f"two models: {ns.model} and --model {ns.model_flag}")
    if ns.pipeline_parallel_size != 1:
        raise Refused("--pipeline-parallel-size other than 1 is not simulated")
    for flag, value in (
        ("--data-parallel-size", ns.data_parallel_size),
        ("--tensor-parallel-size", ns.tensor_parallel_size),
    ):
        if value < 1:
            raise Refused(f"{flag} must be >= 1, got {value}")
    role, connector, lease, engine_id = "both", None, None, None
    if ns.kv_transfer_config is not None:
        try:
            config = json.loads(ns.kv_transfer_config)
        except json.JSONDecodeError as exc:
            raise Refused(f"--kv-transfer-config is not JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise Refused("--kv-transfer-config must be a JSON object")
        connector = config.get("kv_connector")
        if connector not in CONNECTORS:
            raise Refused(
                f"--kv-transfer-config: kv_connector {connector!r} is not simulated ({', '.join(CONNECTORS)})"
            )
        if config.get("kv_role") not in ROLES:
            raise Refused(
                f"--kv-transfer-config: kv_role {config.get('kv_role')!r} is not one of {', '.join(ROLES)}"
            )
        unknown = sorted(set(config) - KV_TRANSFER_FIELDS)
        if unknown:
            raise Refused(f"--kv-transfer-config: unknown keys {', '.join(unknown)}")
        role = ROLES[config["kv_role"]]
        engine_id = config.get("engine_id") if isinstance(config.get("engine_id"), str) else None
        extra = config.get("kv_connector_extra_config")
        if isinstance(extra, dict) and extra.get("kv_lease_duration") is not None:
            lease = extra["kv_lease_duration"]
            if isinstance(lease, bool) or not isinstance(lease, int | float) or lease < 0:
                raise Refused(f"--kv-transfer-config: kv_lease_duration must be a number >= 0, got {lease!r}")
    if ns.enable_prefix_caching and ns.no_enable_prefix_caching:
        raise Refused("--enable-prefix-caching and --no-enable-prefix-caching together")
    engine_args: list[str] = []
    for flag, value in (
        ("--max-num-seqs", ns.max_num_seqs),
        ("--max-num-batched-tokens", ns.max_num_batched_tokens),
        ("--block-size", ns.block_size),
        ("--num-gpu-blocks-override", ns.num_gpu_blocks_override),
        ("--kv-lease-duration", lease),
    ):
        if value is not None:
            if flag != "--kv-lease-duration" and value < 1:
                raise Refused(f"{flag} must be >= 1, got {value}")
            engine_args += [flag, str(value)]
    if ns.no_enable_prefix_caching:
        engine_args.append("--no-enable-prefix-caching")
    if ns.enable_prompt_tokens_details:
        engine_args.append("--enable-prompt-tokens-details")
    if ns.collect_detailed_traces and not ns.otlp_traces_endpoint:
        raise Refused("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")  # vLLM's words
    tracing_args: list[str] = []
    if ns.otlp_traces_endpoint:
        tracing_args += ["--otlp-traces-endpoint", ns.otlp_traces_endpoint]
    if ns.collect_detailed_traces:
        tracing_args += ["--collect-detailed-traces", *ns.collect_detailed_traces]
    return Serve(
        model=(ns.served_model_name or [model])[0],
        role=role,
        dp=ns.data_parallel_size,
        tp=ns.tensor_parallel_size,
        port=ns.port,
        host=ns.host,
        max_model_len=ns.max_model_len,
        api_key=ns.api_key,
        connector=connector,
        engine_id=engine_id,
        engine_args=tuple(engine_args),
        tracing_args=tuple(tracing_args),
    )


def sim_argv(serve: Serve, env: dict[str, str]) -> list[str]:
    """The ``pdserve sim`` arguments for ``serve`` in environment ``env``."""
    host = serve.host or env.get("POD_IP") or "127.0.0.1"
    connector = kv.by_crd(serve.connector) if serve.connector is not None else kv.DEFAULT
    sim = connector.simulate
    kv_host = next((env[name] for name in sim.host_env if env.get(name)), host)
    kv_port = (env.get(sim.port_env) if sim.port_env else None) or str(sim.default_port)
    argv = [
        "--role", serve.role,
        "--dp-size", str(serve.dp),
        "--tp-size", str(serve.tp),
        "--host", host,
        "--port", str(serve.port),
        "--model", serve.model,
        "--instance-name", serve.engine_id or env.get("HOSTNAME") or f"vllm-{host}-{serve.port}",
        "--kv-host", kv_host,
        "--kv-port", kv_port,
    ]  # fmt: skip
    if serve.connector is not None:
        argv += ["--kv-connector", connector.names.table]
    if serve.max_model_len is not None:
        argv += ["--max-model-len", str(serve.max_model_len)]
    argv += serve.engine_args
    argv += serve.tracing_args
    if env.get(PROFILE_ENV):
        argv += ["--profile", env[PROFILE_ENV]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--version"], ["-v"]):
        print(VERSION)
        return 0
    if not args or args[0] != "serve":
        print(
            f"vllm (pdserve simulator): error: only `vllm serve` is simulated, got {args[:1]}",
            file=sys.stderr,
        )
        return 2
    try:
        serve = parse(args[1:])
    except Refused as exc:
        print(f"vllm serve (pdserve simulator): error: {exc}", file=sys.stderr)
        return 2
    if serve.api_key:
        os.environ["VLLM_API_KEY"] = serve.api_key
    sim_parser = argparse.ArgumentParser(prog="pdserve sim")
    sim_cli.configure(sim_parser)
    sim_args = sim_argv(serve, dict(os.environ))
    print(
        f"vllm serve (pdserve simulator {VERSION}): pdserve sim {' '.join(sim_args)}",
        file=sys.stderr,
        flush=True,
    )
    return sim_cli.run(sim_parser.parse_args(sim_args))


if __name__ == "__main__":
    sys.exit(main())
