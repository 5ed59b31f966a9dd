"""The writes of one pass, in the order reconciler.py calls them: drain marks, the routing table,
the static objects, pod deletes and creates, scheduling gates. Each step sends its calls at once
on the shared I/O pool; the ones whose answers a later step needs return a function that waits.
What to do was decided by the pure planners of :mod:`pdserve.deployment`; this only does it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.deployment.plan.drain import DrainVerdict
from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.plan.rollout import Action, ActionKind, ObservedPod, RolePlan, apply_drains
from pdserve.deployment.plan.scheduling import GATE, Placement, gate_new, placement_of, to_ungate, with_gate
from pdserve.deployment.render.engine_pod import template_hash
from pdserve.deployment.render.groups import group_pods, group_shape_of, instance_lws
from pdserve.deployment.render.names import (
    DEPLOYMENT_LABEL,
    GROUP_FORMED_ANNOTATION,
    router_name,
    routing_configmap_name,
)
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table, routing_configmap
from pdserve.deployment.render.static_objects import desired_static_objects
from pdserve.deployment.spec.multinode import BACKEND_LWS
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.operator import metrics
from pdserve.operator.cluster.cache import Body, ClusterCache
from pdserve.operator.cluster.kube import Kube
from pdserve.operator.cluster.views import DRAINING_ANNOTATION, PodView, rfc3339
from pdserve.operator.reconcile.passlog import PassRecord
from pdserve.routing.table import CONFIGMAP_KEY, Role, RoutingTable, RoutingTableError, load_routing_table

log = logging.getLogger("pdserve.operator")

APPLIED_HASH_ANNOTATION = "pdserve.io/applied-hash"
#: Kubernetes' generateName alphabet: no vowels (no words), no look-alikes.
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


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
    #: The pass's steps and times when the operator traces (pdserve.operator.reconcile.tracing), else None.
    record: PassRecord | None = None

    def step(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Times ``name`` into the record (nothing when not tracing)."""
        return self.record.step(name) if self.record is not None else contextlib.nullcontext()


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


