"""An engine pod: vLLM (or the simulator) serving one instance of a role, and how to read one back.

:func:`pod_spec` renders the spec of every engine pod: the one pod of a single-node instance
(:func:`instance_pod`), and each pod or LeaderWorkerSet template of a multi-node group
(groups.py, with the group's flags from groupflags.py). :func:`template_hash` hashes that same
rendering, so it changes exactly when a pod would. The readers (:func:`engine_argv`,
:func:`pod_parallel_sizes`, :func:`instance_pod_revision`) tell what an existing pod runs.

Choices the issue left open: engine ``sim`` requests no GPUs (the issue's "no GPUs", so demos
run on kind; kwok tests that check GPU requests use engine ``vllm``, which kwok never runs);
``enableServiceLinks`` is off, because a Service named ``vllm`` would inject ``VLLM_PORT`` and
break vLLM's startup.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Mapping
from typing import Any

from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.render.decode_sidecar import add_sidecar
from pdserve.deployment.render.defaults import (
    ENGINE_PRESTOP_SECONDS,
    ENGINE_TERMINATION_GRACE_SECONDS,
    STARTUP_PERIOD_SECONDS,
    default_requests,
    engine_security_context,
    startup_failure_threshold,
    with_default_requests,
)
from pdserve.deployment.render.groupflags import (
    GroupMember,
    group_flags,
)
from pdserve.deployment.render.names import (
    DP_SIZE_ANNOTATION,
    GROUP_LABEL,
    GROUP_NODE_LABEL,
    GROUP_SIZE_ANNOTATION,
    INSTANCE_LABEL,
    REVISION_ANNOTATION,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
    TIER_LABEL,
    TP_SIZE_ANNOTATION,
    engine_service_name,
    instance_hostname,
    instance_name,
    object_metadata,
    router_account_name,
    routing_configmap_name,
)
from pdserve.deployment.render.security import engine_key_env
from pdserve.deployment.render.tracing import engine_tracing_args, engine_tracing_env
from pdserve.deployment.spec.multinode import GroupShape
from pdserve.deployment.spec.owned import ENGINE_ENV_OWNED
from pdserve.deployment.spec.pddeployment import (
    ENGINE_PORT,
    PDDeployment,
    RoleSpec,
)
from pdserve.deployment.spec.podtemplate import merge_metadata, merge_pod_spec
from pdserve.deployment.spec.storage import model_argument, storage_env, storage_mounts, storage_volumes
from pdserve.kv.base import PodKV, transfer_config
from pdserve.routing import Role

SHM_MOUNT = "/dev/shm"

# Probes. The startup probe allows startupTimeoutSeconds of model loading (defaults.py) before
# the liveness probe may restart the pod; the simulator starts in well under a second.
_SIM_STARTUP = {"periodSeconds": 1, "failureThreshold": 120}


def instance_pod(pdd: PDDeployment, role: Role, index: int, suffix: str = "") -> dict[str, Any]:
    """The one pod of a single-node instance (a multi-node role's are groups.group_pods)."""
    name = instance_name(pdd, role, index, suffix)
    meta = pod_metadata(pdd, role, index, name)
    spec = pod_spec(pdd, role, name, instance_hostname(role, index, suffix))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def pod_metadata(
    pdd: PDDeployment, role: Role, index: int, name: str, group: tuple[str, int | None, int] | None = None
) -> dict[str, Any]:
    """An engine pod's metadata; ``group`` is (group name, node index or None, group size)."""
    meta = object_metadata(pdd, name, role.value)
    meta["labels"].update(
        {
            ROLE_LABEL: role.value,
            INSTANCE_LABEL: str(index),
            TEMPLATE_HASH_LABEL: template_hash(pdd, role),
            TIER_LABEL: "engine",
        }
    )
    rs = pdd.spec.role(role)
    meta["annotations"] = {
        DP_SIZE_ANNOTATION: str(rs.data_parallel),
        TP_SIZE_ANNOTATION: str(rs.tensor_parallel),
        REVISION_ANNOTATION: pairing_revision(pdd, role),
    }
    if group is not None:
        group_name, node, size = group
        meta["labels"][GROUP_LABEL] = group_name
        if node is not None:
            meta["labels"][GROUP_NODE_LABEL] = str(node)
        meta["annotations"][GROUP_SIZE_ANNOTATION] = str(size)
    return merge_metadata(meta, rs.template)


def engine_argv(pod: Mapping[str, Any]) -> list[str]:
    """The engine container's arguments, the words of its ``sh -c`` line when it runs through a
    shell (a LeaderWorkerSet's worker template computes its start rank there)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    engine: Mapping[str, Any] = next((c for c in containers if c.get("name") == "engine"), {})
    argv = [str(a) for a in engine.get("args") or []]
    if [str(c) for c in engine.get("command") or []][-1:] == ["-c"] and argv:
        return shlex.split(argv[0])
    return argv


def pod_parallel_sizes(pod: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(dataParallel, tensorParallel) that an instance pod runs; None where it cannot be told.

    The annotations first; for pods created before they existed, the engine's own flags
    (``--data-parallel-size``/``--tensor-parallel-size`` for vLLM, ``--dp-size``/``--tp-size``
    for the simulator), which is what the process was started with.
    """
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    argv = engine_argv(pod)

    def size(annotation: str, flags: tuple[str, ...]) -> int | None:
        candidates = [annotations.get(annotation)]
        candidates += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags]
        for value in candidates:
            try:
                number = int(str(value))
            except ValueError:
                continue
            if number >= 1:
                return number
        return None

    return (
        size(DP_SIZE_ANNOTATION, ("--data-parallel-size", "--dp-size")),
        size(TP_SIZE_ANNOTATION, ("--tensor-parallel-size", "--tp-size")),
    )


