"""Multi-node instances (groups) as Kubernetes objects, and every object of a deployment.

An instance larger than ``gpusPerNode`` (pdserve/deployment/spec/multinode.py) is, with backend
``pods``, a group of pods the operator creates itself (:func:`group_pods`: the leader, then the
workers once it has an address) and, with backend ``lws``, one LeaderWorkerSet
(:func:`instance_lws`). Each pod runs the engine flags of its node (groupflags.py); the pod
specs come from engine_pod.py, so a group's pods differ from a single-node instance's only in
those flags, their GPU share, their names and labels, and (headless pods) their probes.
:func:`render_all` is what ``pdserve render`` prints.
"""

from __future__ import annotations

from typing import Any

from pdserve.deployment.render.engine_pod import instance_pod, pod_metadata, pod_spec, template_hash
from pdserve.deployment.render.groupflags import (
    LEADER_ADDRESS_ENV,
    LWS_LEADER_ADDRESS_ENV,
    LWS_WORKER_INDEX_ENV,
    GroupMember,
    lws_object,
    shell_command,
)
from pdserve.deployment.render.names import (
    GROUP_LABEL,
    GROUP_SIZE_ANNOTATION,
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
    engine_service_name,
    instance_hostname,
    instance_name,
    object_metadata,
)
from pdserve.deployment.render.routing_table import build_routing_table, routing_configmap
from pdserve.deployment.render.static_objects import desired_static_objects
from pdserve.deployment.spec.multinode import BACKEND_LWS, GroupShape
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.routing import Role, RoutingTable


def group_shape_of(pdd: PDDeployment, role: Role) -> GroupShape:
    """The pods one instance of ``role`` spans, with the spec's gpusPerNode (one pod without it)."""
    return pdd.spec.group_shape(role)


def group_member_name(pdd: PDDeployment, role: Role, index: int, suffix: str, node: int) -> str:
    """The leader (node 0) has :func:`instance_name`; node k >= 1 adds ``-<k>``."""
    return instance_name(pdd, role, index, suffix) + (f"-{node}" if node else "")


def group_pods(
    pdd: PDDeployment, role: Role, index: int, suffix: str, leader_address: str | None
) -> list[dict[str, Any]]:
    """The pods of one instance, leader first (backend ``pods``); one pod for a single-node role.

    Workers reach the leader at ``leader_address`` (the leader pod's IP, known once it runs),
    given in their ``PDSERVE_LEADER_ADDRESS`` env; None renders the leader's DNS name in the
    engines' headless Service instead, which resolves once the leader pod exists.
    """
    shape = pdd.spec.group_shape(role)
    if not shape.multi_node:
        return [instance_pod(pdd, role, index, suffix)]
    leader = instance_name(pdd, role, index, suffix)
    rpc = pdd.spec.multi_node.rpc_port
    # Without a namespace, the short name: the pod's DNS search path adds its own namespace.
    dns = f"{instance_hostname(role, index, suffix)}.{engine_service_name(pdd)}"
    address = leader_address or (f"{dns}.{pdd.namespace}.svc" if pdd.namespace else dns)
    pods = []
    for node in range(shape.nodes):
        name = group_member_name(pdd, role, index, suffix, node)
        hostname = instance_hostname(role, index, suffix) + (f"-{node}" if node else "")
        if node == 0:
            member = GroupMember(shape, 0, rpc, "$(POD_IP)")
        else:
            member = GroupMember(shape, node, rpc, f"$({LEADER_ADDRESS_ENV})")
        spec = pod_spec(pdd, role, leader, hostname, member)  # the simulator's engine ids: the group's
        if node > 0:
            engine = next(c for c in spec["containers"] if c["name"] == "engine")
            engine["env"] = [{"name": LEADER_ADDRESS_ENV, "value": address}, *engine["env"]]
        meta = pod_metadata(pdd, role, index, name, (leader, node, shape.nodes))
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    return pods


def instance_lws(pdd: PDDeployment, role: Role, index: int, suffix: str) -> dict[str, Any]:
    """One instance as a LeaderWorkerSet (backend ``lws``; a multi-node role only).

    Named like the pods backend's leader, one replica, ``size`` = the group's pods, and
    ``RecreateGroupOnPodRestart``: the LWS controller schedules and restarts the group as a unit,
    the operator still drains and deletes per instance. The leader's address comes from the
    controller's ``LWS_LEADER_ADDRESS``; the shared worker template computes its node's start
    rank (or node rank) from ``LWS_WORKER_INDEX``. hostname/subdomain are the controller's.
    The worker template's declared NIXL ports are the first worker's (declarations only: each
    vLLM engine binds the base plus its global rank).
    """
    shape = pdd.spec.group_shape(role)
    if not shape.multi_node:
        raise ValueError(f"spec.{role.value}: one pod per instance; instance_lws renders multi-node roles")
    name = instance_name(pdd, role, index, suffix)
    rpc = pdd.spec.multi_node.rpc_port
    worker_index = f"$({LWS_WORKER_INDEX_ENV})"
    if shape.spans_rank or shape.dp_local == 1:
        start = worker_index
    else:
        start = f"$$(({LWS_WORKER_INDEX_ENV} * {shape.dp_local}))"
    members = (
        GroupMember(shape, 0, rpc, "$(POD_IP)"),
        GroupMember(shape, 1, rpc, f"$({LWS_LEADER_ADDRESS_ENV})", start_rank=start, node_rank=worker_index),
    )
    templates = []
    for member in members:
        spec = pod_spec(pdd, role, name, "", member)
        for key in ("hostname", "subdomain"):
            spec.pop(key, None)
        if member.node > 0 and start.startswith("$$"):
            engine = next(c for c in spec["containers"] if c["name"] == "engine")
            engine["command"], engine["args"] = shell_command(engine["command"], engine["args"])
        node = 0 if member.node == 0 else None
        meta = pod_metadata(pdd, role, index, name, (name, node, shape.nodes))
        for key in ("name", "namespace", "ownerReferences"):
            meta.pop(key, None)
        templates.append({"metadata": meta, "spec": spec})
    meta = object_metadata(pdd, name, role.value)
    meta["labels"].update({ROLE_LABEL: role.value, INSTANCE_LABEL: str(index), GROUP_LABEL: name})
    meta["labels"][TEMPLATE_HASH_LABEL] = template_hash(pdd, role)
    meta["annotations"] = {GROUP_SIZE_ANNOTATION: str(shape.nodes)}
    return lws_object(meta, shape.nodes, templates[0], templates[1])


def instance_objects(pdd: PDDeployment, role: Role, index: int, suffix: str = "") -> list[dict[str, Any]]:
    """What one instance is made of: its pod, its group's pods, or its LeaderWorkerSet."""
    if pdd.spec.group_shape(role).multi_node and pdd.spec.multi_node.backend == BACKEND_LWS:
        return [instance_lws(pdd, role, index, suffix)]
    return group_pods(pdd, role, index, suffix, None)


def render_all(pdd: PDDeployment, table: RoutingTable | None = None) -> list[dict[str, Any]]:
    """Every object of the deployment; without ``table``, the routing table with no instances yet."""
    if table is None:
        table = build_routing_table(pdd, (), None)
    pods = [
        obj
        for role in (Role.PREFILL, Role.DECODE)
        for index in range(pdd.spec.role(role).instances)
        for obj in instance_objects(pdd, role, index)
    ]
    return [*desired_static_objects(pdd), routing_configmap(pdd, table), *pods]
