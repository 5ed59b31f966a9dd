"""Rollout planning for one role: which pods to create, drain, undrain or delete now.

Pure and level-based: the plan depends only on what the cluster shows (pods, their instance
index and template hash, readiness, the ``pdserve.io/draining-since`` annotation, deletion
timestamps, whether the scheduler could place them, since when their node has been NotReady)
and the clock, never on the operator's memory. A restarted operator (or a new leader) therefore
picks up a rollout where the cluster says it is, and running the planner twice on the same
observation gives the same plan.

Pods have unique names (``<deployment>-<role>-<index>-<suffix>``); the instance index is a label.
So a replacement can start while the pod it replaces still exists (surge, or a pod stuck
Terminating on a lost node), and several pods may carry one index for a while. Of those, at most
one is routable once a pass has run: the *keeper*, the best pod with the current template.

Rules, per role (prefill and decode are planned separately, so a prefill rollout never touches
decode):

* **Lost nodes.** A pod whose node has been NotReady/Unknown for ``node_loss_seconds`` is deleted
  without a drain (nothing can reach it) and no longer holds its index: a new pod is created at
  once, although the old one may stay Terminating until the node comes back. Before that grace a
  pod on a NotReady node is not routable (the shell leaves it out of the table) but keeps its
  index. Terminating pods never hold an index either.
* **Missing indices.** A wanted index (below ``instances``) with no live pod gets one at once:
  creating never reduces what serves, so it is not rate-limited.
* **Surge** (``max_surge`` > 0). An index served by an old-template pod gets a new pod *first*
  while fewer than ``max_surge`` live pods exceed ``instances``; once the new pod is Ready the
  old one is drained (in the same pass, so the table never routes both) and deleted when its
  drain is over. Surge costs no capacity, so it needs no ``max_unavailable`` budget.
* **In place** (``max_surge`` = 0, or the scheduler cannot place the surge pod: no spare GPUs):
  the old pod is drained within ``max_unavailable`` and the new pod created once it is deleted
  (a pending surge pod just waits for the freed GPUs). A role with more than one routable
  instance is never drained down to zero this way.
* **Drains end** when every router has let go of the pod (``released``, decided by
  :func:`pdserve.deployment.plan.drain.drain_verdict`) or at the latest after ``drain_seconds``; then
  the pod is deleted.
* **Scale down** drains the pods past ``instances`` within ``max_unavailable``, highest index
  first, after in-place replacements (the surplus keeps serving meanwhile); removals still in
  flight count against the budget.
* **Not Ready pods carry no traffic**: an unwanted one (old template, past ``instances``, a
  duplicate) is deleted at once without a drain, so a broken template can always be rolled
  forward.
* **Duplicates.** Of several live current-template pods at one index (a lost node that came
  back, two operators racing), the Ready and oldest one is kept; the others are drained (Ready)
  or deleted (not Ready).
* A draining pod that became the keeper again (template reverted, scale back up) is undrained.
* **Revisions stay paired.** A prefill hands its KV only to a decode of its pairing revision
  (revision.py). While a rollout changes what both sides share, the last routable pod of a
  revision still paired with the other side is not drained (free or budgeted) until the
  current revision is routable on both sides (:func:`revisions_to_keep`): the roles roll
  independently, yet traffic always has a paired revision to go to. And neither role runs ahead:
  a role starts another replacement only while its share of pods on the new revision is within
  one instance of the other role's (:func:`replacement_allowance`), so the new revision grows at
  the spec's P:D ratio.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from pdserve.deployment.spec.pddeployment import PDDeployment, RolloutSpec
from pdserve.routing.table import Role


@dataclass(frozen=True)
class ObservedPod:
    """What the planner needs to know about one instance pod, read from the cluster."""

    index: int
    name: str
    template_hash: str | None
    ready: bool
    draining_since: float | None = None  # epoch seconds from the pdserve.io/draining-since annotation
    terminating: bool = False  # deletionTimestamp set
    dp_size: int | None = None  # what the pod runs (status counts its slots); None: the role's spec
    #: Since when (epoch seconds) the pod's node has been NotReady or Unknown; None: Ready or unknown.
    node_down_since: float | None = None
    unschedulable: bool = False  # the scheduler reported it cannot place the pod
    created: float = 0.0  # creationTimestamp (epoch seconds): the older of two duplicates is kept
    revision: str = ""  # the pairing revision the pod runs ("" : the role's current one)

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining and not self.terminating and self.node_down_since is None


class ActionKind(StrEnum):
    CREATE = "create"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    DELETE = "delete"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    role: Role
    index: int
    reason: str  # human text for logs and Events
    pod: str = ""  # the pod acted on; "" for CREATE (the shell names the new pod)
    node_lost: bool = False  # a DELETE of a pod whose node is lost (Events say so)


@dataclass(frozen=True)
class RolePlan:
    role: Role
    actions: tuple[Action, ...]
    # Seconds until the earliest drain or node-loss grace expires: the shell reconciles again then.
    recheck_after: float | None = None

    def of(self, kind: ActionKind) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind is kind)

    def actions_except(self, kind: ActionKind) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind is not kind)


#: The knobs of :func:`plan_role` are the spec's own (``spec.rollout``), defaults included.
RolloutPolicy = RolloutSpec


def rollout_policy(pdd: PDDeployment) -> RolloutPolicy:
    return pdd.spec.rollout


def plan_role(
    role: Role,
    *,
    instances: int,
    template_hash: str,
    pods: Iterable[ObservedPod],
    policy: RolloutPolicy,
    now: float,
    released: Mapping[str, str] | None = None,
    keep_revisions: Collection[str] = (),
    max_starts: int | None = None,
) -> RolePlan:
    """The actions to take now for one role; see the module docstring for the rules.

    ``released``: names of draining pods that may be deleted before the bound, with why.
    ``keep_revisions``: revisions whose last routable pod of this role must not be drained
    (:func:`revisions_to_keep`). ``max_starts``: how many replacements (surge creates, in-place
    drains of old pods) may begin now; None: no limit (:func:`replacement_allowance`).
    """
    starts = max_starts
    released = released or {}
    all_pods = sorted(pods, key=lambda p: (p.index, p.name))
    actions: list[Action] = []
    recheck: list[float] = []

    def act(kind: ActionKind, pod: ObservedPod, reason: str, node_lost: bool = False) -> None:
        actions.append(Action(kind, role, pod.index, reason, pod.name, node_lost))

    # 1. Lost nodes: delete, no drain; before the grace, only a recheck when it ends.
    live: list[ObservedPod] = []
    for pod in all_pods:
        if pod.terminating:
            continue
        if pod.node_down_since is not None:
            down = now - pod.node_down_since
            if down >= policy.node_loss_seconds:
                act(ActionKind.DELETE, pod, f"node lost: NotReady for {down:.0f}s", node_lost=True)
                continue
            recheck.append(policy.node_loss_seconds - down)
        live.append(pod)

    # 2. Per index: the keeper (Ready, not draining, oldest of the current template).
    by_index: dict[int, list[ObservedPod]] = {}
    for pod in live:
        by_index.setdefault(pod.index, []).append(pod)
    keepers: dict[int, ObservedPod] = {}
    for index, group in by_index.items():
        current = [p for p in group if p.template_hash == template_hash and index < instances]
        if current:
            keepers[index] = min(current, key=_keeper_order)

    def keeper(pod: ObservedPod) -> bool:
        return keepers.get(pod.index) is pod

    undrained: set[str] = set()
    for pod in keepers.values():
        if pod.draining:
            act(ActionKind.UNDRAIN, pod, "wanted again")
            undrained.add(pod.name)

    # 3. Everything else is unwanted: draining ones end their drain, unready ones go at once.
    deleted: set[str] = set()
    for pod in live:
        if keeper(pod):
            continue
        if pod.draining:
            remaining = (pod.draining_since or 0.0) + policy.drain_seconds - now
            if pod.name in released:
                act(ActionKind.DELETE, pod, released[pod.name])
            elif remaining <= 0:
                act(ActionKind.DELETE, pod, f"drained for {policy.drain_seconds:g}s")
            else:
                recheck.append(remaining)
                continue
            deleted.add(pod.name)
        elif not pod.ready:
            act(ActionKind.DELETE, pod, _why_unwanted(pod, instances, keepers) + ", not ready")
            deleted.add(pod.name)

    def serving(pod: ObservedPod) -> bool:
        return (pod.routable or pod.name in undrained) and pod.name not in deleted

    remaining_live = [p for p in live if p.name not in deleted]

    drained: set[str] = set()

    def last_of_kept_revision(pod: ObservedPod) -> bool:
        if pod.revision not in keep_revisions:
            return False
        same = [
            p for p in remaining_live if p.revision == pod.revision and serving(p) and p.name not in drained
        ]
        return len(same) <= 1

    # 4. Drains that cost nothing: an old pod or duplicate whose index has a Ready keeper.
    for pod in remaining_live:
        kept = keepers.get(pod.index)
        if pod is kept or not pod.routable or kept is None or not serving(kept) or last_of_kept_revision(pod):
            continue
        reason = "duplicate" if pod.template_hash == template_hash else f"replaced by {kept.name}"
        act(ActionKind.DRAIN, pod, reason)
        drained.add(pod.name)
        recheck.append(policy.drain_seconds)

    # 5. Creates: free where an index has no live pod left, surge (budgeted) where one serves.
    occupied = {p.index for p in remaining_live}
    creates = [i for i in range(instances) if i not in occupied]
    for index in creates:
        actions.append(Action(ActionKind.CREATE, role, index, "missing"))
    surge_used = len(remaining_live) + len(creates) - instances
    stale = sorted(
        (p for p in remaining_live if p.index < instances and p.index not in keepers and p.routable),
        key=lambda p: -p.index,
    )
    surged: set[int] = set()
    for pod in stale:
        if surge_used >= policy.max_surge or pod.index in surged or starts == 0:
            continue
        actions.append(Action(ActionKind.CREATE, role, pod.index, f"surge: replaces {pod.name}"))
        surged.add(pod.index)
        surge_used += 1
        starts = None if starts is None else starts - 1

    # 6. Budgeted drains: in-place replacements, then scale down; highest index first.
    def available(index: int) -> bool:
        return any(serving(p) and p.name not in drained for p in by_index.get(index, ()))

    unavailable = sum(1 for i in range(instances) if not available(i))
    removals_in_flight = sum(
        1
        for p in all_pods
        if p.index >= instances
        and p.node_down_since is None
        and (p.terminating or p.draining or p.name in deleted)
        and p.name not in undrained
    )
    budget = policy.max_unavailable - unavailable - removals_in_flight
    routable_now = sum(1 for p in remaining_live if serving(p) and p.name not in drained)
    floor = 1 if instances > 0 and (instances > 1 or routable_now > 1) else 0

    def in_place(pod: ObservedPod) -> bool:
        if pod.index >= instances:
            return True  # scale down
        kept = keepers.get(pod.index)
        if kept is None:
            return policy.max_surge == 0
        return kept.unschedulable  # no room for the surge pod: free its GPUs by going in place

    candidates = [
        p for p in remaining_live if p.routable and not keeper(p) and p.name not in drained and in_place(p)
    ]
    candidates.sort(key=lambda p: (p.index >= instances, -p.index))
    for pod in candidates:
        if budget <= 0 or routable_now - 1 < floor:
            break
        replacing = pod.index < instances and pod.index not in keepers
        if last_of_kept_revision(pod) or (replacing and starts == 0):
            continue
        act(ActionKind.DRAIN, pod, _why_unwanted(pod, instances, keepers))
        drained.add(pod.name)
        if replacing and starts is not None:
            starts -= 1
        budget -= 1
        routable_now -= 1
        recheck.append(policy.drain_seconds)

    return RolePlan(role, tuple(actions), min(recheck) if recheck else None)


def revisions_to_keep(
    routable: Mapping[Role, Iterable[str]], current: Mapping[Role, str]
) -> dict[Role, frozenset[str]]:
    """Per role, the revisions whose last routable pod must stay (``routable``: each routable
    pod's revision, per role; ``current``: each role's revision now).

    Every revision routable on both sides, as long as the current revision is not: once the
    roles' current revisions are paired, the old ones may go (their leftovers on one side take
    no traffic anyway), and until then no side may drop the last pod that pairs them.
    """
    prefill, decode = set(routable.get(Role.PREFILL, ())), set(routable.get(Role.DECODE, ()))
    paired = prefill & decode
    target = current[Role.PREFILL]
    if target == current[Role.DECODE] and target in paired:
        return {Role.PREFILL: frozenset(), Role.DECODE: frozenset()}
    return {Role.PREFILL: frozenset(paired), Role.DECODE: frozenset(paired)}


def replacement_allowance(
    updated: Mapping[Role, int], wanted: Mapping[Role, int], shared: bool
) -> dict[Role, int | None]:
    """Per role, how many more replacements may begin (None: no limit).

    Only while a rollout changes what both roles share (``shared``: pods of an old revision
    exist): a role may have ``ceil((u_other + 1) * n_self / n_other)`` pods on the new revision,
    ``u`` the pods on it (``updated``) and ``n`` the wanted instances, i.e. at most one instance
    ahead of the other role at the spec's ratio. The role that is behind can always start one.
    """
    if not shared:
        return {role: None for role in Role}
    out: dict[Role, int | None] = {}
    for role, other in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
        if wanted[other] == 0:
            out[role] = None
            continue
        cap = -(-(updated[other] + 1) * wanted[role] // wanted[other])  # ceiling division
        out[role] = max(cap - updated[role], 0)
    return out


def _keeper_order(pod: ObservedPod) -> tuple[bool, bool, float, str]:
    """Ready on a Ready node first, then not draining, then the oldest."""
    return (not pod.ready or pod.node_down_since is not None, pod.draining, pod.created, pod.name)


def _why_unwanted(pod: ObservedPod, instances: int, keepers: Mapping[int, ObservedPod]) -> str:
    if pod.index >= instances:
        return "scale down"
    kept = keepers.get(pod.index)
    if kept is not None and kept.template_hash == pod.template_hash:
        return f"duplicate of {kept.name}"
    return "template changed"


def apply_drains(pods: Sequence[ObservedPod], plan: RolePlan, now: float) -> tuple[ObservedPod, ...]:
    """The observation as it will be once the plan's drains and undrains are written.

    The shell builds the routing table from this, so a pod is shown draining in the same
    reconcile that starts its drain, before anything is deleted.
    """
    drain = {a.pod for a in plan.of(ActionKind.DRAIN)}
    undrain = {a.pod for a in plan.of(ActionKind.UNDRAIN)}
    out = []
    for pod in pods:
        if pod.name in drain:
            pod = replace(pod, draining_since=now)
        elif pod.name in undrain:
            pod = replace(pod, draining_since=None)
        out.append(pod)
    return tuple(out)