class Steps:
    """The API calls of a pass; shares the reconciler's client, cache and I/O pool."""

    def __init__(
        self, kube: Kube, cache: ClusterCache, io: ThreadPoolExecutor, clock: Callable[[], float]
    ) -> None:
        self._kube = kube
        self._cache = cache
        self._io = io
        self._clock = clock

    def drain(
        self,
        pdd: PDDeployment,
        pods: list[PodView],
        plans: Mapping[Role, RolePlan],
        now: float,
        outcome: Outcome,
    ) -> list[PodView]:
        stamp = rfc3339(now, fraction=True)
        actions = [
            a
            for plan in plans.values()
            for a in plan.actions
            if a.kind in (ActionKind.DRAIN, ActionKind.UNDRAIN)
        ]

        leader_pods = {v.observed.name: v.leader_pod or v.observed.name for v in pods}

        def mark(action: Action) -> dict[str, Any]:
            value = stamp if action.kind is ActionKind.DRAIN else None
            patch = {"metadata": {"annotations": {DRAINING_ANNOTATION: value}}}
            return self._kube.merge_patch(
                "Pod", pdd.namespace, leader_pods.get(action.pod, action.pod), patch
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

    def write_routing_table(
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
                endpoints=p.endpoints,
            )
            for p in pods
        ]
        previous = verified.table
        stripped = False  # someone removed our labels or owner reference: write it again
        if previous is None:
            stored = live.get(("ConfigMap", routing_configmap_name(pdd)))
            previous = stored_table(stored)
            stripped = previous is not None and not owned_like(stored, routing_configmap(pdd, previous))
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

    def retire_router(self, pdd: PDDeployment, outcome: Outcome) -> None:
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

    def apply_static(
        self,
        pdd: PDDeployment,
        verified: Verified,
        live: Mapping[tuple[str, str], Body | None],
        outcome: Outcome,
    ) -> Callable[[], None]:
        """Services and the router Deployment; the router's answer feeds its availability."""
        todo = []
        for desired in desired_static_objects(pdd):
            stamped = with_applied_hash(desired)
            kind, name = desired["kind"], desired["metadata"]["name"]
            wanted = annotation(stamped, APPLIED_HASH_ANNOTATION) or ""
            if verified.applied.get((kind, name)) != wanted:
                todo.append((stamped, desired, kind, name, wanted))
        answers = self._io.map(lambda t: self.sync_static(pdd, t[0], t[1], live), todo)

        def finish() -> None:
            for (_, _, kind, name, wanted), (body, verb) in zip(todo, answers, strict=True):
                if verb is not None:
                    metrics.OBJECT_CHANGES.labels(kind, verb.lower()).inc()
                    outcome.events.append(Event("Normal", verb, f"{verb} {kind} {name}"))
                verified.applied[(kind, name)] = wanted
                if kind == "Deployment" and name == router_name(pdd) and body is not None:
                    self._cache.router_event("GET", body)

        return finish

    def sync_static(
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
            and annotation(current, APPLIED_HASH_ANNOTATION) == annotation(stamped, APPLIED_HASH_ANNOTATION)
            and owned_like(current, desired)
        ):
            return current, None
        verb = "Created" if current is None else "Updated"
        return self._kube.apply(stamped), verb

    def delete(
        self,
        pdd: PDDeployment,
        pods: list[PodView],
        plans: Mapping[Role, RolePlan],
        broken: Sequence[tuple[PodView, str]],
        outcome: Outcome,
    ) -> Callable[[], list[PodView]]:
        """Deletes the pods whose drain is over (every pod of a group) and the broken groups;
        the views come back marked terminating, the broken groups' not at all."""
        by_name = {p.observed.name: p for p in pods}
        actions = [a for plan in plans.values() for a in plan.of(ActionKind.DELETE)]
        units = [by_name[a.pod] for a in actions] + [unit for unit, _ in broken]
        # A LeaderWorkerSet goes with its pods: deleted at once, they cannot linger as a unit.
        targets = [("LeaderWorkerSet", u.observed.name, "") for u in units if u.lws]
        targets += [("Pod", name, uid) for u in units for name, uid in u.pod_refs]

        def delete(target: tuple[str, str, str]) -> dict[str, Any] | None:
            kind, name, uid = target
            return self._kube.delete(kind, pdd.namespace, name, uid=uid or None)

        answers = dict(zip(targets, self._io.map(delete, targets), strict=True))
        for kind, name, _ in targets:
            if kind == "LeaderWorkerSet":  # gone or going: it no longer stands for a group
                labels = {DEPLOYMENT_LABEL: pdd.name}
                self._cache.set_event(
                    "DELETED", {"metadata": {"namespace": pdd.namespace, "name": name, "labels": labels}}
                )

        def finish() -> list[PodView]:
            for (kind, _, _), answer in answers.items():
                if answer is not None:
                    metrics.OBJECT_CHANGES.labels(kind, "delete").inc()

                    if answer.get("kind") == "Pod":
                        self._cache.pod_event("MODIFIED", answer)
            for action in actions:
                view = by_name[action.pod]
                if any(answers.get(("Pod", *t)) is not None for t in view.pod_refs):
                    if action.node_lost:
                        metrics.NODE_LOSS_REPLACEMENTS.inc()
                        message = (
                            f"Pod {action.pod} on node {view.node or '?'} replaced ({action.reason}; "
                            f"rollout.nodeLossSeconds is {pdd.spec.rollout.node_loss_seconds}): deleted, "
                            "it may stay Terminating until the node returns"
                        )
                        outcome.events.append(Event("Warning", "NodeLost", message))
                    else:
                        message = f"Deleted {_what(view)} ({action.reason})"
                        outcome.events.append(Event("Normal", "Deleted", message))
                by_name[action.pod] = replace(view, observed=replace(view.observed, terminating=True))
            for unit, reason in broken:
                metrics.GROUP_REPLACEMENTS.inc()
                message = f"Replacing the group of {unit.observed.name} ({reason}): deleted {_what(unit)}"
                outcome.events.append(Event("Warning", "GroupReplaced", message))
            return list(by_name.values())

        return finish

    def create(
        self,
        pdd: PDDeployment,
        plans: Mapping[Role, RolePlan],
        outcome: Outcome,
        placements: Sequence[Placement] = (),
    ) -> Callable[[], list[PodView]]:
        """Creates the missing pods, smaller ones gated while larger ones wait; the new views come back."""
        todo = [(role, a) for role, plan in plans.items() for a in plan.of(ActionKind.CREATE)]
        # A multi-node instance starts as its leader, whose workers follow once it has an address,
        # or as a LeaderWorkerSet (backend lws), whose controller creates the pods.
        manifests = [_first_object(pdd, role, a.index, pod_suffix()) for role, a in todo]
        pods = [m for m in manifests if m["kind"] == "Pod"]
        gated = gate_new([placement_of(m, pdd.spec.gpu_resource) for m in pods], placements)
        manifests = [with_gate(m) if m["metadata"]["name"] in gated else m for m in manifests]
        answers = self._io.map(self._kube.create, manifests)
        born = self._clock()

        def finish() -> list[PodView]:
            out = []
            for (role, action), manifest, created in zip(todo, manifests, answers, strict=True):
                name, kind = manifest["metadata"]["name"], manifest["kind"]
                metrics.OBJECT_CHANGES.labels(kind, "create").inc()
                what = "pod" if kind == "Pod" else kind
                outcome.events.append(Event("Normal", "Created", f"Created {what} {name} ({action.reason})"))
                if kind != "Pod":  # a LeaderWorkerSet: it stands for its group until its pods show up
                    self._cache.set_event("ADDED", created)
                    continue
                self._cache.pod_event("ADDED", created)
                rs = pdd.spec.role(role)
                if group_shape_of(pdd, role).multi_node:
                    continue  # a group's leader: the next pass sees it as a forming group
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

    def create_workers(
        self, pdd: PDDeployment, forming: Sequence[tuple[PodView, tuple[int, ...]]], outcome: Outcome
    ) -> None:
        """The worker pods of groups whose leader has an address, then the leader's ``formed``
        mark (from then on a missing worker means the group is broken, not forming)."""
        todo = [
            (unit, ranks)
            for unit, ranks in forming
            if unit.observed.template_hash == template_hash(pdd, unit.role) and unit.ip
        ]  # a group of an older template is replaced, not completed
        per_unit = []
        for unit, ranks in todo:
            suffix = unit.observed.name.rsplit("-", 1)[1]
            rendered = group_pods(pdd, unit.role, unit.observed.index, suffix, unit.ip)
            per_unit.append([rendered[r] for r in ranks])
        manifests = [m for ms in per_unit for m in ms]
        for created in self._io.map(self._kube.create, manifests):
            self._cache.pod_event("ADDED", created)
            metrics.OBJECT_CHANGES.labels("Pod", "create").inc()

        def mark(unit: PodView) -> dict[str, Any]:
            stamp = {GROUP_FORMED_ANNOTATION: rfc3339(self._clock())}
            patch = {"metadata": {"annotations": stamp}}
            return self._kube.merge_patch("Pod", pdd.namespace, unit.observed.name, patch)

        units = [unit for unit, _ in todo]
        for unit, workers, patched in zip(units, per_unit, self._io.map(mark, units), strict=True):
            self._cache.pod_event("MODIFIED", patched)
            names = ", ".join(m["metadata"]["name"] for m in workers)
            message = f"Created pods {names} (workers of {unit.observed.name}, leader at {unit.ip})"
            outcome.events.append(Event("Normal", "Created", message))

    def ungate(
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


# --- pure helpers --------------------------------------------------------------------------------


def _first_object(pdd: PDDeployment, role: Role, index: int, suffix: str) -> dict[str, Any]:
    if group_shape_of(pdd, role).multi_node and pdd.spec.multi_node.backend == BACKEND_LWS:
        return instance_lws(pdd, role, index, suffix)
    return group_pods(pdd, role, index, suffix, None)[0]


def _what(view: PodView) -> str:
    names = [name for name, _ in view.pod_refs]
    return f"pod {names[0]}" if len(names) == 1 else f"pods {', '.join(names)}"


def pod_suffix() -> str:
    """A new pod's unique name suffix; 27**5 names per index make a clash (a 409) negligible."""
    return "".join(secrets.choice(_SUFFIX_ALPHABET) for _ in range(5))


def drained_events(
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


def merged(events: Sequence[Event]) -> list[Event]:
    """One Event per (type, reason) and pass: creating a deployment is one Created, not seven."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for e in events:
        grouped.setdefault((e.type, e.reason), []).append(e.message)
    return [Event(t, r, "; ".join(messages)) for (t, r), messages in grouped.items()]


def owned_object_names(pdd: PDDeployment) -> list[tuple[str, str]]:
    """(kind, name) of the routing ConfigMap, the Services and the router."""
    return [("ConfigMap", routing_configmap_name(pdd))] + [
        (o["kind"], o["metadata"]["name"]) for o in desired_static_objects(pdd)
    ]


def stored_table(configmap: Mapping[str, Any] | None) -> RoutingTable | None:
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


def owned_like(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """The live object still carries our labels and owner reference (nobody stripped them)."""
    if live is None:
        return False
    lm, dm = live.get("metadata") or {}, desired["metadata"]
    labels = lm.get("labels") or {}
    if any(labels.get(k) != v for k, v in dm.get("labels", {}).items()):
        return False
    owners = {o.get("uid") for o in lm.get("ownerReferences") or []}
    return all(o["uid"] in owners for o in dm.get("ownerReferences", []))


def with_applied_hash(obj: Mapping[str, Any]) -> dict[str, Any]:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    out = json.loads(text)
    out["metadata"].setdefault("annotations", {})[APPLIED_HASH_ANNOTATION] = digest
    return dict(out)


def annotation(obj: Mapping[str, Any] | None, key: str) -> str | None:
    if not obj:
        return None
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    return str(value) if value is not None else None
