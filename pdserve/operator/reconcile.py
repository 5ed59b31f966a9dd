"""One level-based reconcile of one PDDeployment: observe, plan, apply, report.

Everything is read back from the cluster on every run: the PDDeployment, its pods (readiness,
IP, template hash, the draining annotation), the routing ConfigMap and the router Deployment.
The decisions are the pure functions of :mod:`pdserve.deployment` (rendering, validation,
rollout planning, routing table, status); this module only performs them. Running it twice on an
unchanged cluster writes nothing, and a restarted operator continues a rollout where the
annotations say it stands.

Order inside one run, chosen so that the router never sends work to a pod being removed:

1. start and end drains (annotate pods), 2. write the routing table (drained pods are marked
``draining`` before anything is deleted), 3. create missing pods, 4. apply the Services and the
router, 5. delete pods whose drain is over, 6. patch the status if it changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pdserve.deployment.objects import (
    DEPLOYMENT_LABEL,
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
    desired_static_objects,
    instance_name,
    instance_pod,
    pod_parallel_sizes,
    role_selector,
    router_name,
    routing_configmap,
    routing_configmap_name,
    selector_string,
    template_hash,
)
from pdserve.deployment.rollout import ActionKind, ObservedPod, RolePlan, apply_drains, plan_role
from pdserve.deployment.routing import ObservedInstance, build_routing_table
from pdserve.deployment.spec import PDDeployment, SpecError, parse_pddeployment
from pdserve.deployment.status import Observation, RoleObservation, compute_status
from pdserve.deployment.validate import problems as spec_problems
from pdserve.operator import metrics
from pdserve.operator.kube import Kube, KubeError
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


class NodeGpus:
    """Allocatable GPUs per node, re-listed at most every ``ttl`` seconds (nodes change rarely)."""

    def __init__(self, kube: Kube, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._kube = kube
        self._ttl = ttl
        self._clock = clock
        self._nodes: list[dict[str, Any]] | None = None
        self._at = -ttl
        self._warned = False

    def allocatable(self, resource: str) -> list[int] | None:
        """None when the nodes cannot be read (the namespaced RBAC variant): the check is skipped."""
        if self._clock() - self._at >= self._ttl:
            try:
                self._nodes = self._kube.node_allocatable()
            except KubeError as exc:
                if not self._warned:
                    log.warning("cannot list nodes, skipping the per-node GPU check: %s", exc)
                    self._warned = True
                self._nodes = None
            self._at = self._clock()
        if self._nodes is None:
            return None
        return [_quantity(n.get(resource, 0)) for n in self._nodes]


@dataclass
class Verified:
    """What the last full reconcile of one PDDeployment read or wrote and found in place.

    A light reconcile (a pod event) trusts it and skips re-reading the Services, the router and
    the routing ConfigMap: it reads only the PDDeployment and its pods. Every full reconcile
    (spec change, router event, periodic resync) re-reads everything and repairs drift.
    """

    table: RoutingTable | None = None
    applied: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> applied hash
    router_available: int = 0


class Reconciler:
    def __init__(
        self, kube: Kube, nodes: NodeGpus | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._kube = kube
        self._nodes = nodes or NodeGpus(kube)
        self._clock = clock
        self._verified: dict[tuple[str, str], Verified] = {}
        # Independent calls of one pass (pod creates, the three static objects) go out together;
        # Events go out on their own thread, off the path from a readiness change to the table.
        self._io = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kube-io")
        self._events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        self._events.shutdown(wait=True)

    def forget(self, namespace: str, name: str) -> None:
        self._verified.pop((namespace, name), None)

    def reconcile(self, namespace: str, name: str, full: bool = True) -> Outcome:
        """One pass; ``full=False`` (pod events) trusts what the last full pass verified."""
        if full:
            self._verified[(namespace, name)] = Verified()
        with metrics.RECONCILE_SECONDS.time():
            outcome = self._reconcile(namespace, name)
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

    def _reconcile(self, namespace: str, name: str) -> Outcome:
        try:
            body = self._kube.get("PDDeployment", namespace, name)
        except KubeError as exc:
            metrics.RECONCILE_ERRORS.inc()
            log.warning("cannot read PDDeployment %s/%s: %s", namespace, name, exc)
            return Outcome("error")
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return Outcome("gone")  # owner references let the garbage collector remove the rest
        outcome = Outcome("ok", body=body)
        try:
            self._reconcile_object(body, outcome)
        except (KubeError, RoutingTableError, ValueError) as exc:
            metrics.RECONCILE_ERRORS.inc()
            log.exception("reconcile of %s/%s failed", namespace, name)
            outcome.result = "error"
            self.forget(namespace, name)  # the next pass reads everything again
            self._report_error(body, outcome, str(exc))
        return outcome

    # --- the steps -----------------------------------------------------------------------------

    def _reconcile_object(self, body: dict[str, Any], outcome: Outcome) -> None:
        meta = body["metadata"]
        generation = int(meta.get("generation") or 0)
        try:
            pdd = parse_pddeployment(body)
        except SpecError as exc:
            outcome.result = "invalid"
            self._write_status(body, Observation(generation, None, (), 0, 0, problems=[str(exc)]), outcome)
            return

        pods = self._observe_pods(pdd)
        found = spec_problems(pdd, self._nodes.allocatable(pdd.spec.gpu_resource))
        if found:
            # Nothing is rendered for a spec that cannot be served; existing objects stay as they are.
            outcome.result = "invalid"
            roles = [self._role_observation(pdd, r, [p.observed for p in pods if p.role is r]) for r in ROLES]
            self._write_status(body, Observation(generation, None, roles, 0, 0, problems=found), outcome)
            return

        now = self._clock()
        plans = {
            role: plan_role(
                role,
                instances=pdd.spec.role(role).instances,
                template_hash=template_hash(pdd, role),
                pods=[p.observed for p in pods if p.role is role],
                max_unavailable=pdd.spec.rollout.max_unavailable,
                drain_seconds=pdd.spec.rollout.drain_seconds,
                now=now,
            )
            for role in ROLES
        }
        verified = self._verified.setdefault((pdd.namespace, pdd.name), Verified())
        pods = self._drain(pdd, pods, plans, now, outcome)
        table = self._write_routing_table(pdd, pods, verified, outcome)
        pods = self._create(pdd, pods, plans, outcome)  # first: scheduling them takes longest
        self._apply_static(pdd, verified, outcome)
        pods = self._delete(pdd, pods, plans, outcome)

        rechecks = [p.recheck_after for p in plans.values() if p.recheck_after is not None]
        outcome.recheck_after = min(rechecks) if rechecks else None
        roles = [self._role_observation(pdd, r, [p.observed for p in pods if p.role is r]) for r in ROLES]
        obs = Observation(
            generation,
            table.generation,
            roles,
            router_replicas=pdd.spec.router.replicas,
            router_available=verified.router_available,
        )
        self._write_status(body, obs, outcome)

    def _observe_pods(self, pdd: PDDeployment) -> list[PodView]:
        # Instance pods only (the router's pods carry no role label).
        items = self._kube.list_objects("Pod", pdd.namespace, f"{DEPLOYMENT_LABEL}={pdd.name},{ROLE_LABEL}")
        views = []
        for pod in items:
            view = _pod_view(pdd, pod)
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

    def _drain(
        self,
        pdd: PDDeployment,
        pods: list[PodView],
        plans: Mapping[Role, RolePlan],
        now: float,
        outcome: Outcome,
    ) -> list[PodView]:
        stamp = _rfc3339(now, fraction=True)
        for plan in plans.values():
            for action in plan.actions:
                if action.kind not in (ActionKind.DRAIN, ActionKind.UNDRAIN):
                    continue
                pod_name = instance_name(pdd, action.role, action.index)
                value = stamp if action.kind is ActionKind.DRAIN else None
                self._kube.merge_patch(
                    "Pod",
                    pdd.namespace,
                    pod_name,
                    {"metadata": {"annotations": {DRAINING_ANNOTATION: value}}},
                )
                if action.kind is ActionKind.DRAIN:
                    message = (
                        f"Draining pod {pod_name} ({action.reason}): out of the routing table, "
                        f"deleted after {pdd.spec.rollout.drain_seconds}s"
                    )
                    outcome.events.append(Event("Normal", "Draining", message))
                else:
                    outcome.events.append(Event("Normal", "Undrained", f"Pod {pod_name} is wanted again"))
        out = []
        for view in pods:
            (observed,) = apply_drains([view.observed], plans[view.role], now)
            out.append(replace(view, observed=observed))
        return out

    def _write_routing_table(
        self, pdd: PDDeployment, pods: Sequence[PodView], verified: Verified, outcome: Outcome
    ) -> RoutingTable:
        observed = [
            ObservedInstance(
                role=p.role,
                index=p.observed.index,
                pod_name=p.observed.name,
                pod_ip=p.ip,
                ready=p.observed.ready,
                draining=p.observed.draining or p.observed.terminating,
                dp_size=p.observed.dp_size,
                tp_size=p.tp_size,
            )
            for p in pods
        ]
        previous = verified.table
        stripped = False  # someone removed our labels or owner reference: write it again
        if previous is None:
            live = self._kube.get("ConfigMap", pdd.namespace, routing_configmap_name(pdd))
            previous = _stored_table(live)
            stripped = previous is not None and not _owned_like(live, routing_configmap(pdd, previous))
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

    def _apply_static(self, pdd: PDDeployment, verified: Verified, outcome: Outcome) -> None:
        """Services and the router Deployment; records the router's availability."""
        todo = []
        for desired in desired_static_objects(pdd):
            stamped = _with_applied_hash(desired)
            kind, name = desired["kind"], desired["metadata"]["name"]
            wanted = _annotation(stamped, APPLIED_HASH_ANNOTATION) or ""
            if verified.applied.get((kind, name)) != wanted:
                todo.append((stamped, desired, kind, name, wanted))
        for (_, _, kind, name, wanted), (live, verb) in zip(
            todo, self._io.map(lambda t: self._sync_static(pdd, t[0], t[1]), todo), strict=True
        ):
            if verb is not None:
                metrics.OBJECT_CHANGES.labels(kind, verb.lower()).inc()
                outcome.events.append(Event("Normal", verb, f"{verb} {kind} {name}"))
            verified.applied[(kind, name)] = wanted
            if kind == "Deployment" and name == router_name(pdd):
                verified.router_available = int(
                    ((live or {}).get("status") or {}).get("availableReplicas") or 0
                )

    def _sync_static(
        self, pdd: PDDeployment, stamped: dict[str, Any], desired: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, str | None]:
        """Apply one object unless it is already as wanted; returns it and what was done."""
        live = self._kube.get(stamped["kind"], pdd.namespace, stamped["metadata"]["name"])
        if (
            live is not None
            and _annotation(live, APPLIED_HASH_ANNOTATION) == _annotation(stamped, APPLIED_HASH_ANNOTATION)
            and _owned_like(live, desired)
        ):
            return live, None
        verb = "Created" if live is None else "Updated"
        return self._kube.apply(stamped), verb

    def _delete(
        self, pdd: PDDeployment, pods: list[PodView], plans: Mapping[Role, RolePlan], outcome: Outcome
    ) -> list[PodView]:
        by_key = {(p.role, p.observed.index): p for p in pods}
        for plan in plans.values():
            for action in plan.of(ActionKind.DELETE):
                view = by_key[(action.role, action.index)]
                if self._kube.delete("Pod", pdd.namespace, view.observed.name, uid=view.uid):
                    metrics.OBJECT_CHANGES.labels("Pod", "delete").inc()
                    outcome.events.append(
                        Event("Normal", "Deleted", f"Deleted pod {view.observed.name} ({action.reason})")
                    )
                by_key[(action.role, action.index)] = replace(
                    view, observed=replace(view.observed, terminating=True)
                )
        return list(by_key.values())

    def _create(
        self, pdd: PDDeployment, pods: list[PodView], plans: Mapping[Role, RolePlan], outcome: Outcome
    ) -> list[PodView]:
        out = list(pods)
        todo = [(role, a) for role, plan in plans.items() for a in plan.of(ActionKind.CREATE)]
        manifests = [instance_pod(pdd, role, a.index) for role, a in todo]
        for (role, action), manifest, created in zip(
            todo, manifests, self._io.map(self._kube.create, manifests), strict=True
        ):
            name = manifest["metadata"]["name"]
            if created is not None:
                metrics.OBJECT_CHANGES.labels("Pod", "create").inc()
                outcome.events.append(Event("Normal", "Created", f"Created pod {name} ({action.reason})"))
            rs = pdd.spec.role(role)
            observed = ObservedPod(
                action.index, name, template_hash(pdd, role), False, dp_size=rs.data_parallel
            )
            out.append(PodView(role, observed, "", None, rs.tensor_parallel))
        return out

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
        self._kube.merge_patch("PDDeployment", meta["namespace"], meta["name"], {"status": status}, "status")
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


def _merged(events: Sequence[Event]) -> list[Event]:
    """One Event per (type, reason) and pass: creating a deployment is one Created, not seven."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for e in events:
        grouped.setdefault((e.type, e.reason), []).append(e.message)
    return [Event(t, r, "; ".join(messages)) for (t, r), messages in grouped.items()]


def _pod_view(pdd: PDDeployment, pod: Mapping[str, Any]) -> PodView | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        role = Role(labels.get(ROLE_LABEL, ""))
        index = int(labels.get(INSTANCE_LABEL, ""))
    except ValueError:
        return None
    name = meta.get("name", "")
    if name != instance_name(pdd, role, index):
        return None
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
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
    )
    return PodView(role, observed, str(meta.get("uid", "")), status.get("podIP") or None, tp_size)


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


def _quantity(value: object) -> int:
    """GPU counts are whole numbers; anything else (a malformed quantity) counts as none."""
    try:
        return int(str(value))
    except ValueError:
        return 0
