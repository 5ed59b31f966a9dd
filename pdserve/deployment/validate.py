"""Rules the CRD schema cannot express; the operator reports them as ``Degraded`` and renders nothing.

:func:`problems` is pure: the operator passes the allocatable GPU count of ``gpuResource`` on
each node (or None when it could not list nodes, and that check is skipped). Each message names
the field and says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pdserve.deployment.render.decode_sidecar import template_problems
from pdserve.deployment.render.engine_pod import OWNED_ENV
from pdserve.deployment.render.groupflags import GROUP_FLAGS
from pdserve.deployment.render.security import engine_reserved_env, router_reserved
from pdserve.deployment.render.tracing import ENGINE_FLAGS as TRACING_ENGINE_FLAGS
from pdserve.deployment.spec.multinode import group_shape, uniform_gpus_per_node
from pdserve.deployment.spec.owned import ENGINE_CONTAINER, ROUTER_CONTAINER, Reserved, owned_problems
from pdserve.deployment.spec.pddeployment import ENGINE_PORT, PDDeployment, PDDeploymentSpec
from pdserve.deployment.spec.readers import SpecError
from pdserve.deployment.spec.storage import reserved as storage_reserved
from pdserve.deployment.spec.vllm_compat import problems as vllm_problems
from pdserve.kv import owned_env
from pdserve.routing import Role

#: Flags of ``vllm serve`` that pdserve sets itself; a second copy in ``args`` would silently
#: win in vLLM's argument parser and desynchronise the routing table (ranks, ports, roles).
VLLM_OWNED_FLAGS = {
    "--port": f"engines listen on {ENGINE_PORT}",
    "--served-model-name": "set spec.servedModelName",
    "--data-parallel-size": "set dataParallel",
    "-dp": "set dataParallel",
    "--tensor-parallel-size": "set tensorParallel",
    "-tp": "set tensorParallel",
    "--enable-expert-parallel": "set expertParallel",
    "--pipeline-parallel-size": "set pipelineParallel",
    "-pp": "set pipelineParallel",
    **{
        flag: "set by pdserve for the pods of a multi-node instance (gpusPerNode, spec.multiNode)"
        for flag in GROUP_FLAGS
    },
    "--kv-transfer-config": "set spec.kvTransfer",
    "--model": "set spec.model",
    "--api-key": "use spec.engineApiKeySecretRef: a command line is visible in the pod spec and to ps",
}
SIM_OWNED_FLAGS = {
    "--role": "set by the role",
    "--dp-size": "set dataParallel",
    "--tp-size": "set tensorParallel",
    **{
        flag: "set by pdserve for the pods of a multi-node instance (gpusPerNode, spec.multiNode)"
        for flag in GROUP_FLAGS
    },
    "--host": "engines listen on every address of their pod",
    "--port": f"engines listen on {ENGINE_PORT}",
    "--model": "set spec.servedModelName",
    "--instance-name": "the pod name is used",
    "--kv-host": "the pod IP is used",
}


def problems(pdd: PDDeployment, node_gpu_allocatable: Sequence[int] | None) -> list[str]:
    spec = pdd.spec
    found: list[str] = []
    for role in (Role.PREFILL, Role.DECODE):
        path = f"spec.{role.value}"
        found += _owned_args(spec, role, path)
        found += _owned_env(spec, role, path)
        found += _gpu_resources(spec, role, path)
        found += _template(spec, role, path)
        found += _kv_port_range(spec, role, path)
        if node_gpu_allocatable is not None:
            found += _fits_nodes(spec, role, path, node_gpu_allocatable)
    found += _sidecar_group(spec)
    found += owned_problems(spec.router.template, "spec.router", ROUTER_CONTAINER, router_reserved(spec))
    if spec.router.decode_sidecar:  # the decode template also reaches the router container then
        found += template_problems(pdd)
        router_in_decode = owned_problems(
            spec.decode.template, "spec.decode", ROUTER_CONTAINER, router_reserved(spec)
        )
        found += [p for p in router_in_decode if "containers[router]" in p or "serviceAccountName" in p]
    found += vllm_problems(spec)
    return found


def _owned_args(spec: PDDeploymentSpec, role: Role, path: str) -> list[str]:
    owned = SIM_OWNED_FLAGS if spec.engine == "sim" else VLLM_OWNED_FLAGS
    if spec.tracing is not None:  # a second copy would win in vLLM's parser, unseen by the router
        owned = {**owned, **dict.fromkeys(TRACING_ENGINE_FLAGS, "set spec.tracing")}
    out = []
    for i, arg in enumerate(spec.role(role).args):
        flag = arg.split("=", 1)[0]
        if flag in owned:
            out.append(f"{path}.args[{i}]: {flag} is set by pdserve ({owned[flag]}); remove it from args")
    return out


def _owned_env(spec: PDDeploymentSpec, role: Role, path: str) -> list[str]:
    reserved = {name: "is set by pdserve to the pod IP" for name in OWNED_ENV}
    reserved |= owned_env()  # every connector's, whichever this spec uses (as the CRD's CEL does)
    reserved |= engine_reserved(spec).env
    out = []
    for i, var in enumerate(spec.role(role).env):
        name = var.get("name")
        if name in reserved:
            out.append(f"{path}.env[{i}]: {name} {reserved[name]}; remove it from env")
    return out


def _gpu_resources(spec: PDDeploymentSpec, role: Role, path: str) -> list[str]:
    return _gpu_count(spec, role, spec.role(role).resources, f"{path}.resources")


def _gpu_count(spec: PDDeploymentSpec, role: Role, resources: Mapping[str, Any], path: str) -> list[str]:
    if spec.engine == "sim":
        return []
    rs = spec.role(role)
    shape = spec.group_shape(role)
    what = (
        f"dataParallel x tensorParallel = {rs.gpus_per_instance} GPUs per instance"
        if rs.pipeline_parallel == 1
        else f"dataParallel x tensorParallel x pipelineParallel = {rs.gpus_per_instance} GPUs per instance"
    )
    if shape.multi_node:
        what += f", {shape.gpus_per_pod} in each of its {shape.nodes} pods"
    out = []
    for section in ("requests", "limits"):
        values = resources.get(section) or {}
        if spec.gpu_resource in values and str(values[spec.gpu_resource]) != str(shape.gpus_per_pod):
            out.append(
                f"{path}.{section}[{spec.gpu_resource}]: pdserve requests {what}, got "
                f"{values[spec.gpu_resource]!s}; remove it from resources"
            )
    return out


def engine_reserved(spec: PDDeploymentSpec) -> Reserved:
    """What an engine pod renders because the spec asks for it (model cache, Secrets)."""
    keys = engine_reserved_env(spec)
    if spec.engine == "sim":
        return Reserved(env=keys)
    storage = storage_reserved(spec.model, spec.model_cache, spec.hf_token_secret_ref)
    return Reserved(storage.volumes, storage.mounts, {**storage.env, **keys})


def _kv_port_range(spec: PDDeploymentSpec, role: Role, path: str) -> list[str]:
    """The connector's ports for an instance of this role (a port per rank for some) must stay ports."""
    if spec.engine == "sim":
        return []
    rs = spec.role(role)
    kv = spec.kv_transfer
    found = kv.kv.render.shape_problems(kv.extra_config, rs.data_parallel * rs.tensor_parallel)
    return [f"spec.kvTransfer.extraConfig.{key}: {path} {reason}" for key, reason in found]