def instance_pod_revision(pod: Mapping[str, Any]) -> str | None:
    """The pairing revision an instance pod runs; None for pods created before revisions."""
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(REVISION_ANNOTATION)
    return value if isinstance(value, str) and value else None


def template_hash(pdd: PDDeployment, role: Role) -> str:
    """Short hash of everything that defines an instance pod of ``role``.

    It hashes the rendered pod spec itself (with a placeholder for the instance name), so it
    changes exactly when a pod would come out different: image, args, env, resources, DP/TP,
    connector, and pdserve's own rendering. The instance count is not part of a pod.
    """
    spec: dict[str, Any] = pod_spec(pdd, role, "{instance}", "{instance}")
    shape = pdd.spec.group_shape(role)
    if shape.multi_node:  # a group: its leader's and a worker's pod, and how they are created
        rpc = pdd.spec.multi_node.rpc_port
        worker = pod_spec(pdd, role, "{instance}", "{instance}", GroupMember(shape, 1, rpc, "{leader}"))
        leader = pod_spec(pdd, role, "{instance}", "{instance}", GroupMember(shape, 0, rpc, "{leader}"))
        spec = {"leader": leader, "worker": worker, "backend": pdd.spec.multi_node.backend}
    template_metadata = pdd.spec.role(role).template.metadata
    if template_metadata:  # labels and annotations of a template are part of the pod too
        spec = {"spec": spec, "metadata": template_metadata}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return digest[:10]


def pod_spec(
    pdd: PDDeployment, role: Role, pod_name: str, hostname: str, member: GroupMember | None = None
) -> dict[str, Any]:
    """An engine pod's spec; ``member`` is its place in a multi-node group (None: the whole instance)."""
    spec = pdd.spec
    rs = spec.role(role)
    sim = spec.engine == "sim"
    flags = group_flags(member) if member is not None else []
    shape = member.shape if member is not None else None
    gpus = shape.gpus_per_pod if shape is not None else rs.gpus_per_instance
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine_image,
        "command": ["pdserve", "sim"] if sim else ["vllm", "serve"],
        "args": (_sim_args(pdd, role, pod_name, flags) if sim else _vllm_args(pdd, role, pod_name, flags))
        + engine_tracing_args(spec)
        + list(rs.args),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _engine_env(pdd) + engine_tracing_env(pdd, role) + [_plain(v) for v in rs.env],
        "resources": _engine_resources(spec.gpu_resource, rs, gpus if not sim else None),
        "volumeMounts": [{"name": "dshm", "mountPath": SHM_MOUNT}],
        "startupProbe": {
            "httpGet": _health(),
            **(_SIM_STARTUP if sim else _vllm_startup(rs)),
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": _health(),
            "periodSeconds": 2 if sim else 5,
            "failureThreshold": 3,
            "timeoutSeconds": 2 if sim else 5,
        },
        "livenessProbe": {
            "httpGet": _health(),
            "periodSeconds": 10,
            "failureThreshold": 6,
            "timeoutSeconds": 5,
        },
        # Out of every router's table before SIGTERM (defaults.ENGINE_PRESTOP_SECONDS).
        "lifecycle": {"preStop": {"sleep": {"seconds": ENGINE_PRESTOP_SECONDS}}},
    }
    if member is not None and member.headless:  # vLLM --headless serves no HTTP: nothing to probe
        container["ports"] = []
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            del container[probe]
    pod: dict[str, Any] = {
        "hostname": hostname,
        "subdomain": engine_service_name(pdd),
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # an engine never calls the API (defaults.py)
        "terminationGracePeriodSeconds": ENGINE_TERMINATION_GRACE_SECONDS,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": rs.shm_size}}],
    }
    if rs.node_selector:
        pod["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod["tolerations"] = [_plain(t) for t in rs.tolerations]
    if rs.affinity:
        pod["affinity"] = _plain(rs.affinity)
    if not sim:  # the model's storage and the KV connector's needs; the simulator has neither
        container["volumeMounts"] += storage_mounts(spec.model, spec.model_cache)
        pod["volumes"] += storage_volumes(spec.model, spec.model_cache)
        kv = _kv_settings(pdd, role, member)
        container["ports"] += kv.ports
        container["env"] = _last_wins(kv.env + container["env"])  # the role's env overrides defaults
        if kv.capabilities:
            container["securityContext"] = {"capabilities": {"add": list(kv.capabilities)}}
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            **container.get("securityContext", {}),
        }
    else:
        pod["securityContext"] = engine_security_context(sim)
    if role is Role.DECODE and spec.router.decode_sidecar:  # the router in the pod (decode_sidecar.py)
        revision = pairing_revision(pdd, role)
        add_sidecar(pod, pdd, routing_configmap_name(pdd), router_account_name(pdd), revision)
    merged = merge_pod_spec(pod, rs.template.spec)
    engine = next(c for c in merged["containers"] if c["name"] == "engine")
    with_default_requests(engine, default_requests(gpus, sim))
    if not engine["ports"]:
        del engine["ports"]
    return merged


