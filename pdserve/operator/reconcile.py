"""One level-based reconcile of one PDDeployment: observe, plan, apply, report.

Two kinds of pass. A full pass (a spec change, the periodic resync, first sight of a
deployment, after an error) reads everything back from the cluster: the PDDeployment, its pods
(readiness, IP, template hash, sizes, the draining annotation), the routing ConfigMap, the
Services and the router Deployment. A light pass (a pod or router event) plans from what the
watches fed into :class:`~pdserve.operator.cache.ClusterCache` and reads nothing; it only writes
what changed (bench/results/operator-latest.md: a full pass costs about 12 GETs, a readiness flip
reaches the table in 0.1 s with none). Either kind runs to the end in one go. Pods are only
created after a read of the PDDeployment in the same pass (a light pass GETs it first), so a late
pod event cannot resurrect a deleted deployment's pods. The decisions are the pure functions of
:mod:`pdserve.deployment` (rendering, validation, rollout planning, routing table, status); this
module only performs them. Running it twice on an unchanged cluster writes nothing, and a
restarted operator continues a rollout where the annotations say it stands.

Order inside one pass, chosen so that the router never sends work to a pod being removed and the
routing table (what users wait for) goes out first:

1. start and end drains (annotate pods), 2. write the routing table (drained pods are marked
``draining`` before anything is deleted), 3. apply the Services and the router while deleting
the pods whose drain is over (or whose node is lost), then create the missing and surge pods
(after the deletes, so a role never has more than instances + maxSurge undeleted pods), 4. patch
the status if it changed (Events are posted afterwards, on their own thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pdserve.deployment.drain import DrainVerdict
from pdserve.deployment.objects import (
    DEPLOYMENT_LABEL,
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
    desired_static_objects,
    instance_pod,
    instance_pod_revision,
    is_instance_name,
    pod_parallel_sizes,
    role_selector,
    router_name,
    routing_configmap,
    routing_configmap_name,
    selector_string,
    template_hash,
)
from pdserve.deployment.revision import pairing_revision
from pdserve.deployment.rollout import (
    Action,
    ActionKind,
    ObservedPod,
    RolePlan,
    apply_drains,
    plan_role,
    replacement_allowance,
    revisions_to_keep,
    rollout_policy,
)
from pdserve.deployment.routing import ObservedInstance, build_routing_table
from pdserve.deployment.scheduling import (
    GATE,
    Placement,
    gate_new,
    placement_of,
    to_ungate,
    unschedulable_messages,
    with_gate,
)
from pdserve.deployment.spec import PDDeployment, SpecError, parse_pddeployment
from pdserve.deployment.status import Observation, RoleObservation, compute_status
from pdserve.deployment.validate import problems as spec_problems
from pdserve.operator import metrics
from pdserve.operator.cache import Body, ClusterCache, version_number
from pdserve.operator.kube import Kube, KubeError, NotLeader
from pdserve.operator.nodes import NodeCache
from pdserve.operator.routers import POLL_SECONDS, Draining, Routers
from pdserve.routing import build_slot_table
from pdserve.routing.table import CONFIGMAP_KEY, Role, RoutingTable, RoutingTableError, load_routing_table

log = logging.getLogger("pdserve.operator")

DRAINING_ANNOTATION = "pdserve.io/draining-since"
APPLIED_HASH_ANNOTATION = "pdserve.io/applied-hash"
ROLES = (Role.PREFILL, Role.DECODE)


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to attach to the PDDeployment (posted by the async shell)."""

    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass
class Outcome:
    result: str  # "ok" | "invalid" | "error" | "gone"
    body: dict[str, Any] | None = None  # the PDDeployment, for Events
    events: list[Event] = field(default_factory=list)
    recheck_after: float | None = None
    routing_written: bool = False


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


@dataclass
class Verified:
    """What the last full pass of one PDDeployment read or wrote and found in place.

    A light pass (pod or router event) trusts it and the watch-fed :class:`ClusterCache` and
    reads nothing: not the PDDeployment, not its pods, not the Services, router or routing
    ConfigMap. Every full pass (spec change, periodic resync, first sight, after an error)
    re-reads everything and repairs drift, in the cluster and in the cache.
    """

    table: RoutingTable | None = None
    applied: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> applied hash


