"""The PDDeployment status, computed from one observation of the cluster.

Pure: the shell gathers the pods, the routing-table generation, the spec problems and the
router's readiness, and patches the result only when it differs from what is stored. Condition
``lastTransitionTime`` moves only when a condition's status flips, as Kubernetes convention
asks, so an unchanged world produces a byte-identical status and no write.

``routingGeneration`` is the generation the operator last wrote; ``servedGeneration`` the oldest
one any Ready router serves (null when none answers), and ``routers`` counts the Ready router
pods and those serving the written generation (``current``), as the routers last told the
operator (pdserve.operator.dataplane.routers).

Conditions:

* ``Ready``: every wanted instance of both roles is up to date and routable, nothing surplus is
  left, and the router has an available replica: the deployment serves at its declared size.
* ``Progressing``: the operator is still moving the cluster towards the spec (creating, rolling,
  scaling). False once Ready, and False while the spec is invalid (nothing will move).
* ``ScalingLimited`` (with ``spec.autoscaling`` only), as HPA's: True when the autoscaler wanted
  more than ``maxInstances`` (``TooManyInstances``), less than ``minInstances``
  (``TooFewInstances``), or stopped asking because pods cannot be placed
  (``InsufficientResources``, naming the resource); False (``DesiredWithinRange``) otherwise.
* ``Degraded``: the spec cannot be served as written (problems beyond the schema), the last
  reconcile failed, a pod's node is NotReady (reason ``NodeNotReady``: since when, and when the
  pod is replaced), or the scheduler cannot place a pod (reason ``PodsUnschedulable``, with the
  scheduler's own message); the message says what to fix.

Per role, like a Deployment's rollout status: ``instances`` (pods that exist, surge included),
``readyInstances`` (routable pods), ``updatedInstances`` (on the current template),
``availableInstances`` (wanted indices served by a routable pod, old template or new) and
``unreachableInstances`` (pods on NotReady nodes). An instance that spans nodes is one group of
pods and counts once; such roles also show ``pods`` and ``readyPods``, and
``lastGroupReplacement`` says when and why a group was last deleted whole (a member failed or
went away, or the gang timeout passed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.deployment.plan.drain import RoutersSummary
from pdserve.deployment.plan.rollout import ObservedPod
from pdserve.routing.table import Role

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class RoleObservation:
    role: Role
    instances: int  # wanted, from the spec
    data_parallel: int  # slots per instance, from the spec (a pod's own dp_size wins for readySlots)
    template_hash: str
    selector: str  # label selector of the role's pods, for the scale subresource / HPA
    pods: Sequence[ObservedPod]  # one per instance: a multi-node group is one unit
    #: Multi-node roles: (pods, Ready pods) of every group, counted per pod; None: one pod each.
    group_pods: tuple[int, int] | None = None


@dataclass(frozen=True)
class RoleStatus:
    role: Role
    wanted: int
    instances: int  # pods that exist and are not terminating
    ready_instances: int  # routable: Ready, not draining, not terminating, on a Ready node
    updated_instances: int  # existing pods with the current template hash
    available_instances: int  # wanted indices served by a routable pod, of any template
    unreachable_instances: int  # pods whose node is NotReady (replaced after rollout.nodeLossSeconds)
    slots: int  # wanted slots: instances x dataParallel of the spec
    ready_slots: int
    surplus: int  # pods past the wanted count still around
    selector: str
    template_hash: str
    group_pods: tuple[int, int] | None = None

    @property
    def converged(self) -> bool:
        return (
            self.ready_instances == self.wanted
            and self.updated_instances == self.wanted
            and self.instances == self.wanted
            and self.surplus == 0
        )

    def to_dict(self) -> dict[str, Any]:
        """``status.<role>``: the :data:`SHOWN` fields, ``summary``, and ``pods``/``readyPods``
        for a multi-node role."""
        out: dict[str, Any] = {_camel_case(name): getattr(self, name) for name in SHOWN}
        out["summary"] = f"{self.ready_instances}/{self.wanted}"
        if self.group_pods:
            out["pods"], out["readyPods"] = self.group_pods
        return out


#: The fields of :class:`RoleStatus` that ``status.<role>`` shows as they are, each under its
#: name in camelCase (the CRD's schema lists the same keys).
SHOWN = (
    "instances",
    "ready_instances",
    "updated_instances",
    "available_instances",
    "unreachable_instances",
    "slots",
    "ready_slots",
    "selector",
    "template_hash",
)


def _camel_case(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def role_status(obs: RoleObservation) -> RoleStatus:
    live = [p for p in obs.pods if not p.terminating]
    # Old-template pods still serve during a rollout: they count as ready, not as updated.
    serving = [p for p in live if p.routable]
    return RoleStatus(
        role=obs.role,
        wanted=obs.instances,
        instances=len(live),
        ready_instances=len(serving),
        updated_instances=sum(
            1 for p in live if p.template_hash == obs.template_hash and p.index < obs.instances
        ),
        available_instances=len({p.index for p in serving if p.index < obs.instances}),
        unreachable_instances=sum(1 for p in live if p.node_down_since is not None),
        slots=obs.instances * obs.data_parallel,
        # What runs: mid-rollout from DP4 to DP8, an old pod serves 4 slots, a new one 8.
        ready_slots=sum(obs.data_parallel if p.dp_size is None else p.dp_size for p in serving),
        surplus=sum(1 for p in live if p.index >= obs.instances),
        selector=obs.selector,
        template_hash=obs.template_hash,
        group_pods=obs.group_pods,
    )


@dataclass(frozen=True)
class Observation:
    """Everything the status is computed from."""

    generation: int
    routing_generation: int | None
    roles: Sequence[RoleObservation]
    router_replicas: int
    router_available: int
    problems: Sequence[str] = ()  # spec problems beyond the schema: nothing is rendered
    error: str | None = None  # the last reconcile failed with this
    unschedulable: Sequence[str] = ()  # pods the scheduler cannot place, with its message
    unreachable: Sequence[str] = ()  # pods on NotReady nodes, since when, and when they are replaced
    unpaired: Sequence[str] = ()  # revisions routable on one side only: their slots take no traffic
    routers: RoutersSummary | None = None  # what the Ready routers serve; None: not asked yet
    #: Multi-node groups deleted whole in this pass, and why (kept as ``lastGroupReplacement``).
    replaced_groups: Sequence[str] = ()
    #: With spec.autoscaling: ``status.autoscaling`` (plan/scaling.py) and condition ScalingLimited
    #: as (status, reason, message); None: no autoscaler (both are left out, an old one removed).
    autoscaling: Mapping[str, Any] | None = None
    scaling_limited: tuple[bool, str, str] | None = None


def compute_status(obs: Observation, previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """The whole ``status`` object; ``previous`` is the stored one (for lastTransitionTime)."""
    roles = [role_status(r) for r in obs.roles]
    status: dict[str, Any] = {"observedGeneration": obs.generation}
    if obs.routing_generation is not None:
        status["routingGeneration"] = obs.routing_generation
    elif previous and "routingGeneration" in previous:
        status["routingGeneration"] = previous["routingGeneration"]
    if obs.routers is not None:
        # null (removed by the merge patch) while no Ready router answers.
        status["servedGeneration"] = obs.routers.served_generation
        status["routers"] = obs.routers.to_status()
    elif previous:
        status.update({k: previous[k] for k in ("servedGeneration", "routers") if k in previous})
    for r in roles:
        status[r.role.value] = r.to_dict()
    if obs.autoscaling is not None:
        status["autoscaling"] = dict(obs.autoscaling)
    elif previous and previous.get("autoscaling") is not None:
        status["autoscaling"] = None  # the merge patch removes it: autoscaling was turned off
    if obs.replaced_groups:
        status["lastGroupReplacement"] = {"time": now, "message": "; ".join(obs.replaced_groups)}
    elif previous and "lastGroupReplacement" in previous:
        status["lastGroupReplacement"] = previous["lastGroupReplacement"]
    old = {c.get("type"): c for c in (previous or {}).get("conditions", []) if isinstance(c, Mapping)}
    status["conditions"] = [
        _condition(kind, state, reason, message, obs.generation, old.get(kind), now)
        for kind, (state, reason, message) in zip(CONDITION_TYPES, _conditions(obs, roles), strict=True)
    ]
    if obs.scaling_limited is not None:
        state, reason, message = obs.scaling_limited
        previous_limit = old.get("ScalingLimited")
        status["conditions"].append(
            _condition("ScalingLimited", state, reason, message, obs.generation, previous_limit, now)
        )
    return status


def _conditions(obs: Observation, roles: Sequence[RoleStatus]) -> list[tuple[bool, str, str]]:
    if obs.problems:
        message = "; ".join(obs.problems)
        return [
            (False, "InvalidSpec", "the spec cannot be served as written, nothing was rendered"),
            (False, "InvalidSpec", "waiting for a corrected spec"),
            (True, "InvalidSpec", message),
        ]
    router_ok = obs.router_available >= min(obs.router_replicas, 1)
    converged = all(r.converged for r in roles) and router_ok
    if converged:
        ready = (True, "AllInstancesReady", _summary(roles))
        progressing = (False, "Complete", "every instance runs the current template")
    else:
        ready = (False, _not_ready_reason(roles, router_ok), _summary(roles) + _router_note(obs, router_ok))
        reason, message = _progress(roles, router_ok)
        progressing = (True, reason, "; ".join([message, *obs.unpaired]))
    if obs.error:
        degraded = (True, "ReconcileError", obs.error)
    elif obs.unreachable:
        degraded = (True, "NodeNotReady", "; ".join(obs.unreachable))
    elif obs.unschedulable:
        degraded = (True, "PodsUnschedulable", "; ".join(obs.unschedulable))
    else:
        degraded = (False, "AsExpected", "")
    return [ready, progressing, degraded]


def _summary(roles: Sequence[RoleStatus]) -> str:
    return ", ".join(
        f"{r.role.value} {r.ready_instances}/{r.wanted} instances ({r.ready_slots}/{r.slots} slots) ready"
        for r in roles
    )


def _router_note(obs: Observation, router_ok: bool) -> str:
    return "" if router_ok else f"; router {obs.router_available}/{obs.router_replicas} available"


def _not_ready_reason(roles: Sequence[RoleStatus], router_ok: bool) -> str:
    if any(r.updated_instances < r.wanted and r.instances >= r.wanted for r in roles):
        return "RollingOut"
    if any(r.surplus for r in roles):
        return "ScalingDown"
    if any(r.ready_instances < r.wanted for r in roles):
        return "InstancesNotReady"
    return "RouterNotReady" if not router_ok else "InstancesNotReady"


def _progress(roles: Sequence[RoleStatus], router_ok: bool) -> tuple[str, str]:
    parts = []
    for r in roles:
        if r.converged:
            continue
        bits = []
        if r.updated_instances < r.wanted:
            bits.append(f"{r.updated_instances}/{r.wanted} updated")
        if r.ready_instances < r.wanted:
            bits.append(f"{r.ready_instances}/{r.wanted} ready")
        if r.available_instances < r.wanted:
            bits.append(f"{r.available_instances}/{r.wanted} available")
        if r.unreachable_instances:
            bits.append(f"{r.unreachable_instances} on NotReady nodes")
        extra = r.instances - r.wanted - r.surplus - r.unreachable_instances
        if extra > 0:
            bits.append(f"{extra} surge")
        if r.surplus:
            bits.append(f"{r.surplus} to remove")
        parts.append(f"{r.role.value}: " + ", ".join(bits or ["settling"]))
    if not router_ok:
        parts.append("router: not available yet")
    return _not_ready_reason(roles, router_ok), "; ".join(parts)


def _condition(
    kind: str,
    state: bool,
    reason: str,
    message: str,
    generation: int,
    previous: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    status = "True" if state else "False"
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == status else None
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since or now,
    }
