"""What `pdserve up` runs: the operator's own pod and router commands, moved onto loopback.

Local mode does not invent a second way to start engines. It renders the same objects the
operator would (:func:`instance_pod`, :func:`router_deployment`) and changes only what a
single machine needs: the listen address and port of every process, the pod IP (127.0.0.1),
and the interpreter that runs ``pdserve``. So `pdserve up` exercises the arguments a cluster
would get, and a change to the renderer shows up here too.

The routers follow ``spec.router.placement``: with ``deployment`` one router, the router
Deployment's container, on the user's port; with ``decode-sidecar`` one router per decode
instance, the ``router`` container rendered into that decode pod (``--local-decode`` pointed at
its own engine, its pod name and instance index from the downward API resolved against the
rendered pod), each on a port of its own, and the user's port goes to the front
(:mod:`pdserve.local.front`) that stands in for the client Service of the decode pods.

Real vLLM (``--engine vllm``) also needs, on one machine: disjoint GPUs per instance
(``CUDA_VISIBLE_DEVICES``), or on a machine without GPUs (``device="cpu"``) what vLLM's CPU
backend needs (:data:`CPU_ENV`, :data:`CPU_KV_CACHE_BYTES`, :data:`CPU_DTYPE`,
``--enforce-eager``) and a share of the cores per engine and rank (:mod:`pdserve.local.cpus`);
a range of side-channel ports per instance for its KV connector (pdserve.kv: ``LocalRun``); and
``VLLM_HOST_IP`` on loopback. Whatever the
manifest's role ``env`` or ``args`` set is kept: these are defaults, and ``notes`` says which
were applied.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment.render.groups import group_pods
from pdserve.deployment.render.router import router_deployment
from pdserve.deployment.spec.owned import ROUTER_CONTAINER
from pdserve.deployment.spec.pddeployment import PDDeployment, RoleSpec
from pdserve.local.cpus import Cores, assign_cores
from pdserve.routing import Role

LOOPBACK = "127.0.0.1"
ENGINES = ("sim", "vllm")
DEVICES = ("gpu", "cpu")
#: Where the search for each instance's side-channel ports starts (a KV connector may listen on
#: its port plus a rank, as NIXL does): instances are spaced this far apart.
KV_PORT_BASE = 5600
KV_PORTS_PER_INSTANCE = 64

#: vLLM on CPU: environment every engine gets unless the manifest sets the variable.
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu"}
#: KV cache per engine rank on CPU when neither ``--kv-cache-memory-bytes`` nor
#: ``VLLM_CPU_KVCACHE_SPACE`` is set: vLLM's own default takes most of the machine's memory,
#: once per rank.
CPU_KV_CACHE_BYTES = 1 << 30
#: dtype on CPU unless ``--dtype`` is set: vLLM's CPU backend picks bfloat16 for any model, and on
#: a CPU that reports avx512_bf16 inside a VM the decode worker died of SIGILL at its first
#: NIXL-loaded step; float32 works everywhere (at twice the memory of bfloat16).
CPU_DTYPE = "float32"


class PlanError(ValueError):
    """A manifest that local mode cannot run as asked (the message says why and what to do)."""


@dataclass(frozen=True)
class SimTimings:
    """Overrides of the simulator's timings (None keeps its defaults)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tokens: int | None = None
    #: ``pdserve sim --profile``: the step engine (each instance then needs its own --kv-port).
    profile: str | None = None

    def args(self) -> list[str]:
        out: list[str] = ["--profile", self.profile] if self.profile else []
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
    ports: tuple[int, ...] = ()  # every port it listens on (HTTP first); must be free to start it
    cpus: tuple[int, ...] | None = None  # its CPU affinity (and of all it starts); None: any
    #: Its KV connector's side-channel port on this machine (None: the rendered one, as in a pod).
    kv_port: int | None = None
    #: A multi-node instance: the group's name (its leader's), this process's node in it, and
    #: whether it runs an API server (a ``--headless`` one answers no HTTP, so has no /health).
    group: str = ""
    node: int = 0
    serves_http: bool = True

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class RouterProcess:
    name: str  # "router", or "<decode pod name>-router" for a decode sidecar
    port: int
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    instance: str = ""  # decode-sidecar: the decode instance (pod name) it runs next to

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class LocalPlan:
    deployment: PDDeployment  # as run: engine forced to the local choice
    engines: tuple[EngineProcess, ...]
    #: ``deployment`` placement: the one router; ``decode-sidecar``: one per decode instance, in order.
    routers: tuple[RouterProcess, ...]
    port: int  # the user's entry point: the router's port, or with decode-sidecar the front's
    notes: tuple[str, ...] = ()  # what local mode changed or left out, told to the user

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def placement(self) -> str:
        return self.deployment.spec.router.placement

    @property
    def sidecars(self) -> bool:
        """Whether the routers are decode sidecars behind the front (placement decode-sidecar)."""
        return self.deployment.spec.router.decode_sidecar