@dataclass(frozen=True)
class _Read:
    """What a full pass read: the PDDeployment, its pods, and the objects read alongside."""

    body: dict[str, Any]
    pods: list[Body]
    prefetched: dict[tuple[str, str], Body | None]


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        cache: ClusterCache | None = None,
        nodes: NodeCache | None = None,
        clock: Callable[[], float] = time.time,
        routers: Routers | None = None,
    ) -> None:
        self._kube = kube
        self._routers = routers or Routers(kube)
        self._cache = cache or ClusterCache()
        self._nodes = nodes or NodeCache()
        self._clock = clock
        self._verified: dict[tuple[str, str], Verified] = {}
        # Independent calls of one pass (reads, pod creates and deletes, the static objects) go
        # out together; Events go out on their own thread, off the path from a readiness change
        # to the table.
        # Sized for every reconcile worker to have its calls in flight at once (threads mostly
        # wait on the API server; the Kube connection pool matches).
        self._io = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kube-io")
        self._events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        self._events.shutdown(wait=True)

    def forget(self, namespace: str, name: str) -> None:
        self._verified.pop((namespace, name), None)

    def deployment_gone(self, namespace: str, name: str) -> None:
        self.forget(namespace, name)
        self._routers.forget((namespace, name))

    def reconcile(self, namespace: str, name: str, full: bool = True) -> Outcome:
        """One pass; ``full=False`` (pod and router events) plans from memory when it can."""
        with metrics.RECONCILE_SECONDS.time():
            outcome = self._reconcile(namespace, name, full)
        metrics.RECONCILES.labels(outcome.result).inc()
        if outcome.body is not None and outcome.events:
            self._events.submit(self._post_events, outcome.body, _merged(outcome.events))
        return outcome

    def _post_events(self, body: Mapping[str, Any], events: Sequence[Event]) -> None:
        for event in events:
            log.log(
                logging.WARNING if event.type == "Warning" else logging.INFO,
                "%s/%s %s: %s",
                body["metadata"]["namespace"],
                body["metadata"]["name"],
                event.reason,
                event.message,
            )
            try:
                self._kube.post_event(body, event.type, event.reason, event.message)
            except KubeError as exc:  # an Event is a courtesy; never fail a reconcile for one
                log.warning("cannot post an Event: %s", exc)

    def _reconcile(self, namespace: str, name: str, full: bool) -> Outcome:
        key = (namespace, name)
        if self._cache.deleted(key):
            self.forget(namespace, name)
            return Outcome("gone")  # owner references let the garbage collector remove the rest
        body = self._cache.deployment(key)
        pods = self._cache.pods(key)
        if not full and body is not None and pods is not None and key in self._verified:
            return self._run(dict(body), pods, self._verified[key], fresh=False)
        try:
            read = self._read(namespace, name, body)
        except KubeError as exc:
            metrics.RECONCILE_ERRORS.inc()
            log.warning("cannot read PDDeployment %s/%s or its pods: %s", namespace, name, exc)
            return Outcome("error")
        if read is None:
            self.forget(namespace, name)
            return Outcome("gone")
        verified = self._verified[key] = Verified()
        return self._run(read.body, read.pods, verified, True, read.prefetched)

    def _read(self, namespace: str, name: str, cached: Body | None) -> _Read | None:
        """The PDDeployment and its instance pods, read together; None when it is gone or going.

        Both go into the cache; the pods come back from it, so a watch event newer than the
        LIST (a pod that turned Ready while the LIST was served) is not lost. When the watch has
        shown the PDDeployment, its ConfigMap, Services and router are read in the same round.
        """
        key = (namespace, name)
        selector = f"{DEPLOYMENT_LABEL}={name},{ROLE_LABEL}"  # instance pods: the router's have no role
        got = self._io.submit(self._kube.get, "PDDeployment", namespace, name)
        listed = self._io.submit(self._kube.list_versioned, "Pod", namespace, selector)
        others = []
        if cached is not None:
            with contextlib.suppress(SpecError):
                others = _owned_object_names(parse_pddeployment(cached))
        answers = self._io.map(lambda kn: self._kube.get(kn[0], namespace, kn[1]), others)
        prefetched: dict[tuple[str, str], Body | None] = dict(zip(others, answers, strict=True))
        body = got.result()
        items, version = listed.result()
        if body is None:
            self._cache.deployment_absent(key)
            return None
        self._cache.deployment_event("GET", body)
        if body["metadata"].get("deletionTimestamp"):
            return None
        self._cache.replace_pods(key, items, version_number(version))
        return _Read(body, self._cache.pods(key) or [], prefetched)

    def _run(
        self,
        body: dict[str, Any],
        pods: Sequence[Body],
        verified: Verified,
        fresh: bool,
        prefetched: Mapping[tuple[str, str], Body | None] | None = None,
    ) -> Outcome:
        outcome = Outcome("ok", body=body)
        try:
            self._reconcile_object(body, pods, verified, fresh, prefetched or {}, outcome)
        except NotLeader as exc:  # leadership lapsed mid-pass: nothing more is written, no traceback
            meta = body["metadata"]
            log.warning("reconcile of %s/%s stopped: %s", meta["namespace"], meta["name"], exc)
            outcome.result = "error"
            self.forget(meta["namespace"], meta["name"])
        except (KubeError, RoutingTableError, ValueError) as exc:
            meta = body["metadata"]
            metrics.RECONCILE_ERRORS.inc()
            log.exception("reconcile of %s/%s failed", meta["namespace"], meta["name"])
            outcome.result = "error"
            self.forget(meta["namespace"], meta["name"])  # the next pass reads everything again
            self._report_error(body, outcome, str(exc))
        return outcome

    # --- the steps -----------------------------------------------------------------------------

    def _reconcile_object(
        self,
        body: dict[str, Any],
        raw_pods: Sequence[Body],
        verified: Verified,
        fresh: bool,
        prefetched: Mapping[tuple[str, str], Body | None],
        outcome: Outcome,
    ) -> None:
        meta = body["metadata"]
        generation = int(meta.get("generation") or 0)
        try:
            pdd = parse_pddeployment(body)
        except SpecError as exc:
            outcome.result = "invalid"
            self._write_status(body, Observation(generation, None, (), 0, 0, problems=[str(exc)]), outcome)
            return

        pods = self._observe_pods(pdd, raw_pods)
        found = spec_problems(pdd, self._nodes.allocatable(pdd.spec.gpu_resource))
        if found:
            # Nothing is rendered for a spec that cannot be served; existing objects stay as they are.
            outcome.result = "invalid"
            roles = [self._role_observation(pdd, r, [p.observed for p in pods if p.role is r]) for r in ROLES]
            self._write_status(body, Observation(generation, None, roles, 0, 0, problems=found), outcome)
            return

        now = self._clock()
        # Draining pods whose routers all let go of them (or have none) go before drainSeconds.
        draining = [
            Draining(p.observed.name, p.observed.draining_since)
            for p in pods
            if p.observed.draining_since is not None and not p.observed.terminating
        ]
        available = self._cache.router_available((pdd.namespace, pdd.name))
        verdicts = self._routers.verdicts(pdd, draining, fresh, now, available)
        released = {name: f"drained: {v.reason.value}" for name, v in verdicts.items() if v.done}
        policy = rollout_policy(pdd)
        current = {r: pairing_revision(pdd, r) for r in ROLES}
        keep = revisions_to_keep(
            {r: [p.observed.revision for p in pods if p.role is r and p.observed.routable] for r in ROLES},
            current,
        )
        existing = [p for p in pods if not p.observed.terminating]
        allowance = replacement_allowance(
            {r: sum(1 for p in existing if p.role is r and p.observed.revision == current[r]) for r in ROLES},
            {r: pdd.spec.role(r).instances for r in ROLES},
            shared=any(p.observed.revision != current[p.role] for p in existing),
        )
        plans = {
            role: plan_role(
                role,
                instances=pdd.spec.role(role).instances,
                template_hash=template_hash(pdd, role),
                pods=[p.observed for p in pods if p.role is role],
                policy=policy,
                now=now,
                released=released,
                keep_revisions=keep[role],
                max_starts=allowance[role],
            )
            for role in ROLES
        }
        if not fresh and any(plan.of(ActionKind.CREATE) for plan in plans.values()) and self._going(pdd):
            # The cached PDDeployment may already be deleted (its DELETED event can arrive after
            # the garbage collector's pod deletions): pods are only created after a GET shows it.
            plans = {
                role: replace(plan, actions=plan.actions_except(ActionKind.CREATE))
                for role, plan in plans.items()
            }
        live = self._read_unverified(pdd, verified, prefetched)
        pods = self._drain(pdd, pods, plans, now, outcome)
        # The routing table first: it is what users wait for; then everything else at once.
        table = self._write_routing_table(pdd, pods, verified, live, outcome)
        poll = self._routers.table_written(
            pdd,
            table,
            [p.observed.name for p in pods if p.observed.draining and not p.observed.terminating],
            outcome.routing_written,
        )
        # Each step sends its calls now and returns a function that waits for the answers.
        placements = _placements(pdd, raw_pods, pods)  # largest pods first (deployment/scheduling.py)
        # Deletes are answered before creates go out, so no more than instances + maxSurge pods
        # of a role ever exist undeleted, even for an instant (a pass may replace one pod by another).
        statics = self._apply_static(pdd, verified, live, outcome)
        self._retire_router(pdd, outcome)
        pods = self._delete(pdd, pods, plans, outcome)()
        pods += self._create(pdd, plans, outcome, placements)()
        statics()
        self._ungate(pdd, raw_pods, placements, outcome)

        rechecks = [p.recheck_after for p in plans.values() if p.recheck_after is not None]
        if poll or rechecks:  # drains waiting for the routers, or a router catching up
            rechecks.append(POLL_SECONDS)
        outcome.recheck_after = min(rechecks) if rechecks else None
        outcome.events += _drained_events(pdd, plans, verdicts, self._routers.left_generation)
        routers = self._routers.summary(pdd, table.generation)
        roles = [self._role_observation(pdd, r, [p.observed for p in pods if p.role is r]) for r in ROLES]
        obs = Observation(
            generation,
            table.generation,
            roles,
            router_replicas=0 if pdd.spec.router.decode_sidecar else pdd.spec.router.replicas,
            router_available=self._cache.router_available((pdd.namespace, pdd.name)) or 0,
            unschedulable=unschedulable_messages(placements),
            unreachable=_unreachable_messages(pods, pdd.spec.rollout.node_loss_seconds),
            unpaired=[u.describe() for u in build_slot_table(table).unpaired],
            routers=routers,
        )
        self._write_status(body, obs, outcome)

    def _going(self, pdd: PDDeployment) -> bool:
        """Whether a GET shows the PDDeployment deleted, being deleted or replaced by another."""
        body = self._kube.get("PDDeployment", pdd.namespace, pdd.name)
        if body is None:
            self._cache.deployment_absent((pdd.namespace, pdd.name))
            return True
        self._cache.deployment_event("GET", body)
        meta = body["metadata"]
        return bool(meta.get("deletionTimestamp")) or (bool(pdd.uid) and meta.get("uid") != pdd.uid)

    def _observe_pods(self, pdd: PDDeployment, items: Sequence[Body]) -> list[PodView]:
        views = []
        for pod in items:
            view = _pod_view(pdd, pod, self._nodes.not_ready_since)
            if view is None:
                log.warning(
                    "ignoring pod %s/%s: labelled for %s but not one of its instance pods",
                    pdd.namespace,
                    pod["metadata"]["name"],
                    pdd.name,
                )
            else:
                views.append(view)
        return views

    def _read_unverified(
        self, pdd: PDDeployment, verified: Verified, prefetched: Mapping[tuple[str, str], Body | None]
    ) -> dict[tuple[str, str], Body | None]:
        """The objects the last full pass has not verified (all of them in a full pass), at once."""
        wanted = []
        if verified.table is None:
            wanted.append(("ConfigMap", routing_configmap_name(pdd)))
        for desired in desired_static_objects(pdd):
            kind, name = desired["kind"], desired["metadata"]["name"]
            if verified.applied.get((kind, name)) != _annotation(
                _with_applied_hash(desired), APPLIED_HASH_ANNOTATION
            ):
                wanted.append((kind, name))
        live = {kn: prefetched[kn] for kn in wanted if kn in prefetched}
        missing = [kn for kn in wanted if kn not in prefetched]
        bodies = self._io.map(lambda kn: self._kube.get(kn[0], pdd.namespace, kn[1]), missing)
        live.update(zip(missing, bodies, strict=True))
        return live

    def _drain(
        self,
        pdd: PDDeployment,
        pods: list[PodView],
        plans: Mapping[Role, RolePlan],
        now: float,
        outcome: Outcome,
    ) -> list[PodView]:
        stamp = _rfc3339(now, fraction=True)
        actions = [
            a
            for plan in plans.values()
            for a in plan.actions
            if a.kind in (ActionKind.DRAIN, ActionKind.UNDRAIN)
        ]

        def mark(action: Action) -> dict[str, Any]:
            value = stamp if action.kind is ActionKind.DRAIN else None
            return self._kube.merge_patch(
                "Pod", pdd.namespace, action.pod, {"metadata": {"annotations": {DRAINING_ANNOTATION: value}}}
            )

        for action, patched in zip(actions, self._io.map(mark, actions), strict=True):
            self._cache.pod_event("MODIFIED", patched)
            pod_name = action.pod
            if action.kind is ActionKind.DRAIN:
                message = (
                    f"Draining pod {pod_name} ({action.reason}): out of the routing table, deleted "
                    f"once every router lets go of it, at most {pdd.spec.rollout.drain_seconds}s"
                )
                outcome.events.append(Event("Normal", "Draining", message))
            else:
                outcome.events.append(Event("Normal", "Undrained", f"Pod {pod_name} is wanted again"))
        return [replace(v, observed=apply_drains([v.observed], plans[v.role], now)[0]) for v in pods]

    def _write_routing_table(
        self,
        pdd: PDDeployment,
        pods: Sequence[PodView],
        verified: Verified,
        live: Mapping[tuple[str, str], Body | None],
        outcome: Outcome,
    ) -> RoutingTable:
        observed = [
            ObservedInstance(
                role=p.role,
                index=p.observed.index,
                pod_name=p.observed.name,
                pod_ip=p.ip,
                # A pod on a NotReady node leaves the table at once, before any grace.
                ready=p.observed.ready and p.observed.node_down_since is None,
                draining=p.observed.draining or p.observed.terminating,
                dp_size=p.observed.dp_size,
                tp_size=p.tp_size,
                revision=p.revision,
            )
            for p in pods
        ]
        previous = verified.table
        stripped = False  # someone removed our labels or owner reference: write it again
        if previous is None:
            stored = live.get(("ConfigMap", routing_configmap_name(pdd)))
            previous = _stored_table(stored)
            stripped = previous is not None and not _owned_like(stored, routing_configmap(pdd, previous))
        table = build_routing_table(pdd, observed, previous)
        if previous is not None and table.same_content(previous) and not stripped:
            verified.table = previous
            return previous
        self._kube.apply(routing_configmap(pdd, table))
        verified.table = table
        metrics.ROUTING_WRITES.inc()
        metrics.OBJECT_CHANGES.labels("ConfigMap", "apply").inc()
        outcome.routing_written = True
        log.info(
            "routing table %s/%s generation %d: %d prefill, %d decode instances routable",
            pdd.namespace,
            pdd.name,
            table.generation,
            sum(1 for i in table.prefill if i.routable),
            sum(1 for i in table.decode if i.routable),
        )
        return table

    def _retire_router(self, pdd: PDDeployment, outcome: Outcome) -> None:
        """With the routers in the decode pods, a router Deployment left from ``placement:
        deployment`` goes (the Service already selects the decode pods)."""
        key = (pdd.namespace, pdd.name)
        if not pdd.spec.router.decode_sidecar or self._cache.router_available(key) is None:
            return
        name = router_name(pdd)
        self._kube.delete("Deployment", pdd.namespace, name)
        labels = {DEPLOYMENT_LABEL: pdd.name}
        self._cache.router_event("DELETED", {"metadata": {"namespace": pdd.namespace, "labels": labels}})
        metrics.OBJECT_CHANGES.labels("Deployment", "delete").inc()
        message = f"Deleted Deployment {name}: placement decode-sidecar"
        outcome.events.append(Event("Normal", "Deleted", message))

    def _apply_static(
        self,
        pdd: PDDeployment,
        verified: Verified,
        live: Mapping[tuple[str, str], Body | None],
        outcome: Outcome,
    ) -> Callable[[], None]:
        """Services and the router Deployment; the router's answer feeds its availability."""
        todo = []
        for desired in desired_static_objects(pdd):
            stamped = _with_applied_hash(desired)
            kind, name = desired["kind"], desired["metadata"]["name"]
            wanted = _annotation(stamped, APPLIED_HASH_ANNOTATION) or ""
            if verified.applied.get((kind, name)) != wanted:
                todo.append((stamped, desired, kind, name, wanted))
        answers = self._io.map(lambda t: self._sync_static(pdd, t[0], t[1], live), todo)

        def finish() -> None:
            for (_, _, kind, name, wanted), (body, verb) in zip(todo, answers, strict=True):
                if verb is not None:
                    metrics.OBJECT_CHANGES.labels(kind, verb.lower()).inc()
                    outcome.events.append(Event("Normal", verb, f"{verb} {kind} {name}"))
                verified.applied[(kind, name)] = wanted
                if kind == "Deployment" and name == router_name(pdd) and body is not None:
                    self._cache.router_event("GET", body)

        return finish

    def _sync_static(
        self,
        pdd: PDDeployment,
        stamped: dict[str, Any],
        desired: dict[str, Any],
        live: Mapping[tuple[str, str], Body | None],
    ) -> tuple[Body | None, str | None]:
        """Apply one object unless it is already as wanted; returns it and what was done."""
        kind, name = stamped["kind"], stamped["metadata"]["name"]
        current = live[(kind, name)] if (kind, name) in live else self._kube.get(kind, pdd.namespace, name)
        if (
            current is not None
            and _annotation(current, APPLIED_HASH_ANNOTATION) == _annotation(stamped, APPLIED_HASH_ANNOTATION)
            and _owned_like(current, desired)
        ):
            return current, None
        verb = "Created" if current is None else "Updated"
        return self._kube.apply(stamped), verb

    def _delete(
        self, pdd: PDDeployment, pods: list[PodView], plans: Mapping[Role, RolePlan], outcome: Outcome
    ) -> Callable[[], list[PodView]]:
        """Deletes the pods whose drain is over; the views come back marked terminating."""
        by_name = {p.observed.name: p for p in pods}
        actions = [a for plan in plans.values() for a in plan.of(ActionKind.DELETE)]

        def delete(action: Action) -> dict[str, Any] | None:
            return self._kube.delete("Pod", pdd.namespace, action.pod, uid=by_name[action.pod].uid)

        answers = self._io.map(delete, actions)

        def finish() -> list[PodView]:
            for action, answer in zip(actions, answers, strict=True):
                view = by_name[action.pod]
                if answer is not None:
                    metrics.OBJECT_CHANGES.labels("Pod", "delete").inc()
                    if action.node_lost:
                        metrics.NODE_LOSS_REPLACEMENTS.inc()
                        message = (
                            f"Pod {action.pod} on node {view.node or '?'} replaced ({action.reason}; "
                            f"rollout.nodeLossSeconds is {pdd.spec.rollout.node_loss_seconds}): deleted, "
                            "it may stay Terminating until the node returns"
                        )
                        outcome.events.append(Event("Warning", "NodeLost", message))
                    else:
                        message = f"Deleted pod {action.pod} ({action.reason})"
                        outcome.events.append(Event("Normal", "Deleted", message))
                    if answer.get("kind") == "Pod":
                        self._cache.pod_event("MODIFIED", answer)
                by_name[action.pod] = replace(view, observed=replace(view.observed, terminating=True))
            return list(by_name.values())

        return finish

    def _create(
        self,
        pdd: PDDeployment,
        plans: Mapping[Role, RolePlan],
        outcome: Outcome,
        placements: Sequence[Placement] = (),
    ) -> Callable[[], list[PodView]]:
        """Creates the missing pods, smaller ones gated while larger ones wait; the new views come back."""
        todo = [(role, a) for role, plan in plans.items() for a in plan.of(ActionKind.CREATE)]
        manifests = [instance_pod(pdd, role, a.index, pod_suffix()) for role, a in todo]
        gated = gate_new([placement_of(m, pdd.spec.gpu_resource) for m in manifests], placements)
        manifests = [with_gate(m) if m["metadata"]["name"] in gated else m for m in manifests]
        answers = self._io.map(self._kube.create, manifests)
        born = self._clock()

        def finish() -> list[PodView]:
            out = []
            for (role, action), manifest, created in zip(todo, manifests, answers, strict=True):
                name = manifest["metadata"]["name"]
                self._cache.pod_event("ADDED", created)
                metrics.OBJECT_CHANGES.labels("Pod", "create").inc()
                outcome.events.append(Event("Normal", "Created", f"Created pod {name} ({action.reason})"))
                rs = pdd.spec.role(role)
                observed = ObservedPod(
                    action.index,
                    name,
                    template_hash(pdd, role),
                    False,
                    dp_size=rs.data_parallel,
                    created=born,
                    revision=pairing_revision(pdd, role),
                )
                out.append(PodView(role, observed, "", None, rs.tensor_parallel))
            return out

        return finish

    def _ungate(
        self, pdd: PDDeployment, raw_pods: Sequence[Body], placements: Sequence[Placement], outcome: Outcome
    ) -> None:
        """Lifts the gate of pods that no larger pod waits ahead of any more."""
        names = set(to_ungate(placements))
        pods = [p for p in raw_pods if p["metadata"]["name"] in names]

        def lift(pod: Body) -> dict[str, Any]:
            rest = [g for g in pod["spec"].get("schedulingGates") or [] if g.get("name") != GATE]
            patch = {"metadata": {"resourceVersion": pod["metadata"]["resourceVersion"]}}
            patch["spec"] = {"schedulingGates": rest or None}
            return self._kube.merge_patch("Pod", pdd.namespace, pod["metadata"]["name"], patch)

        for pod, patched in zip(pods, self._io.map(lift, pods), strict=True):
            self._cache.pod_event("MODIFIED", patched)
            message = f"Pod {pod['metadata']['name']} may be scheduled: no larger pod of {pdd.name} waits"
            outcome.events.append(Event("Normal", "Ungated", message))

    def _role_observation(
        self, pdd: PDDeployment, role: Role, pods: Sequence[ObservedPod]
    ) -> RoleObservation:
        rs = pdd.spec.role(role)
        return RoleObservation(
            role,
            rs.instances,
            rs.data_parallel,
            template_hash(pdd, role),
            selector_string(role_selector(pdd, role)),
            pods,
        )

    # --- status and errors ---------------------------------------------------------------------

    def _write_status(self, body: dict[str, Any], obs: Observation, outcome: Outcome) -> None:
        previous = body.get("status") or {}
        status = compute_status(obs, previous, _rfc3339(self._clock()))
        if all(previous.get(k) == v for k, v in status.items()):
            return
        meta = body["metadata"]
        patched = self._kube.merge_patch(
            "PDDeployment", meta["namespace"], meta["name"], {"status": status}, "status"
        )
        self._cache.deployment_event("MODIFIED", patched)  # the next light pass compares with it
        was = _condition(previous, "Degraded")
        now = _condition(status, "Degraded")
        if now.get("status") == "True" and (now.get("message"), now.get("reason")) != (
            was.get("message"),
            was.get("reason"),
        ):
            outcome.events.append(Event("Warning", str(now.get("reason")), str(now.get("message"))))
        was_ready, is_ready = (
            _condition(previous, "Ready").get("status"),
            _condition(status, "Ready").get("status"),
        )
        if is_ready != was_ready and is_ready == "True":
            outcome.events.append(Event("Normal", "Ready", str(_condition(status, "Ready").get("message"))))

    def _report_error(self, body: dict[str, Any], outcome: Outcome, message: str) -> None:
        outcome.events.append(Event("Warning", "ReconcileError", message))
        previous = body.get("status") or {}
        conditions = [c for c in previous.get("conditions") or [] if c.get("type") != "Degraded"]
        old = _condition(previous, "Degraded")
        conditions.append(
            {
                "type": "Degraded",
                "status": "True",
                "reason": "ReconcileError",
                "message": message,
                "observedGeneration": int(body["metadata"].get("generation") or 0),
                "lastTransitionTime": old.get("lastTransitionTime")
                if old.get("status") == "True"
                else _rfc3339(self._clock()),
            }
        )
        meta = body["metadata"]
        try:
            self._kube.merge_patch(
                "PDDeployment",
                meta["namespace"],
                meta["name"],
                {"status": {"conditions": conditions}},
                "status",
            )
        except KubeError as exc:
            log.warning(
                "cannot record the error in the status of %s/%s: %s", meta["namespace"], meta["name"], exc
            )


