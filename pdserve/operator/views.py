"""What the cluster shows, as the planner's inputs: instance pods read into views, and the times
and messages the status needs. Pure: dicts in, dataclasses and strings out."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pdserve.deployment.objects import (
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
    instance_pod_revision,
    is_instance_name,
    pod_parallel_sizes,
)
from pdserve.deployment.revision import pairing_revision
from pdserve.deployment.rollout import ObservedPod
from pdserve.deployment.scheduling import Placement, placement_of
from pdserve.deployment.spec import PDDeployment
from pdserve.operator.cache import Body
from pdserve.routing.table import Role

DRAINING_ANNOTATION = "pdserve.io/draining-since"


@dataclass(frozen=True)
class PodView:
    """One instance pod as observed: the planner's view plus what the table and deletes need."""

    role: Role
    observed: ObservedPod
    uid: str
    ip: str | None
    tp_size: int | None = None  # what the pod runs (dp_size is on ``observed``, status needs it)
    revision: str | None = None  # the pairing revision the pod runs (None: created before revisions)
    node: str | None = None  # spec.nodeName, once scheduled


def pod_view(
    pdd: PDDeployment, pod: Mapping[str, Any], node_down_since: Callable[[str], float | None]
) -> PodView | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        role = Role(labels.get(ROLE_LABEL, ""))
        index = int(labels.get(INSTANCE_LABEL, ""))
    except ValueError:
        return None
    name = meta.get("name", "")
    if not is_instance_name(pdd, role, index, name):
        return None
    status = pod.get("status") or {}
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    unschedulable = any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in conditions
    )
    node = (pod.get("spec") or {}).get("nodeName") or None
    annotations = meta.get("annotations") or {}
    dp_size, tp_size = pod_parallel_sizes(pod)
    observed = ObservedPod(
        index=index,
        name=name,
        template_hash=labels.get(TEMPLATE_HASH_LABEL),
        ready=ready,
        draining_since=parse_time(annotations.get(DRAINING_ANNOTATION)),
        terminating=bool(meta.get("deletionTimestamp")),
        dp_size=dp_size,
        node_down_since=node_down_since(node) if node else None,
        unschedulable=unschedulable,
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        revision=instance_pod_revision(pod) or pairing_revision(pdd, role),
    )
    ip = status.get("podIP") or None
    revision = instance_pod_revision(pod)
    return PodView(role, observed, str(meta.get("uid", "")), ip, tp_size, revision, node)


def pod_placements(pdd: PDDeployment, raw_pods: Sequence[Body], views: Sequence[PodView]) -> list[Placement]:
    names = {v.observed.name for v in views}
    return [placement_of(p, pdd.spec.gpu_resource) for p in raw_pods if p["metadata"]["name"] in names]


def unreachable_messages(pods: Sequence[PodView], grace: float) -> list[str]:
    """Pods on NotReady nodes, in words that do not change from one pass to the next."""
    out = []
    for p in pods:
        since = p.observed.node_down_since
        if since is not None and not p.observed.terminating:
            out.append(
                f"pod {p.observed.name}: node {p.node} NotReady since {rfc3339(since)}, "
                f"out of the routing table, replaced at {rfc3339(since + grace)}"
            )
    return out


def rfc3339(epoch: float, fraction: bool = False) -> str:
    moment = datetime.fromtimestamp(epoch, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if fraction else "%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: object) -> float | None:
    """The draining annotation; an unreadable one counts as 'draining since long ago'."""
    if value is None:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
