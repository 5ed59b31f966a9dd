"""One level-based reconcile of one PDDeployment: observe, plan, apply, report.

Two kinds of pass. A full pass (a spec change, the periodic resync, first sight of a
deployment, after an error) reads everything back from the cluster: the PDDeployment, its pods
(readiness, IP, template hash, sizes, the draining annotation), the routing ConfigMap, the
Services and the router Deployment. A light pass (a pod or router event) plans from what the
watches fed into :class:`~pdserve.operator.cluster.cache.ClusterCache` and reads nothing; it only writes
what changed (bench/results/operator-latest.md has what each costs). Either kind runs to the
end in one go. Pods are only created after a read of the PDDeployment in the same pass (a light
pass GETs it first), so a late pod event cannot resurrect a deleted deployment's pods. The
decisions are the pure functions of :mod:`pdserve.deployment` (rendering, validation, rollout
planning, routing table, status); this module reads, sequences and reports,
:mod:`pdserve.operator.cluster.views` turns pods into the planner's inputs and
:mod:`pdserve.operator.reconcile.steps` makes the writes. Running it twice on an unchanged cluster writes
nothing, and a restarted operator continues a rollout where the annotations say it stands.

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
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.plan.rollout import (
    ActionKind,
    plan_role,
    replacement_allowance,
    revisions_to_keep,
    rollout_policy,
)
from pdserve.deployment.plan.scheduling import (
    unschedulable_messages,
)
from pdserve.deployment.plan.status import Observation, RoleObservation, compute_status
from pdserve.deployment.render.engine_pod import template_hash
from pdserve.deployment.render.names import (
    DEPLOYMENT_LABEL,
    ROLE_LABEL,
    role_selector,
    routing_configmap_name,
    selector_string,
)
from pdserve.deployment.render.static_objects import desired_static_objects
from pdserve.deployment.spec.multinode import BACKEND_LWS
from pdserve.deployment.spec.parse import SpecError, parse_pddeployment
from pdserve.deployment.spec.pddeployment import DEFAULT_IMAGE, PDDeployment
from pdserve.deployment.validate import problems as spec_problems
from pdserve.deployment.validate import with_node_default, with_pdserve_image
from pdserve.operator import metrics
from pdserve.operator.cluster.cache import Body, ClusterCache, version_number
from pdserve.operator.cluster.kube import Kube, KubeError, NotLeader
from pdserve.operator.cluster.nodes import NodeCache
from pdserve.operator.cluster.views import (
    PodView,
    gang_pass,
    lws_stand_in,
    pod_placements,
    pod_view,
    rfc3339,
    unreachable_messages,
)
from pdserve.operator.dataplane.routers import POLL_SECONDS, Draining, Routers
from pdserve.operator.reconcile.autoscaler import Autoscaler
from pdserve.operator.reconcile.passlog import PassRecord
from pdserve.operator.reconcile.steps import (
    APPLIED_HASH_ANNOTATION,
    Event,
    Outcome,
    Steps,
    Verified,
    annotation,
    drained_events,
    merged,
    owned_object_names,
    with_applied_hash,
)
from pdserve.routing import build_slot_table
from pdserve.routing.table import Role, RoutingTableError

if TYPE_CHECKING:  # loaded only when the operator traces
    from pdserve.operator.reconcile.tracing import PassTracer

log = logging.getLogger("pdserve.operator")

ROLES = (Role.PREFILL, Role.DECODE)


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
        autoscaler: Autoscaler | None = None,
        pdserve_image: str = DEFAULT_IMAGE,
        tracer: PassTracer | None = None,
    ) -> None:
        """``tracer``: the passes' spans when the operator traces (pdserve.operator.reconcile.tracing)."""
        self._kube = kube
        self._pdserve_image = pdserve_image
        self._tracer = tracer
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
        self._steps = Steps(kube, self._cache, self._io, clock)
        self._autoscaler = autoscaler or Autoscaler(kube)

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        self._events.shutdown(wait=True)

    def forget(self, namespace: str, name: str) -> None:
        self._verified.pop((namespace, name), None)

    def deployment_gone(self, namespace: str, name: str) -> None:
        self.forget(namespace, name)
        self._routers.forget((namespace, name))
        self._autoscaler.forget((namespace, name))

    def reconcile(self, namespace: str, name: str, full: bool = True) -> Outcome:
        """One pass; ``full=False`` (pod and router events) plans from memory when it can."""
        record = PassRecord(namespace, name, full) if self._tracer is not None else None
        with metrics.RECONCILE_SECONDS.time():
            outcome = self._reconcile(namespace, name, full, record)
        metrics.RECONCILES.labels(outcome.result).inc()
        if outcome.body is not None and outcome.events:
            self._events.submit(self._post_events, outcome.body, merged(outcome.events))
        if self._tracer is not None and record is not None:
            try:
                self._tracer.finished(record, outcome)
            except Exception:  # a span is a courtesy: never fail a pass for one
                log.exception("cannot record the spans of the reconcile of %s/%s", namespace, name)
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

    def _reconcile(self, namespace: str, name: str, full: bool, record: PassRecord | None) -> Outcome:
        key = (namespace, name)
        if self._cache.deleted(key):
            self.forget(namespace, name)
            return Outcome(
                "gone", record=record
            )  # owner references let the garbage collector remove the rest
        body = self._cache.deployment(key)
        pods = self._cache.pods(key)
        if not full and body is not None and pods is not None and key in self._verified:
            return self._run(dict(body), pods, self._verified[key], fresh=False, record=record)
        try:
            with record.step("read") if record is not None else contextlib.nullcontext():
                read = self._read(namespace, name, body)
        except KubeError as exc:
            metrics.RECONCILE_ERRORS.inc()
            log.warning("cannot read PDDeployment %s/%s or its pods: %s", namespace, name, exc)
            return Outcome("error", record=record)
        if read is None:
            self.forget(namespace, name)
            return Outcome("gone", record=record)
        verified = self._verified[key] = Verified()
        return self._run(read.body, read.pods, verified, True, read.prefetched, record)

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
                others = owned_object_names(parse_pddeployment(cached))
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
        if ((body.get("spec") or {}).get("multiNode") or {}).get("backend") == BACKEND_LWS:
            sets = self._kube.list_objects("LeaderWorkerSet", namespace, f"{DEPLOYMENT_LABEL}={name}")
            self._cache.replace_sets(key, sets)
        self._cache.replace_pods(key, items, version_number(version))
        return _Read(body, self._cache.pods(key) or [], prefetched)

    def _run(
        self,
        body: dict[str, Any],
        pods: Sequence[Body],
        verified: Verified,
        fresh: bool,
        prefetched: Mapping[tuple[str, str], Body | None] | None = None,
        record: PassRecord | None = None,
    ) -> Outcome:
        outcome = Outcome("ok", body=body, record=record)
        if record is not None:
            record.uid = str(body["metadata"].get("uid") or "")
            record.generation = int(body["metadata"].get("generation") or 0)
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
            pdd = with_pdserve_image(parse_pddeployment(body), self._pdserve_image)
        except SpecError as exc:
            outcome.result = "invalid"
            self._write_status(body, Observation(generation, None, (), 0, 0, problems=[str(exc)]), outcome)
            return

        now = self._clock()
        if pdd.spec.gpus_per_node is None and self._nodes.pending():
            # The nodes' GPU count decides how instances split over nodes: act once it is known.
            outcome.recheck_after = 1.0
            return
        allocatable = self._nodes.allocatable(pdd.spec.gpu_resource)
        written, pdd = pdd, with_node_default(pdd, allocatable)
        # Multi-node instances are the planner's units: one view per group (deployment/plan/gangs.py).
        # A LeaderWorkerSet whose leader pod is not there (yet, or while its controller restarts
        # the group) still stands for its group: no second one is created for the index.
        present = {p["metadata"]["name"] for p in raw_pods}
        stand_ins = [s for s in map(lws_stand_in, self._cache.sets((pdd.namespace, pdd.name))) if s]
        raw_pods = [*raw_pods, *(s for s in stand_ins if s["metadata"]["name"] not in present)]
        each_pod = self._observe_pods(pdd, raw_pods)
        gangs = gang_pass(each_pod, now, pdd.spec.multi_node.gang_timeout_seconds)
        pods = gangs.units
        found = spec_problems(written, allocatable)
        if found:
            # Nothing is rendered for a spec that cannot be served; existing objects stay as they are.
            outcome.result = "invalid"
            written = self._autoscaler.counts(written, body)
            roles = [self._role_observation(written, r, [p for p in pods if p.role is r]) for r in ROLES]
            self._write_status(body, Observation(generation, None, roles, 0, 0, problems=found), outcome)
            return

        # With spec.autoscaling the counts are the autoscaler's (it decides every syncPeriodSeconds).
        with outcome.step("autoscale") if pdd.spec.autoscaling else contextlib.nullcontext():
            pdd, scaling = self._autoscaler.scale(pdd, body, pods, raw_pods, now)
        outcome.events += scaling.events
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
            gangs = replace(gangs, forming=[])
        live = self._read_unverified(pdd, verified, prefetched)
        with outcome.step("drain"):
            pods = self._steps.drain(pdd, pods, plans, now, outcome)
        # The routing table first: it is what users wait for; then everything else at once.
        with outcome.step("routing_table"):
            table = self._steps.write_routing_table(pdd, pods, verified, live, outcome)
        poll = self._routers.table_written(
            pdd,
            table,
            [p.observed.name for p in pods if p.observed.draining and not p.observed.terminating],
            outcome.routing_written,
        )
        # Each step sends its calls now and returns a function that waits for the answers.
        placements = pod_placements(pdd, raw_pods, each_pod)  # largest first (deployment/plan/)
        # Deletes are answered before creates go out, so no more than instances + maxSurge pods
        # of a role ever exist undeleted, even for an instant (a pass may replace one pod by another).
        applying = time.time_ns()
        statics = self._steps.apply_static(pdd, verified, live, outcome)
        self._steps.retire_router(pdd, outcome)
        with outcome.step("delete_pods"):
            pods = self._steps.delete(pdd, pods, plans, gangs.broken, outcome)()
        with outcome.step("create_pods"):
            pods += self._steps.create(pdd, plans, outcome, placements)()
            self._steps.create_workers(pdd, gangs.forming, outcome)
        statics()
        if outcome.record is not None:
            outcome.record.add("apply_objects", applying)
        self._steps.ungate(pdd, raw_pods, placements, outcome)

        rechecks = [p.recheck_after for p in plans.values() if p.recheck_after is not None]
        if gangs.recheck_after is not None:  # a group's gang timeout ends
            rechecks.append(gangs.recheck_after)
        if poll or rechecks:  # drains waiting for the routers, or a router catching up
            rechecks.append(POLL_SECONDS)
        if scaling.recheck_after is not None:  # the autoscaler's next decision
            rechecks.append(scaling.recheck_after)
        outcome.recheck_after = min(rechecks) if rechecks else None
        outcome.events += drained_events(pdd, plans, verdicts, self._routers.left_generation)
        routers = self._routers.summary(pdd, table.generation)
        roles = [self._role_observation(pdd, r, [p for p in pods if p.role is r]) for r in ROLES]
        obs = Observation(
            generation,
            table.generation,
            roles,
            router_replicas=0 if pdd.spec.router.decode_sidecar else pdd.spec.router.replicas,
            router_available=self._cache.router_available((pdd.namespace, pdd.name)) or 0,
            unschedulable=unschedulable_messages(placements),
            unreachable=unreachable_messages(pods, pdd.spec.rollout.node_loss_seconds),
            unpaired=[u.describe() for u in build_slot_table(table).unpaired],
            routers=routers,
            replaced_groups=[f"group {u.observed.name}: {why}" for u, why in gangs.broken],
            autoscaling=scaling.status,
            scaling_limited=scaling.limited,
        )
        with outcome.step("status"):
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
            view = pod_view(pdd, pod, self._nodes.not_ready_since)
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
            if verified.applied.get((kind, name)) != annotation(
                with_applied_hash(desired), APPLIED_HASH_ANNOTATION
            ):
                wanted.append((kind, name))
        live = {kn: prefetched[kn] for kn in wanted if kn in prefetched}
        missing = [kn for kn in wanted if kn not in prefetched]
        bodies = self._io.map(lambda kn: self._kube.get(kn[0], pdd.namespace, kn[1]), missing)
        live.update(zip(missing, bodies, strict=True))
        return live

    def _role_observation(self, pdd: PDDeployment, role: Role, units: Sequence[PodView]) -> RoleObservation:
        rs = pdd.spec.role(role)
        groups = [u for u in units if u.members and not u.observed.terminating]
        return RoleObservation(
            role,
            rs.instances,
            rs.data_parallel,
            template_hash(pdd, role),
            selector_string(role_selector(pdd, role)),
            [u.observed for u in units],
            (sum(len(u.members) for u in groups), sum(u.ready_members for u in groups))
            if groups or pdd.spec.group_shape(role).multi_node
            else None,
        )

    # --- status and errors ---------------------------------------------------------------------

    def _write_status(self, body: dict[str, Any], obs: Observation, outcome: Outcome) -> None:
        previous = body.get("status") or {}
        status = compute_status(obs, previous, rfc3339(self._clock()))
        if outcome.record is not None:
            progressing = _condition(status, "Progressing")
            outcome.record.progressing = progressing.get("status") == "True"
            outcome.record.progress_reason = str(progressing.get("reason") or "")
            outcome.record.progressing_since = str(progressing.get("lastTransitionTime") or "")
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
                else rfc3339(self._clock()),
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


def _condition(status: Mapping[str, Any], kind: str) -> dict[str, Any]:
    for c in status.get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == kind:
            return dict(c)
    return {}