# --- pure helpers --------------------------------------------------------------------------------

#: Kubernetes' generateName alphabet: no vowels (no words), no look-alikes.
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def pod_suffix() -> str:
    """A new pod's unique name suffix; 27**5 names per index make a clash (a 409) negligible."""
    return "".join(secrets.choice(_SUFFIX_ALPHABET) for _ in range(5))


def _drained_events(
    pdd: PDDeployment,
    plans: Mapping[Role, RolePlan],
    verdicts: Mapping[str, DrainVerdict],
    left: Callable[[PDDeployment, str], int | None],
) -> list[Event]:
    """One ``Drained`` Event per draining pod deleted now, saying what ended its drain."""
    out = []
    for plan in plans.values():
        for action in plan.of(ActionKind.DELETE):
            name = action.pod
            verdict = verdicts.get(name)
            if verdict is None:
                if not action.reason.startswith("drained"):
                    continue  # not a drain: a pod that was never Ready, or on a lost node
                why = "timeout, routers not asked"
                metrics.DRAINS.labels("timeout").inc()
            else:
                why = verdict.describe()
                metrics.DRAINS.labels(verdict.reason.value).inc()
            generation = left(pdd, name)
            at = f", left the table at generation {generation}" if generation is not None else ""
            out.append(Event("Normal", "Drained", f"Pod {name} drained: {why}{at}"))
    return out


