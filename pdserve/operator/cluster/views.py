"""What the cluster shows, as the planner's inputs: instance pods read into views, and the times
and messages the status needs. Pure: dicts in, dataclasses and strings out."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from pdserve.deployment.plan.gangs import (
    Group,
    Member,
    Verdict,
    judge,
)
from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.plan.rollout import ObservedPod
from pdserve.deployment.plan.scheduling import Placement, placement_of
from pdserve.deployment.render.engine_pod import engine_argv, instance_pod_revision, pod_parallel_sizes
from pdserve.deployment.render.groupflags import LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL
from pdserve.deployment.render.names import (
    GROUP_FORMED_ANNOTATION,
    GROUP_LABEL,
    GROUP_NODE_LABEL,
    GROUP_SIZE_ANNOTATION,
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
    is_instance_name,
)
from pdserve.deployment.render.routing_table import NodeEndpoint
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.operator.cluster.cache import Body
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
    #: Multi-node instances: the group (leader's name) and this pod's rank in it; None: one pod.
    group: str | None = None
    member: Member | None = None
    group_size: int = 1  # the leader's ``pdserve.io/group-size``
    formed: bool = False  # the leader's ``pdserve.io/group-formed``
    lws: bool = False  # a LeaderWorkerSet's pod (backend lws): the unit is that object
    #: A group as the planner's unit: (name, uid) of every pod to delete with it, and the
    #: addresses of its members by node rank (the routing table's per-node endpoints).
    members: tuple[tuple[str, str], ...] = ()
    #: The DP ranks this pod's own API server takes (first, count); None: it serves no API
    #: (a headless worker) or all of its instance's ranks (single pod, leader-mode leader).
    api_ranks: tuple[int, int] | None = None
    #: A unit's per-node API servers: (ip, first rank, ranks), when each node serves its own.
    endpoints: tuple[NodeEndpoint, ...] = ()
    ready_members: int = 0  # a unit's Ready pods
    leader_pod: str | None = None  # a unit's leader pod, which carries the draining mark

    @property
    def pod_refs(self) -> tuple[tuple[str, str], ...]:
        """(name, uid) of the pods the view stands for: its group's members, or the pod itself."""
        return self.members or ((self.observed.name, self.uid),)

    @property
    def pod_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.pod_refs)


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
    group = labels.get(GROUP_LABEL) or None
    leader = group if group and (name == group or name.startswith(group + "-")) else name
    if not is_instance_name(pdd, role, index, leader):
        return None  # a group's workers are named after their leader: <leader>-<node rank>
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
    view = PodView(role, observed, str(meta.get("uid", "")), ip, tp_size, revision, node)
    if not group:
        return view
    lws = bool(labels.get(LWS_NAME_LABEL))
    try:
        node_rank = int(labels.get(GROUP_NODE_LABEL) or labels.get(LWS_WORKER_INDEX_LABEL) or "0")
        size = int(annotations.get(GROUP_SIZE_ANNOTATION, "1"))
    except ValueError:
        return None
    member = Member(
        name=name,
        node_rank=node_rank,
        ready=ready,
        terminating=observed.terminating,
        failed=_failed(status),
        unready_since=None if ready else _unready_since(conditions, observed.created),
        unschedulable=unschedulable,
        ip=ip,
    )
    formed = bool(annotations.get(GROUP_FORMED_ANNOTATION))
    return replace(
        view,
        group=group,
        member=member,
        group_size=size,
        formed=formed,
        lws=lws,
        api_ranks=_api_ranks(pod, node_rank),
    )


def _api_ranks(pod: Mapping[str, Any], node_rank: int) -> tuple[int, int] | None:
    """(first, count) of the local ranks a per-node API server takes (vLLM's hybrid load
    balancing, read from the engine's own flags, so a pod says what it was started with).

    A LeaderWorkerSet's workers share one template whose ``sh -c`` computes the start rank from
    the worker index: that rank is ``node_rank`` times the local ranks.
    """
    argv = engine_argv(pod)
    if "--data-parallel-hybrid-lb" not in argv:
        return None

    def flag(name: str) -> int | None:
        values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
        try:
            return int(values[-1]) if values else None
        except ValueError:
            return None

    local = flag("--data-parallel-size-local") or 1
    first = flag("--data-parallel-start-rank")
    return (node_rank * local if first is None else first), local


def _failed(status: Mapping[str, Any]) -> bool:
    """The pod failed, or a container of it restarted (the rank it ran left its group)."""
    if status.get("phase") == "Failed":
        return True
    containers = list(status.get("containerStatuses") or []) + list(status.get("initContainerStatuses") or [])
    return any(int(c.get("restartCount") or 0) > 0 for c in containers if isinstance(c, Mapping))


