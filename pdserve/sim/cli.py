"""Run a fake vLLM server with real prefill/decode (P/D) and data-parallel (DP) semantics.

An OpenAI-compatible server (POST /v1/completions, /v1/chat/completions, streaming or not)
that answers the way vLLM does in a P/D deployment, without a GPU or a model:

  * X-data-parallel-rank picks one of --dp-size engine ranks (400 when out of range,
    in vLLM's words); without it the simulator balances over its ranks itself.
  * A prefill request (kv_transfer_params.do_remote_decode) answers with the kv_transfer_params
    its KV connector answers (--kv-connector; by default recognised from each request's
    fields): NIXL's (remote_engine_id "<instance-name>-dp<rank>", block ids, host, port,
    request id), MoRIIO's, and so on (pdserve.kv).
  * A decode request (do_remote_prefill) with missing or malformed handoff fields gets a
    400 naming them (real vLLM would hang) and is counted as malformed_handoff.
  * Output is deterministic: token i is " tok<i>"; --ttft-ms before the first token,
    --itl-ms between tokens.
  * GET /health, /v1/models, /metrics (per-engine vllm:* metrics), /sim/stats (counters and
    the last requests), POST /sim/reset, GET/POST /sim/faults (fault injection at run time),
    POST /start_profile, /stop_profile.
  * VLLM_API_KEY set: /v1/* answers 401 without 'Authorization: Bearer <key>', as vLLM does.

Fault specs (--fault, repeatable): KIND[:ARG][@RATE], RATE in [0, 1] (default 1); kinds
without an argument also take KIND:RATE. Kinds: malformed-kv-params, http-500, hang,
slow-first-byte:MS, drop-mid-stream, reset, slow-end:MS. Examples: --fault http-500:0.5
--fault slow-first-byte:2000@0.25. See docs/simulator.md for what a client sees.

SIGTERM or SIGINT stops it cleanly, and it then dies of that signal (its exit status says so);
a port already in use is one line naming the flag.

Environment (vLLM's variables of the same names):
  VLLM_API_KEY                      /v1/* needs 'Authorization: Bearer <key>' (above)
  VLLM_KEEP_ALIVE_ON_ENGINE_DEATH   1: the API server stays up when a multi-node group breaks
                                    (what is in flight still fails); unset: it exits
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from pdserve import kv
from pdserve.argtypes import (
    add_flags,
    flag_values,
    non_negative_float,
    positive_int,
    setting,
    stating_default,
)
from pdserve.listen import unavailable
from pdserve.sim.config import ROLES, SimConfig
from pdserve.sim.engine import flags as engine_flags
from pdserve.sim.faults import FaultSpecError, parse_faults
from pdserve.sim.group import GroupConfig, GroupConfigError
from pdserve.sim.payloads import Identity
from pdserve.sim.process import serve
from pdserve.sim.server import Simulator

AUTO = "auto"


@dataclass(frozen=True)
class SimFlags:
    """What the simulated engine is and does (the fields SimConfig shares with it are its own)."""

    role: str = setting(
        "both",
        "--role",
        choices=ROLES,
        help="P/D role: prefill serves do_remote_decode requests, decode serves do_remote_prefill "
        "requests, both serves either; every role serves plain requests",
    )
    dp_size: int = setting(1, "--dp-size", type=positive_int, help="number of data-parallel engine ranks")
    host: str = setting("127.0.0.1", "--host", help="address to listen on")
    port: int = setting(8000, "--port", help="port to listen on")
    ttft_ms: float = setting(20.0, "--ttft-ms", type=non_negative_float, help="time to first token in ms")
    itl_ms: float = setting(5.0, "--itl-ms", type=non_negative_float, help="inter-token latency in ms")
    tokens: int = setting(
        16,
        "--tokens",
        type=positive_int,
        help="tokens generated per request; a request's max_tokens caps it",
    )
    model: str = setting("sim-model", "--model", help="served model name; other names get 404")
    instance_name: str | None = setting(
        None,
        "--instance-name",
        help="instance name used in remote_engine_id '<name>-dp<rank>' (default: sim-<host>-<port>)",
    )
    kv_connector: str = setting(
        AUTO,
        "--kv-connector",
        choices=(AUTO, *kv.table_types()),
        help="the KV connector this engine plays, as the routing table names it (vLLM's "
        "--kv-transfer-config); auto recognises it from each request's kv_transfer_params",
    )
    kv_host: str | None = setting(
        None,
        "--kv-host",
        help="side-channel host reported in a prefill's answer (NIXL: remote_host; default: the "
        "--host address)",
    )
    kv_port: int = setting(
        kv.DEFAULT.simulate.default_port,
        "--kv-port",
        help=f"side-channel port reported in a prefill's answer (NIXL: remote_port; default: "
        f"{kv.DEFAULT.simulate.default_port})",
    )
    tp_size: int = setting(1, "--tp-size", type=positive_int, help="tensor-parallel size reported as tp_size")
    max_model_len: int = setting(
        4096, "--max-model-len", type=positive_int, help="max_model_len in /v1/models"
    )
    fault: tuple[str, ...] = setting(
        (),
        "--fault",
        action="append",
        metavar="KIND[:ARG][@RATE]",
        help="inject a fault into generation requests (repeatable; first that fires wins): "
        "malformed-kv-params, http-500, hang, slow-first-byte:MS, drop-mid-stream, reset, slow-end:MS",
    )
    seed: int | None = setting(
        None, "--seed", type=int, help="seed of the fault dice, for reproducible runs (default: random)"
    )
    backlog: int = setting(4096, "--backlog", type=positive_int, help="listen backlog of the socket")


@dataclass(frozen=True)
class TracingFlags:
    """vLLM's tracing flags (pdserve.sim.spans)."""

    otlp_traces_endpoint: str | None = setting(
        None,
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export vLLM's llm_request span of every finished request here, the child of the "
        "traceparent it came with; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks the exporter as in vLLM "
        "(grpc by default, or http/protobuf). Needs the tracing extra (pdserve[tracing])",
    )
    collect_detailed_traces: tuple[str, ...] | None = setting(
        None,
        "--collect-detailed-traces",
        nargs="+",
        choices=("all", "model", "worker"),
        help="accepted as vLLM 0.32 accepts it (needs --otlp-traces-endpoint); adds nothing to the span",
    )