def _unreachable_messages(pods: Sequence[PodView], grace: float) -> list[str]:
    """Pods on NotReady nodes, in words that do not change from one pass to the next."""
    out = []
    for p in pods:
        since = p.observed.node_down_since
        if since is not None and not p.observed.terminating:
            out.append(
                f"pod {p.observed.name}: node {p.node} NotReady since {_rfc3339(since)}, "
                f"out of the routing table, replaced at {_rfc3339(since + grace)}"
            )
    return out


def _merged(events: Sequence[Event]) -> list[Event]:
    """One Event per (type, reason) and pass: creating a deployment is one Created, not seven."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for e in events:
        grouped.setdefault((e.type, e.reason), []).append(e.message)
    return [Event(t, r, "; ".join(messages)) for (t, r), messages in grouped.items()]


def _pod_view(
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
        draining_since=_parse_time(annotations.get(DRAINING_ANNOTATION)),
        terminating=bool(meta.get("deletionTimestamp")),
        dp_size=dp_size,
        node_down_since=node_down_since(node) if node else None,
        unschedulable=unschedulable,
        created=_parse_time(meta.get("creationTimestamp")) or 0.0,
        revision=instance_pod_revision(pod) or pairing_revision(pdd, role),
    )
    ip = status.get("podIP") or None
    revision = instance_pod_revision(pod)
    return PodView(role, observed, str(meta.get("uid", "")), ip, tp_size, revision, node)


def _placements(pdd: PDDeployment, raw_pods: Sequence[Body], views: Sequence[PodView]) -> list[Placement]:
    names = {v.observed.name for v in views}
    return [placement_of(p, pdd.spec.gpu_resource) for p in raw_pods if p["metadata"]["name"] in names]


def _owned_object_names(pdd: PDDeployment) -> list[tuple[str, str]]:
    """(kind, name) of the routing ConfigMap, the Services and the router."""
    return [("ConfigMap", routing_configmap_name(pdd))] + [
        (o["kind"], o["metadata"]["name"]) for o in desired_static_objects(pdd)
    ]


def _stored_table(configmap: Mapping[str, Any] | None) -> RoutingTable | None:
    if configmap is None:
        return None
    text = (configmap.get("data") or {}).get(CONFIGMAP_KEY)
    if not text:
        return None
    try:
        return load_routing_table(text)
    except RoutingTableError as exc:
        log.warning("replacing an unreadable routing table: %s", exc)
        return None


def _owned_like(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """The live object still carries our labels and owner reference (nobody stripped them)."""
    if live is None:
        return False
    lm, dm = live.get("metadata") or {}, desired["metadata"]
    labels = lm.get("labels") or {}
    if any(labels.get(k) != v for k, v in dm.get("labels", {}).items()):
        return False
    owners = {o.get("uid") for o in lm.get("ownerReferences") or []}
    return all(o["uid"] in owners for o in dm.get("ownerReferences", []))


def _with_applied_hash(obj: Mapping[str, Any]) -> dict[str, Any]:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    out = json.loads(text)
    out["metadata"].setdefault("annotations", {})[APPLIED_HASH_ANNOTATION] = digest
    return dict(out)


def _annotation(obj: Mapping[str, Any] | None, key: str) -> str | None:
    if not obj:
        return None
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    return str(value) if value is not None else None


def _condition(status: Mapping[str, Any], kind: str) -> dict[str, Any]:
    for c in status.get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == kind:
            return dict(c)
    return {}


def _rfc3339(epoch: float, fraction: bool = False) -> str:
    moment = datetime.fromtimestamp(epoch, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if fraction else "%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: object) -> float | None:
    """The draining annotation; an unreadable one counts as 'draining since long ago'."""
    if value is None:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