def engine_process_count(pdd: PDDeployment) -> int:
    """Engine processes of a run: one per instance, or per node of a multi-node instance."""
    return sum(
        pdd.spec.role(r).instances * pdd.spec.group_shape(r).nodes for r in (Role.PREFILL, Role.DECODE)
    )


def group_count(pdd: PDDeployment) -> int:
    """Multi-node instances of a run; each needs an RPC port of its own on this machine."""
    return sum(
        pdd.spec.role(r).instances for r in (Role.PREFILL, Role.DECODE) if pdd.spec.group_shape(r).multi_node
    )


def plan_local_run(
    pdd: PDDeployment,
    engine: str,
    engine_ports: Sequence[int],
    router_port: int,
    routing_file: str,
    sim: SimTimings = SimTimings(),
    python: str = sys.executable,
    device: str = "gpu",
    cores: Sequence[int] = (),
    kv_ports: Sequence[int] | None = None,
    sidecar_ports: Sequence[int] = (),
    rpc_ports: Sequence[int] = (),
) -> LocalPlan:
    """Every process of the run; ``engine_ports`` gives one port per engine process, prefill first
    (:func:`engine_process_count`: one per instance, one per node of a multi-node instance).

    A multi-node instance (``gpusPerNode`` in the manifest) runs one process per node of its group
    with the flags its pods get, the leader on loopback, and ``rpc_ports`` gives each such
    instance its own ``--data-parallel-rpc-port`` (or ``--master-port``), in instance order.

    ``router_port`` is the user's: the router's, or with placement decode-sidecar the front's;
    then ``sidecar_ports`` gives one port per decode instance for its router.
    For ``engine="vllm"``: ``device`` says whether vLLM runs on GPUs or on this machine's
    ``cores``; ``kv_ports`` gives each instance the first of its KV connector's side-channel ports
    (default: 5600 + 64 per instance).
    """
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if device not in DEVICES:
        raise PlanError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    spec = pdd.spec
    roles = [
        (role, index) for role in (Role.PREFILL, Role.DECODE) for index in range(spec.role(role).instances)
    ]
    processes = engine_process_count(pdd)
    if len(engine_ports) != processes:
        raise PlanError(f"need {processes} engine ports, got {len(engine_ports)}")
    multi = [r for r in (Role.PREFILL, Role.DECODE) if spec.group_shape(r).multi_node]
    if multi and engine != "sim":
        raise PlanError(
            f"spec.{multi[0].value}: multi-node instances (gpusPerNode {spec.gpus_per_node_of(multi[0])}) "
            "run locally with --engine sim only (one simulator process per node)"
        )
    if multi and spec.router.decode_sidecar and Role.DECODE in multi:
        raise PlanError("placement decode-sidecar is not supported with multi-node decode instances")
    if len(rpc_ports) != group_count(pdd):
        raise PlanError(
            f"need {group_count(pdd)} group RPC ports (one per multi-node instance), got {len(rpc_ports)}"
        )
    if not spec.prefill.instances or not spec.decode.instances:
        raise PlanError(
            "local mode needs at least one prefill and one decode instance (spec.*.instances >= 1)"
        )
    if spec.router.decode_sidecar and len(sidecar_ports) != spec.decode.instances:
        raise PlanError(
            f"placement decode-sidecar: need {spec.decode.instances} sidecar ports (one per decode "
            f"instance), got {len(sidecar_ports)}"
        )
    notes: list[str] = []
    kv = spec.kv_transfer.kv
    local = kv.render.local
    if engine == "vllm" and local.refused:
        raise PlanError(local.refused)
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

    if kv_ports is not None and len(kv_ports) != len(roles):
        raise PlanError(f"need {len(roles)} KV side-channel ports, got {len(kv_ports)}")
    shares: list[Cores | None] = [None] * len(roles)
    if engine == "vllm" and device == "cpu":
        if not cores:
            raise PlanError("vLLM on CPU needs at least one CPU core to run on")
        workers = [(role, spec.role(role).gpus_per_instance) for role, _ in roles]
        shares = list(assign_cores(cores, workers))

    engines: list[EngineProcess] = []
    pods: list[dict[str, Any]] = []
    next_gpu = 0
    cpu_defaults: set[str] = set()
    ports_left = iter(engine_ports)
    rpc_left = iter(rpc_ports)
    for i, (role, index) in enumerate(roles):
        group = group_pods(run_pdd, role, index, "", LOOPBACK)
        shape = run_spec.group_shape(role)
        rpc = str(next(rpc_left)) if shape.multi_node else None
        for node, pod in enumerate(group):
            port = next(ports_left)
            pods.append(pod)
            container = pod["spec"]["containers"][0]
            env = _local_env(container.get("env", []), pod, notes)
            args = _with_flag(_with_flag(list(container["args"]), "--port", str(port)), "--host", LOOPBACK)
            if rpc is not None:
                flag = "--master-port" if shape.spans_rank else "--data-parallel-rpc-port"
                args = _with_flag(args, flag, rpc)
            ports: tuple[int, ...] = (port,)
            kv_port: int | None = None
            if engine == "sim":
                argv = [python, "-m", "pdserve.cli", "sim", *_expand(args, env), *sim.args()]
                if kv_ports is not None:  # where a prefill's engine hears pull notices
                    kv_port = kv_ports[i] + node
                    argv += ["--kv-port", str(kv_port)]
            else:
                rs = run_spec.role(role)
                kv_port = kv_ports[i] if kv_ports is not None else KV_PORT_BASE + KV_PORTS_PER_INSTANCE * i
                if local.port_env is not None:
                    env[local.port_env] = str(kv_port)
                env.setdefault("VLLM_HOST_IP", LOOPBACK)
                ports += kv.render.local_ports(role, rs.data_parallel, rs.tensor_parallel, kv_port)
                share = shares[i]
                if share is None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(
                        str(g) for g in range(next_gpu, next_gpu + rs.gpus_per_instance)
                    )
                    next_gpu += rs.gpus_per_instance
                else:
                    for name in _rendered_defaults(rs, local.cpu_env):
                        env.pop(name, None)  # the cluster's transport defaults; CPU needs loopback's
                    args = _cpu_defaults(env, args, share, local.cpu_env, cpu_defaults)
                argv = [*container["command"], *_expand(args, env)]
            share = shares[i]
            engines.append(
                EngineProcess(
                    role,
                    index,
                    str(pod["metadata"]["name"]),
                    port,
                    tuple(argv),
                    env,
                    ports,
                    share.affinity if share is not None else None,
                    kv_port,
                    group=str(group[0]["metadata"]["name"]) if shape.multi_node else "",
                    node=node,
                    serves_http=shape.serves_api(node),
                )
            )
    if spec.tracing is not None:
        notes.append(
            f"tracing: the router and every engine send their spans to {spec.tracing.endpoint} "
            f"(services {pdd.name}-router, {pdd.name}-prefill, {pdd.name}-decode; sampling ratio "
            f"{spec.tracing.sampling_ratio:g})"
        )
    if engine == "vllm" and device == "cpu":
        notes.append(_cpu_note(cpu_defaults))
        notes.append(_cores_note(engines, shares, local.prefill_thread, len(set(cores))))

    routers: list[RouterProcess] = []
    if not spec.router.decode_sidecar:
        router_container = router_deployment(run_pdd)["spec"]["template"]["spec"]["containers"][0]
        router_args = _local_router_args(router_container["args"], routing_file, router_port)
        router_pod = {"metadata": {"name": "router", "namespace": pdd.namespace}}
        env = _local_env(router_container.get("env", []), router_pod, notes)
        command = (python, "-m", "pdserve.cli", *_expand(router_args, env))
        routers.append(RouterProcess("router", router_port, command, env))
    else:
        decodes = [(e, pod) for e, pod in zip(engines, pods, strict=True) if e.role is Role.DECODE]
        for (engine_process, pod), port in zip(decodes, sidecar_ports, strict=True):
            sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == ROUTER_CONTAINER)
            env = _local_env(sidecar.get("env", []), pod, notes)
            args = _local_router_args(sidecar["args"], routing_file, port)
            args = _with_flag(args, "--local-decode", engine_process.url)  # its own engine, on loopback
            routers.append(
                RouterProcess(
                    f"{engine_process.name}-{ROUTER_CONTAINER}",
                    port,
                    (python, "-m", "pdserve.cli", *_expand(args, env)),
                    env,
                    engine_process.name,
                )
            )
    return LocalPlan(run_pdd, tuple(engines), tuple(routers), router_port, tuple(dict.fromkeys(notes)))