@dataclass(frozen=True)
class GroupFlags:
    """One node of a multi-node group, as vLLM's flags say it (the fields GroupConfig shares with
    it are its own)."""

    dp_local: int | None = setting(
        None,
        "--data-parallel-size-local",
        type=positive_int,
        help="DP ranks of this node (default: --dp-size, a single-node server)",
    )
    start_rank: int = setting(0, "--data-parallel-start-rank", help="global rank of this node's first rank")
    data_parallel_address: str | None = setting(None, "--data-parallel-address", help="the leader's address")
    data_parallel_rpc_port: int | None = setting(
        None,
        "--data-parallel-rpc-port",
        type=int,
        help="the leader's RPC port: the leader listens there, the other nodes join it",
    )
    hybrid_lb: bool = setting(
        False,
        "--data-parallel-hybrid-lb",
        action="store_true",
        help="an API server per node for its local ranks (X-data-parallel-rank is local)",
    )
    headless: bool = setting(
        False,
        "--headless",
        action="store_true",
        help="no OpenAI API: engines only (the leader forwards their ranks; /sim/* stays on --port)",
    )
    nnodes: int = setting(1, "--nnodes", type=positive_int, help="nodes of a TP/PP-across-nodes group")
    node_rank: int = setting(0, "--node-rank", help="this node's index in --nnodes")
    master_addr: str | None = setting(None, "--master-addr", help="node 0's address (--nnodes > 1)")
    master_port: int | None = setting(None, "--master-port", type=int, help="node 0's port (--nnodes > 1)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SimFlags, describe=stating_default)
    tracing = parser.add_argument_group("tracing (vLLM's flags and behaviour, docs/operations.md#tracing)")
    add_flags(parser, TracingFlags, tracing)
    group = parser.add_argument_group(
        "multi-node groups (one process per node, flags as vLLM's; docs/simulator.md)"
    )
    add_flags(parser, GroupFlags, group, describe=stating_default)
    engine_flags.configure(parser)


def group_config(args: argparse.Namespace) -> GroupConfig:
    """The multi-node flags as one value (GroupConfigError names the flag vLLM would refuse)."""
    tp_pp = args.nnodes > 1
    return GroupConfig(
        **flag_values(args, GroupFlags, into=GroupConfig),
        dp_size=args.dp_size,
        address=args.master_addr if tp_pp else args.data_parallel_address,
        rpc_port=args.master_port if tp_pp else args.data_parallel_rpc_port,
    ).check()


def run(args: argparse.Namespace) -> int:
    try:
        faults = parse_faults(args.fault)
        group = group_config(args)
        engine = engine_flags.engine_setup(args, args.max_model_len)
    except (FaultSpecError, GroupConfigError, engine_flags.ProfileError, engine_flags.EngineFlagError) as exc:
        print(f"pdserve sim: error: {exc}", file=sys.stderr)
        return 2
    if args.collect_detailed_traces and not args.otlp_traces_endpoint:
        print(
            "pdserve sim: error: collect_detailed_traces requires `--otlp-traces-endpoint` to be set.",
            file=sys.stderr,
        )
        return 2
    ignored = engine_flags.ignored_without_profile(args)
    if ignored:
        print(f"pdserve sim: note: {', '.join(ignored)} change nothing without --profile", file=sys.stderr)
    identity = Identity(
        model=args.model,
        instance_name=args.instance_name or f"sim-{args.host}-{args.port}",
        kv_host=args.kv_host or args.host,
        kv_port=args.kv_port,
        tp_size=args.tp_size,
        max_model_len=args.max_model_len,
    )
    config = SimConfig(
        **flag_values(args, SimFlags, into=SimConfig),
        identity=identity,
        faults=faults,
        api_key=os.environ.get("VLLM_API_KEY") or None,  # as vLLM reads it (never a flag: ps shows flags)
        group=group,
        keep_alive_on_engine_death=os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "") not in ("", "0"),
        engine=engine,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        connector=None if args.kv_connector == AUTO else kv.by_table(args.kv_connector),
    )
    ports = [(args.host, args.port, "--port")]
    if engine is not None and config.role != "decode":  # the pull notices (sim/engine)
        ports.append((identity.kv_host, args.kv_port, "--kv-port"))
    if group.leader and group.rpc_port is not None:
        flag = "--master-port" if args.nnodes > 1 else "--data-parallel-rpc-port"
        ports.append((group.address or args.host, group.rpc_port, flag))
    taken = unavailable(ports)
    if taken:
        print(f"pdserve sim: error: {taken}", file=sys.stderr)
        return 1
    tracer = None
    if args.otlp_traces_endpoint:
        from pdserve.sim.spans import EngineTracer
        from pdserve.tracing.endpoint import EndpointError
        from pdserve.tracing.sdk import TracingUnavailable

        try:
            tracer = EngineTracer.start(args.otlp_traces_endpoint)
        except (TracingUnavailable, EndpointError) as exc:
            print(f"pdserve sim: error: {exc}", file=sys.stderr)
            return 2
    simulator = Simulator(config, tracer)
    try:
        stopped_by = _run_event_loop(serve(simulator, args.host, args.port, args.backlog))
    except OSError as exc:
        where = f"{args.host}:{args.port}"
        if engine is not None and config.role != "decode":
            where += f" or on --kv-host/--kv-port {identity.kv_host}:{args.kv_port} (the pull notices)"
        print(f"pdserve sim: error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    if stopped_by is not None:
        # Stopped cleanly, and said so the Unix way: dying of the signal once everything is closed,
        # so whoever waits for it (pdserve up, the kubelet, a shell) sees a signal, not "exit 0".
        print(f"pdserve sim: stopped by {signal.Signals(stopped_by).name}", flush=True)
        signal.signal(stopped_by, signal.SIG_DFL)
        os.kill(os.getpid(), stopped_by)
    return 0


def _run_event_loop(main: Coroutine[Any, Any, int | None]) -> int | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(main)
    return uvloop.run(main)
