"""Run a PDDeployment on this machine, without Kubernetes.

Starts one engine process per instance with the instance's data-parallel size (simulated
by `pdserve sim` by default; real `vllm serve` with --engine vllm), builds the routing
table from each engine's health with the operator's own code, and serves the router on
http://127.0.0.1:PORT. The view shows, per slot (instance and DP rank), the requests the
router sent, those in flight, and errors. Ctrl-C or SIGTERM stops every process.

With spec.router.placement: decode-sidecar it runs one router per decode instance, as the
decode pods would (each sends its decode legs to its own engine), and PORT spreads requests
over them in turn, as the decode pods' Service would; the X-PDServe-Sidecar header of every
answer names the decode instance whose sidecar served it.

A manifest the operator would refuse is refused here too, with the field and the reason,
before anything starts (exit code 2); so is a missing or too old vLLM with --engine vllm, or a
--port already in use. Ctrl-C (or SIGTERM) stops every process it started and says what it
stopped; an engine that exits on its own is restarted, and the message says how it ended
(an exit code, or the signal that stopped it).

With --engine vllm on a machine without GPUs (--device auto), the engines run on vLLM's CPU
backend: each engine gets a share of the cores (decode ranks apart from the prefill's, and from
what its KV connector runs there, such as NIXL's progress thread), --enforce-eager and a KV cache
size unless the manifest sets them, and the connector's environment for loopback; the first
lines of output say what was applied.

Environment: every engine and router gets this process's environment (PATH finds `vllm`;
HF_HOME, HF_TOKEN, HF_HUB_OFFLINE reach vLLM), plus the manifest's env and what local mode
sets (the first lines of output name it). pdserve up reads none of its own.

With --otlp-traces-endpoint URL (or spec.tracing in the manifest) the router and every engine
send their spans there, so one request is one trace across the router, the prefill and the
decode (docs/operations.md#tracing).

Example:
  pdserve up examples/nixl/2p-dp8ep-3d-dp8ep.yaml
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "deepseek-r1", "prompt": "Hello", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdserve.argtypes import port
from pdserve.deployment.plan.autoscale import ROLES
from pdserve.deployment.plan.scaling import with_counts
from pdserve.deployment.spec.parse import SpecError, load_manifest_file
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.spec.tracing import with_endpoint
from pdserve.deployment.validate import problems
from pdserve.local.plan import (
    ENGINES,
    KV_PORTS_PER_INSTANCE,
    LOOPBACK,
    PlanError,
    SimTimings,
    engine_process_count,
    group_count,
    plan_local_run,
)
from pdserve.local.proctree import port_free
from pdserve.local.report import Reporter, describe_table
from pdserve.local.runner import LocalRunner
from pdserve.local.scaler import LocalScaler
from pdserve.local.view import LiveView, SummaryLines
from pdserve.local.vllm_env import find_vllm, gpus_present
from pdserve.local.vllm_env import problems as vllm_problems
from pdserve.routing import Role, RoutingTable

EXIT_REFUSED = 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a YAML file holding one PDDeployment")
    parser.add_argument(
        "--port",
        type=port,
        default=8000,
        help="the port clients use on 127.0.0.1: the router's, or with placement decode-sidecar the one "
        "that spreads requests over the sidecars (default: 8000)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help="sim: simulated engines, no GPU or model (default); vllm: real `vllm serve` processes "
        "with the arguments the operator renders (needs the `vllm` command: vLLM on GPUs, or its CPU "
        "build on a machine without, see --device)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="with --engine vllm: gpu gives each instance its own GPUs (CUDA_VISIBLE_DEVICES); cpu runs "
        "vLLM's CPU backend and spreads this machine's cores over the engines; auto (default): cpu "
        "for a CPU build of vLLM or a machine without GPU devices",
    )
    parser.add_argument(
        "--no-view",
        action="store_true",
        help="no live view: print events as lines (the default when not a TTY)",
    )
    parser.add_argument(
        "--sim-ttft-ms",
        type=float,
        default=None,
        help="simulated time to first token, ms (default: pdserve sim's --ttft-ms)",
    )
    parser.add_argument(
        "--sim-itl-ms",
        type=float,
        default=None,
        help="simulated inter-token latency, ms (default: pdserve sim's --itl-ms)",
    )
    parser.add_argument(
        "--sim-tokens",
        type=int,
        default=None,
        help="simulated tokens per request (default: pdserve sim's --tokens)",
    )
    parser.add_argument(
        "--sim-profile",
        default=None,
        metavar="FILE|NAME",
        help="simulated engines time their answers with a step engine and this performance profile "
        "(`pdserve sim --profile`, docs/simulator.md)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="trace every request: the router and every engine send their spans to this OTLP receiver "
        "(http://HOST:4318/v1/traces or grpc://HOST:4317), as spec.tracing.endpoint would, which it "
        "replaces; the manifest's samplingRatio and collectDetailedTraces still apply",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where the processes' logs and the routing file go (default: a temporary directory, "
        "removed after a clean stop and kept after a failure)",
    )


def run(
    args: argparse.Namespace, scaler_of: Callable[[PDDeployment], LocalScaler | None] = LocalScaler.of
) -> int:
    """``scaler_of``: what decides the counts with spec.autoscaling (the operator's decision; the
    autoscaling bench passes another policy to compare with it)."""
    # Everything that can be refused is checked before the first process starts.
    try:
        pdd = load_manifest_file(args.file)
    except SpecError as exc:
        return _refuse(f"{args.file}: invalid PDDeployment: {exc}" if exc.path != args.file else str(exc))
    if args.otlp_traces_endpoint is not None:
        try:
            tracing = with_endpoint(pdd.spec.tracing, args.otlp_traces_endpoint)
        except SpecError as exc:
            return _refuse(str(exc))
        pdd = dataclasses.replace(pdd, spec=dataclasses.replace(pdd.spec, tracing=tracing))
    found = problems(pdd, None)
    if found:
        return _refuse(f"{args.file}: invalid PDDeployment: " + "; ".join(found))
    scaler = scaler_of(pdd)
    if scaler is not None:
        if args.engine != "sim":
            return _refuse(
                "spec.autoscaling runs locally with --engine sim only (it starts and stops simulator "
                "instances); remove spec.autoscaling to run vLLM, or run it on a cluster"
            )
        # every instance the autoscaler may want is planned (its ports reserved); it runs some
        pdd = with_counts(pdd, {role: scaler.spec.bounds(role).max_instances for role in ROLES})
    device = "gpu"
    if args.engine == "vllm":
        install = find_vllm()
        found = vllm_problems(install, pdd.spec.kv_transfer.kv)
        if found:
            return _refuse("; ".join(found))
        assert install is not None
        device = args.device
        if device == "auto":
            device = "cpu" if install.cpu_build or not gpus_present() else "gpu"
    if not port_free(args.port, LOOPBACK):
        return _refuse(
            f"port {args.port} on {LOOPBACK} is already in use (another `pdserve up`?); pick one with --port"
        )

    keep_logs = args.log_dir is not None
    log_dir = Path(args.log_dir) if keep_logs else Path(tempfile.mkdtemp(prefix=f"pdserve-up-{pdd.name}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    routing_file = log_dir / "routing.json"
    processes = engine_process_count(pdd)
    groups = group_count(pdd)
    sidecars = pdd.spec.decode.instances if pdd.spec.router.decode_sidecar else 0
    try:
        kv_ports = None
        if args.engine == "vllm" or args.sim_profile:
            render = pdd.spec.kv_transfer.kv.render
            sizes = [  # the connector's ports, and one per node for a simulated group's listeners
                max(
                    len(render.local_ports(role, rs.data_parallel, rs.tensor_parallel, 0)),
                    pdd.spec.group_shape(role).nodes,
                )
                for role in (Role.PREFILL, Role.DECODE)
                for rs in [pdd.spec.role(role)] * pdd.spec.role(role).instances
            ]
            kv_ports = _free_port_ranges(sizes)
        ports = _free_ports(processes + sidecars + groups, exclude={args.port})
        plan = plan_local_run(
            pdd,
            args.engine,
            ports[:processes],
            args.port,
            str(routing_file),
            SimTimings(args.sim_ttft_ms, args.sim_itl_ms, args.sim_tokens, args.sim_profile),
            device=device,
            cores=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0],
            kv_ports=kv_ports,
            sidecar_ports=ports[processes : processes + sidecars],
            rpc_ports=ports[processes + sidecars :],
        )
    except PlanError as exc:
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        return _refuse(str(exc))

    live = not args.no_view and sys.stdout.isatty()
    reporter: Reporter = LiveView() if live else SummaryLines() if not args.no_view else Reporter()
    for note in plan.notes:
        reporter.event(note)

    def announce(table: RoutingTable) -> None:
        model = pdd.spec.served_model_name
        reporter.event(
            f"{pdd.name} is serving on {plan.url} (placement {plan.placement}; {describe_table(table)})"
        )
        if not live:
            flags = "i" if plan.sidecars else ""  # -i shows X-PDServe-Sidecar
            print(
                f"  try: curl -s{flags} {plan.url}/v1/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 8}}\'',
                flush=True,
            )

    runner = LocalRunner(plan, routing_file, log_dir, reporter=reporter, on_ready=announce, scaler=scaler)
    code = asyncio.run(_run_with_view(runner, reporter))
    if code == 0 and not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif code != 0:
        print(f"pdserve up: logs kept in {log_dir}", file=sys.stderr)
    return code


async def _run_with_view(runner: LocalRunner, reporter: Reporter) -> int:
    view_task = None
    if isinstance(reporter, LiveView | SummaryLines):
        view_task = asyncio.create_task(reporter.run(runner.plan.url, runner.stopping))
    try:
        return await runner.run()
    finally:
        if view_task is not None:
            runner.stopping.set()
            await view_task
        if runner.stop_report:
            with contextlib.suppress(OSError):  # stdout may be gone (a closed pipe)
                reporter.final(runner.stop_report)


def _refuse(message: str) -> int:
    print(f"pdserve up: error: {message}", file=sys.stderr)
    print("pdserve up: nothing was started", file=sys.stderr)
    return EXIT_REFUSED


def _free_port_ranges(sizes: list[int], first: int | None = None) -> list[int]:
    """For each size, the first port of a range of that many free ports (a KV connector's side
    channel may listen on its port + DP rank), ranges disjoint, searched upwards from ``first``.

    By default the search starts at a random multiple of 64 between 10000 and 30000 (below the
    kernel's ephemeral ports), not at vLLM's default ports: a real vLLM binds its side channel a
    minute after the plan found the range free, and another run on the machine (two `pdserve up`,
    or a test's) must not be handed the same range meanwhile."""
    starts: list[int] = []
    port = first if first is not None else random.randrange(10000, 30000, KV_PORTS_PER_INSTANCE)
    for size in sizes:
        while not all(port_free(p, LOOPBACK) for p in range(port, port + size)):
            port += size
            if port + size > 65535:
                raise PlanError("no free range of ports for the KV connector's side channel")
        starts.append(port)
        port += max(size, KV_PORTS_PER_INSTANCE)
    return starts


def _free_ports(count: int, exclude: set[int]) -> list[int]:
    """Distinct free loopback ports (held open together so the kernel cannot hand one out twice)."""
    sockets: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((LOOPBACK, 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()