def _local_router_args(args: Sequence[str], routing_file: str, port: int) -> list[str]:
    """A rendered router container's args on loopback: the table from the file the local runner
    writes (not a ConfigMap watch), and every path on its one port (no Service to keep the admin
    paths from)."""
    out = _without_flag(list(args), "--routing-configmap")
    for flag, value in (("--routing-file", routing_file), ("--host", LOOPBACK), ("--port", str(port))):
        out = _with_flag(out, flag, value)
    return _without_flag(out, "--admin-port")


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


def _rendered_defaults(rs: RoleSpec, cpu_env: Mapping[str, str]) -> list[str]:
    """The connector's transport variables (those its CPU defaults set) that the renderer set for a
    cluster and the manifest does not set itself (in the role's ``env`` or its template's ``engine``
    container)."""
    containers = rs.template.spec.get("containers", [])
    engine_env = [e for c in containers if c.get("name") == "engine" for e in c.get("env", [])]
    own = {e.get("name") for e in [*rs.env, *engine_env]}
    return [name for name in cpu_env if name not in own]


def _cpu_defaults(
    env: dict[str, str], args: list[str], share: Cores, kv_env: Mapping[str, str], applied: set[str]
) -> list[str]:
    """vLLM's CPU needs, where the manifest left them out; ``applied`` collects what was added."""
    defaults = {**CPU_ENV, **kv_env, "VLLM_CPU_OMP_THREADS_BIND": share.omp_bind}
    for name, value in defaults.items():
        if name not in env:
            env[name] = value
            applied.add(name if name == "VLLM_CPU_OMP_THREADS_BIND" else f"{name}={value}")
    out = list(args)
    if not _has_flag(out, "--enforce-eager", "--compilation-config", "-O", "--optimization-level"):
        out.append("--enforce-eager")
        applied.add("--enforce-eager")
    if not _has_flag(out, "--dtype"):
        out += ["--dtype", CPU_DTYPE]
        applied.add(f"--dtype {CPU_DTYPE}")
    if not _has_flag(out, "--kv-cache-memory-bytes") and "VLLM_CPU_KVCACHE_SPACE" not in env:
        out += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
        applied.add(f"--kv-cache-memory-bytes {CPU_KV_CACHE_BYTES}")
    return out