def _unready_since(conditions: Sequence[Mapping[str, Any]], created: float) -> float:
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    since = parse_time(ready.get("lastTransitionTime")) if ready else None
    return max(since or created, created)


@dataclass(frozen=True)
class GangPass:
    """Multi-node instances seen as the planner's units, and what their groups need first."""

    units: list[PodView]  # one per single-pod instance or group still standing
    broken: list[tuple[PodView, str]]  # groups to delete whole now (the unit, why)
    forming: list[tuple[PodView, tuple[int, ...]]]  # leaders whose workers to create (ranks)
    recheck_after: float | None = None


def gang_pass(views: Sequence[PodView], now: float, gang_timeout: float) -> GangPass:
    """Gathers group members into units (:mod:`pdserve.deployment.plan.gangs`) and judges them."""
    units = [v for v in views if v.group is None]
    by_group: dict[str, list[PodView]] = {}
    for v in views:
        if v.group is not None:
            by_group.setdefault(v.group, []).append(v)
    broken: list[tuple[PodView, str]] = []
    forming: list[tuple[PodView, tuple[int, ...]]] = []
    rechecks: list[float] = []
    for name, members in sorted(by_group.items()):
        members.sort(key=lambda v: (v.member.node_rank if v.member else 0, v.observed.name))
        lws = any(v.lws for v in members)  # a LeaderWorkerSet's pods are <name>-0, <name>-0-1...
        leader = next((v for v in members if _leads(v, name, lws)), None)
        size = leader.group_size if leader else max(v.group_size for v in members)
        formed = leader.formed if leader else False
        group = Group(name, size, tuple(v.member for v in members if v.member), formed, managed=lws)
        verdict = judge(group, now, gang_timeout)
        unit = _unit(leader or members[0], members, group)
        if verdict.recheck_after is not None:
            rechecks.append(verdict.recheck_after)
        if verdict.verdict is Verdict.BROKEN:
            broken.append((unit, verdict.reason))
            continue
        if verdict.create:
            forming.append((unit, verdict.create))
        units.append(unit)
    return GangPass(units, broken, forming, min(rechecks) if rechecks else None)


def lws_stand_in(lws: Mapping[str, Any]) -> dict[str, Any] | None:
    """The leader pod a LeaderWorkerSet will have (``<name>-0``), not Ready, for as long as the
    controller has not created it: so the group exists for the planner from the moment its
    object does (no second LeaderWorkerSet for the index), and its gang timeout runs from then.
    The real pod replaces it in the cache: same name, and the stand-in has no version."""
    meta = lws.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    template = ((lws.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("leaderTemplate") or {}
    tmeta = template.get("metadata") or {}
    return {
        "metadata": {
            **tmeta,
            "name": f"{meta.get('name')}-0",
            "namespace": meta.get("namespace"),
            "uid": "",
            # No resourceVersion: any event of the real pod replaces the stand-in (the object's own
            # version moves with its status and would outrank the pod's).
            "creationTimestamp": meta.get("creationTimestamp"),
            "labels": {**(tmeta.get("labels") or {}), LWS_NAME_LABEL: meta.get("name")},
        },
        "spec": template.get("spec") or {},
        "status": {},
    }


def _leads(view: PodView, group: str, lws: bool) -> bool:
    rank = view.member.node_rank if view.member else -1
    return rank == 0 and (lws or view.observed.name == group)


def _unit(head: PodView, members: Sequence[PodView], group: Group) -> PodView:
    """A group as one instance: Ready only when whole, on a lost node when any member is."""
    downs = [v.observed.node_down_since for v in members if v.observed.node_down_since is not None]
    observed = replace(
        head.observed,
        name=group.leader,  # the leader pod's name, or the LeaderWorkerSet's
        ready=group.ready,
        # A LeaderWorkerSet's pods terminate when its controller restarts the group: the object,
        # the unit, stays (the pass that deletes it marks the view terminating itself).
        terminating=head.observed.terminating and not group.managed,
        node_down_since=min(downs) if downs else None,
        unschedulable=any(v.observed.unschedulable for v in members),
    )
    endpoints: list[NodeEndpoint] = []
    if all(v.api_ranks is not None for v in members) and len(members) == group.size:
        endpoints = [NodeEndpoint(v.ip, *v.api_ranks) for v in members if v.ip and v.api_ranks]
        if len(endpoints) != group.size:
            endpoints = []  # an address still missing: the group is not routable yet anyway
    return replace(
        head,
        observed=observed,
        leader_pod=head.observed.name,
        members=tuple((v.observed.name, v.uid) for v in members),
        ready_members=sum(1 for v in members if v.member and v.member.ready and not v.member.terminating),
        endpoints=tuple(sorted(endpoints, key=lambda e: e.first_rank)),
    )


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
