"""What `pdserve up` runs: the operator's own pod and router commands, moved onto loopback.

Local mode does not invent a second way to start engines. It renders the same objects the
operator would (:func:`instance_pod`, :func:`router_deployment`) and changes only what a
single machine needs: the listen address and port of every process, the pod IP (127.0.0.1),
and the interpreter that runs ``pdserve``. So `pdserve up` exercises the arguments a cluster
would get, and a change to the renderer shows up here too.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.deployment.kvconfig import MORIIO
from pdserve.deployment.objects import instance_pod, router_deployment
from pdserve.deployment.spec import PDDeployment
from pdserve.routing import Role

LOOPBACK = "127.0.0.1"
ENGINES = ("sim", "vllm")
#: NIXL's side channel listens on VLLM_NIXL_SIDE_CHANNEL_PORT + rank; space instances apart.
NIXL_SIDE_CHANNEL_BASE = 5600
NIXL_PORTS_PER_INSTANCE = 64


class PlanError(ValueError):
    """A manifest that local mode cannot run as asked (the message says why and what to do)."""


@dataclass(frozen=True)
class SimTimings:
    """Overrides of the simulator's timings (None keeps its defaults)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tokens: int | None = None

    def args(self) -> list[str]:
        out: list[str] = []
        for flag, value in (
            ("--ttft-ms", self.ttft_ms),
            ("--itl-ms", self.itl_ms),
            ("--tokens", self.tokens),
        ):
            if value is not None:
                out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return out


@dataclass(frozen=True)
class EngineProcess:
    role: Role
    index: int
    name: str  # the pod name the operator would give it
    port: int
    argv: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class RouterProcess:
    port: int
    argv: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class LocalPlan:
    deployment: PDDeployment  # as run: engine forced to the local choice
    engines: tuple[EngineProcess, ...]
    router: RouterProcess
    notes: tuple[str, ...] = ()  # what local mode changed or left out, told to the user


def plan_local_run(
    pdd: PDDeployment,
    engine: str,
    engine_ports: Sequence[int],
    router_port: int,
    routing_file: str,
    sim: SimTimings = SimTimings(),
    python: str = sys.executable,
) -> LocalPlan:
    """Every process of the run; ``engine_ports`` gives one port per instance, prefill first."""
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    spec = pdd.spec
    roles = [
        (role, index) for role in (Role.PREFILL, Role.DECODE) for index in range(spec.role(role).instances)
    ]
    if len(engine_ports) != len(roles):
        raise PlanError(f"need {len(roles)} engine ports, got {len(engine_ports)}")
    if not spec.prefill.instances or not spec.decode.instances:
        raise PlanError(
            "local mode needs at least one prefill and one decode instance (spec.*.instances >= 1)"
        )
    notes: list[str] = []
    if engine == "vllm" and spec.kv_transfer.connector == MORIIO:
        raise PlanError(
            "MoRIIOConnector uses fixed handshake/notify ports, so two vLLM instances cannot share one "
            "machine; run MoRIIO manifests locally with --engine sim, or on a cluster"
        )
    run_spec = dataclasses.replace(spec, engine=engine)
    if engine == "sim" and spec.engine != "sim":
        # The role's args are vLLM flags the simulator does not take.
        dropped = [r.value for r in (Role.PREFILL, Role.DECODE) if spec.role(r).args]
        run_spec = dataclasses.replace(
            run_spec,
            prefill=dataclasses.replace(run_spec.prefill, args=()),
            decode=dataclasses.replace(run_spec.decode, args=()),
        )
        if dropped:
            notes.append(f"simulated engines: ignoring the vLLM args of {', '.join(dropped)}")
    run_pdd = dataclasses.replace(pdd, spec=run_spec)

    engines: list[EngineProcess] = []
    next_gpu = 0
    for (role, index), port in zip(roles, engine_ports, strict=True):
        pod = instance_pod(run_pdd, role, index)
        container = pod["spec"]["containers"][0]
        env = _local_env(container.get("env", []), notes)
        args = _with_flag(_with_flag(list(container["args"]), "--port", str(port)), "--host", LOOPBACK)
        if engine == "sim":
            argv = [python, "-m", "pdserve.cli", "sim", *_expand(args, env), *sim.args()]
        else:
            gpus = run_spec.role(role).gpus_per_instance
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(next_gpu, next_gpu + gpus))
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(
                NIXL_SIDE_CHANNEL_BASE + NIXL_PORTS_PER_INSTANCE * len(engines)
            )
            next_gpu += gpus
            argv = [*container["command"], *_expand(args, env)]
        engines.append(EngineProcess(role, index, str(pod["metadata"]["name"]), port, tuple(argv), env))

    router_container = router_deployment(run_pdd)["spec"]["template"]["spec"]["containers"][0]
    router_args = list(router_container["args"])
    for flag, value in (("--routing-file", routing_file), ("--host", LOOPBACK), ("--port", str(router_port))):
        router_args = _with_flag(router_args, flag, value)
    # One router on loopback serves every path on its one port (no Service to keep admin paths from).
    router_args = _without_flag(router_args, "--admin-port")
    router = RouterProcess(router_port, (python, "-m", "pdserve.cli", *router_args))
    return LocalPlan(run_pdd, tuple(engines), router, tuple(dict.fromkeys(notes)))


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (``--flag v`` or ``--flag=v``)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (both ``--flag v`` and ``--flag=v``), or appended."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return [*out, flag, value]


def _local_env(env: Sequence[Mapping[str, Any]], notes: list[str]) -> dict[str, str]:
    """The container's environment on this machine: the pod IP is loopback."""
    out: dict[str, str] = {}
    for var in env:
        name = str(var["name"])
        if "value" in var:
            out[name] = str(var["value"])
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            out[name] = LOOPBACK
        else:
            notes.append(f"environment variable {name} comes from the cluster (valueFrom); not set locally")
    return out


_VAR_REF = re.compile(r"\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def _expand(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of container args; unknown references stay as written."""
    return [_VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]