def _has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(
        a == f or a.startswith(f + "=") or (f == "-O" and a.startswith("-O")) for a in args for f in flags
    )


def _cpu_note(applied: set[str]) -> str:
    added = ", ".join(sorted(applied)) or "nothing (the manifest sets it all)"
    return f"vLLM on CPU (no GPU): engine defaults applied where the manifest sets none: {added}"


def _cores_note(
    engines: Sequence[EngineProcess], shares: Sequence[Cores | None], prefill_thread: str, total: int
) -> str:
    parts = []
    for engine, share in zip(engines, shares, strict=True):
        if share is None:
            continue
        bind = engine.env.get("VLLM_CPU_OMP_THREADS_BIND", share.omp_bind)
        where = (
            f"cores {','.join(map(str, share.affinity))}"
            if len(share.affinity) > 1
            else f"core {share.affinity[0]}"
        )
        extra = f" with {prefill_thread}" if prefill_thread and engine.role is Role.PREFILL else ""
        parts.append(f"{engine.name} on {where}{extra} (VLLM_CPU_OMP_THREADS_BIND={bind})")
    return f"CPU cores ({total}): " + "; ".join(parts)


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


def _local_env(env: Sequence[Mapping[str, Any]], pod: Mapping[str, Any], notes: list[str]) -> dict[str, str]:
    """The container's environment on this machine: the downward API read from the rendered
    ``pod`` (its name, namespace, labels and annotations), and the pod IP is loopback; a value's
    ``$(VAR)`` names a variable set before it, as Kubernetes expands it."""
    out: dict[str, str] = {}
    for var in env:
        name = str(var["name"])
        value = var.get("value")
        if value is not None:
            value = _VAR_REF.sub(lambda m: out.get(m.group(1), m.group(0)), str(value))
        else:
            value = _field_ref(pod, str(var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")))
        if value is not None:
            out[name] = str(value)
        else:
            notes.append(f"environment variable {name} comes from the cluster (valueFrom); not set locally")
    return out


_MAP_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _field_ref(pod: Mapping[str, Any], path: str) -> str | None:
    """A downward-API ``fieldPath`` of the rendered pod on this machine (None: only a cluster knows)."""
    if path == "status.podIP":
        return LOOPBACK
    meta = pod.get("metadata") or {}
    if path in ("metadata.name", "metadata.namespace"):
        value = meta.get(path.split(".")[1])
        return None if value is None else str(value)
    match = _MAP_KEY.match(path)
    if match:
        value = (meta.get(match.group(1)) or {}).get(match.group(2))
        return None if value is None else str(value)
    return None


_VAR_REF = re.compile(r"\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def _expand(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of container args; unknown references stay as written."""
    return [_VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]