def _template(spec: PDDeploymentSpec, role: Role, path: str) -> list[str]:
    def gpus(resources: Mapping[str, Any], where: str) -> list[str]:
        return _gpu_count(spec, role, resources, where)

    return owned_problems(spec.role(role).template, path, ENGINE_CONTAINER, engine_reserved(spec), gpus)


def _fits_nodes(spec: PDDeploymentSpec, role: Role, path: str, allocatable: Sequence[int]) -> list[str]:
    """Each pod of an instance fits a node, with gpusPerNode from the spec or else the nodes'.

    Without spec.gpusPerNode: when every GPU node has the same count, that count splits the
    instance (:func:`default_gpus_per_node`); when they differ, an instance that fits the largest
    node stays one pod, and a larger one needs gpusPerNode.
    """
    rs = spec.role(role)
    if spec.engine == "sim" or rs.instances == 0:
        return []
    need = rs.gpus_per_instance
    counts = sorted({n for n in allocatable if n > 0})
    if not counts:
        resource = spec.gpu_resource
        return [f"{path}: an instance needs {need} {resource}, but no node has allocatable {resource}"]
    gpn = default_gpus_per_node(spec, role, allocatable)
    if gpn is None and need > counts[-1]:
        shown = " and ".join(str(n) for n in counts) if len(counts) <= 4 else f"{counts[0]} to {counts[-1]}"
        return [f"spec.gpusPerNode is required: nodes have {shown} {spec.gpu_resource}"]
    try:
        shape = group_shape(rs, gpn, spec.multi_node, path)
    except SpecError as exc:  # only with the nodes' count: the parser checked the spec's own
        return [f"{exc} (gpusPerNode {gpn}: the nodes' allocatable {spec.gpu_resource})"]
    if shape.gpus_per_pod <= counts[-1]:
        return []
    return [
        f"{path}: a pod of an instance needs {shape.gpus_per_pod} {spec.gpu_resource}, "
        f"but the largest node has {counts[-1]}; set gpusPerNode to {counts[-1]} or less"
    ]


def with_pdserve_image(pdd: PDDeployment, image: str) -> PDDeployment:
    """The deployment as the operator renders it: routers (and ``engine: sim`` pods) run ``image``,
    the operator's own (`pdserve operator --pdserve-image`, which the chart sets to the image it
    runs the operator from), unless ``spec.router.image`` names one."""
    if pdd.spec.router.image or not image:
        return pdd
    return replace(pdd, spec=replace(pdd.spec, router=replace(pdd.spec.router, image=image)))


def with_node_default(pdd: PDDeployment, allocatable: Sequence[int] | None) -> PDDeployment:
    """The deployment as the operator renders it: without spec.gpusPerNode, the nodes' count
    when every GPU node has the same (so groups split where the nodes do); as written otherwise."""
    if pdd.spec.gpus_per_node is not None or allocatable is None:
        return pdd
    uniform = uniform_gpus_per_node(list(allocatable))
    return pdd if uniform is None else replace(pdd, spec=replace(pdd.spec, gpus_per_node=uniform))


def default_gpus_per_node(spec: PDDeploymentSpec, role: Role, allocatable: Sequence[int]) -> int | None:
    """The gpusPerNode a role's groups are rendered with: the role's or the spec's, else the
    allocatable ``gpuResource`` of the nodes when every node that has it has the same count."""
    own = spec.gpus_per_node_of(role)
    return own if own is not None else uniform_gpus_per_node(list(allocatable))


def _sidecar_group(spec: PDDeploymentSpec) -> list[str]:
    """A decode sidecar router serves one engine on its pod; a multi-node decode has several."""
    shape = spec.group_shape(Role.DECODE)
    if not spec.router.decode_sidecar or not shape.multi_node:
        return []
    gpn = spec.gpus_per_node_of(Role.DECODE)
    return [
        "spec.router.placement: decode-sidecar is not supported with multi-node decode instances "
        f"({shape.nodes} pods each with gpusPerNode {gpn}); use placement deployment"
    ]