def _kv_settings(pdd: PDDeployment, role: Role, member: GroupMember | None) -> PodKV:
    """The connector's pod settings for the ranks this pod runs, from the first global rank it runs."""
    rs = pdd.spec.role(role)
    kv = pdd.spec.kv_transfer
    if member is None:
        return kv.kv.render.pod(kv.extra_config, role, rs.data_parallel, rs.tensor_parallel)
    shape: GroupShape = member.shape
    first = 0 if shape.spans_rank else shape.first_rank(member.node)
    return kv.kv.render.pod(kv.extra_config, role, shape.dp_local, rs.tensor_parallel, first)


def _vllm_startup(rs: RoleSpec) -> dict[str, Any]:
    return {
        "periodSeconds": STARTUP_PERIOD_SECONDS,
        "failureThreshold": startup_failure_threshold(rs.startup_timeout_seconds),
    }


def _last_wins(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per variable name, the last given, in order of first appearance."""
    last = {var["name"]: var for var in env}
    seen: list[str] = []
    for var in env:
        if var["name"] not in seen:
            seen.append(var["name"])
    return [last[name] for name in seen]


def _health() -> dict[str, Any]:
    return {"path": "/health", "port": "http"}


def _vllm_args(pdd: PDDeployment, role: Role, instance: str, group: list[str]) -> list[str]:
    spec = pdd.spec
    rs = spec.role(role)
    args = [
        model_argument(spec.model),
        "--served-model-name",
        spec.served_model_name,
        "--port",
        str(ENGINE_PORT),
        "--data-parallel-size",
        str(rs.data_parallel),
        "--tensor-parallel-size",
        str(rs.tensor_parallel),
    ]
    if rs.pipeline_parallel > 1:
        args += ["--pipeline-parallel-size", str(rs.pipeline_parallel)]
    args += group
    if rs.expert_parallel:
        args.append("--enable-expert-parallel")
    return [*args, "--kv-transfer-config", kv_transfer_json(pdd, role, instance)]


def kv_transfer_json(pdd: PDDeployment, role: Role, instance: str) -> str:
    """``--kv-transfer-config`` of an instance, as compact JSON in the connector's key order: equal
    specs give byte-equal pod args (and template hashes)."""
    kv = pdd.spec.kv_transfer
    config = transfer_config(kv.kv, kv.transfer_mode, kv.extra_config, role, instance, ENGINE_PORT)
    return json.dumps(config, separators=(",", ":"))


def _sim_args(pdd: PDDeployment, role: Role, pod_name: str, group: list[str]) -> list[str]:
    rs = pdd.spec.role(role)
    return [
        "--role",
        role.value,
        "--dp-size",
        str(rs.data_parallel),
        "--tp-size",
        str(rs.tensor_parallel),
        *group,
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--model",
        pdd.spec.served_model_name,
        "--instance-name",
        pod_name,
        "--kv-host",
        "$(POD_IP)",
    ]


def _engine_env(pdd: PDDeployment) -> list[dict[str, Any]]:
    """The pod IP, and the connector's advertised host set to it (vLLM would guess otherwise)."""

    def pod_ip(name: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}

    env = [pod_ip("POD_IP")]
    env += [pod_ip(name) for name in pdd.spec.kv_transfer.kv.render.pod_ip_env]
    if pdd.spec.engine != "sim":
        env += storage_env(pdd.spec.model, pdd.spec.model_cache, pdd.spec.hf_token_secret_ref)
    return env + engine_key_env(pdd.spec)  # the simulator checks VLLM_API_KEY like vLLM


#: Names of the environment variables the renderer sets on engine pods (validate.py refuses them).
OWNED_ENV = ENGINE_ENV_OWNED.names


def _engine_resources(gpu_resource: str, rs: RoleSpec, gpus: int | None) -> dict[str, Any]:
    """The role's resources plus ``gpus`` of ``gpu_resource`` (None: the simulator, no GPUs)."""
    resources = _plain(rs.resources)
    if gpus is not None:
        count = str(gpus)
        for section in ("requests", "limits"):
            resources.setdefault(section, {})[gpu_resource] = count
    return dict(resources)


def _plain(value: Any) -> Any:
    return copy.deepcopy(dict(value)) if isinstance(value, Mapping) else copy.deepcopy(value)
