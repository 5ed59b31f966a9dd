"""Rollout planning for one role: which pods to create, drain, undrain or delete now.

Pure and level-based: the plan depends only on what the cluster shows (pods, their template
hash, readiness, the ``pdserve.io/draining-since`` annotation, deletion timestamps) and the
clock, never on the operator's memory. A restarted operator therefore picks up a rollout where
the cluster says it is, and running the planner twice on the same observation gives the same
plan (the shell's creates and deletes are idempotent by pod name).

Rules, per role (prefill and decode are planned separately, so a prefill rollout never touches
decode):

* every wanted index without a pod is created (scale up, a deleted pod, the second half of a
  replacement); creating never reduces what can serve, so it is not rate-limited;
* a pod to remove (index past ``instances`` or a stale template hash) is first marked draining
  (the router stops sending it new work), and deleted once every router has let go of it
  (``released``, decided by :func:`pdserve.deployment.drain.drain_verdict`) or at the latest
  once ``drainSeconds`` have passed;
* at most ``maxUnavailable`` wanted indices are unavailable at once, counting missing, unready,
  draining and terminating pods plus removals still in flight; scale down and replacement share
  that budget, highest index first, replacement before scale down (the surplus pods keep
  serving while the wanted ones are replaced);
* a role with more than one routable instance is never drained down to zero (a role of one
  instance cannot be replaced without a gap: there is no surge);
* a pod that is not Ready to begin with carries no traffic, so removing it costs nothing: it is
  deleted at once without a drain (otherwise a broken template could never be rolled forward);
* a draining pod that became wanted again (scale back up, template reverted) is undrained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

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

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining and not self.terminating


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


@dataclass(frozen=True)
class RolePlan:
    role: Role
    actions: tuple[Action, ...]
    # Seconds until the earliest drain expires: the shell reconciles again then.
    recheck_after: float | None = None

    def of(self, kind: ActionKind) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind is kind)


def plan_role(
    role: Role,
    *,
    instances: int,
    template_hash: str,
    pods: Iterable[ObservedPod],
    max_unavailable: int,
    drain_seconds: float,
    now: float,
    released: Mapping[int, str] | None = None,
) -> RolePlan:
    """The actions to take now for one role; see the module docstring for the rules.

    ``released``: draining indices that may be deleted before the bound, with why.
    """
    released = released or {}
    by_index = _by_index(pods)
    actions: list[Action] = []
    recheck: list[float] = []

    def wanted(pod: ObservedPod) -> bool:
        return pod.index < instances and pod.template_hash == template_hash

    # 1. Missing wanted indices: create.
    for index in range(instances):
        if index not in by_index:
            actions.append(Action(ActionKind.CREATE, role, index, "missing"))

    # 2. Draining pods: undrain if wanted again, else delete once the drain has run its course.
    for pod in sorted(by_index.values(), key=lambda p: p.index):
        if pod.terminating or pod.draining_since is None:
            continue
        if wanted(pod):
            actions.append(Action(ActionKind.UNDRAIN, role, pod.index, "wanted again"))
            continue
        remaining = pod.draining_since + drain_seconds - now
        if pod.index in released:
            actions.append(Action(ActionKind.DELETE, role, pod.index, released[pod.index]))
        elif remaining <= 0:
            actions.append(Action(ActionKind.DELETE, role, pod.index, f"drained for {drain_seconds:g}s"))
        else:
            recheck.append(remaining)

    undrained = {a.index for a in actions if a.kind is ActionKind.UNDRAIN}
    deleting = {a.index for a in actions if a.kind is ActionKind.DELETE}

    # 3. Unwanted pods that are not Ready carry no traffic: delete them without a drain.
    for pod in sorted(by_index.values(), key=lambda p: -p.index):
        if not wanted(pod) and not pod.terminating and not pod.draining and not pod.ready:
            actions.append(
                Action(ActionKind.DELETE, role, pod.index, _why_unwanted(pod, instances) + ", not ready")
            )
            deleting.add(pod.index)

    # 4. Ready unwanted pods: start draining within the budget.
    def available(pod: ObservedPod) -> bool:
        return pod.routable or pod.index in undrained

    unavailable = sum(1 for i in range(instances) if i not in by_index or not available(by_index[i]))
    removals_in_flight = sum(
        1
        for p in by_index.values()
        if p.index >= instances
        and (p.terminating or p.draining or p.index in deleting)
        and p.index not in undrained
    )
    budget = max_unavailable - unavailable - removals_in_flight
    routable_now = sum(1 for p in by_index.values() if available(p))
    floor = 1 if instances > 0 and (instances > 1 or routable_now > 1) else 0

    candidates = [p for p in by_index.values() if p.routable and not wanted(p)]
    # Replacement (index below instances) before scale down; highest index first within each.
    candidates.sort(key=lambda p: (p.index >= instances, -p.index))
    for pod in candidates:
        if budget <= 0 or routable_now - 1 < floor:
            break
        actions.append(Action(ActionKind.DRAIN, role, pod.index, _why_unwanted(pod, instances)))
        budget -= 1
        routable_now -= 1
        recheck.append(drain_seconds)

    return RolePlan(role, tuple(actions), min(recheck) if recheck else None)


def _why_unwanted(pod: ObservedPod, instances: int) -> str:
    return "scale down" if pod.index >= instances else "template changed"


def _by_index(pods: Iterable[ObservedPod]) -> dict[int, ObservedPod]:
    out: dict[int, ObservedPod] = {}
    for pod in pods:
        if pod.index in out:
            raise ValueError(
                f"two pods claim instance index {pod.index}: {out[pod.index].name} and {pod.name}"
            )
        out[pod.index] = pod
    return out


def apply_drains(pods: Sequence[ObservedPod], plan: RolePlan, now: float) -> tuple[ObservedPod, ...]:
    """The observation as it will be once the plan's drains and undrains are written.

    The shell builds the routing table from this, so a pod is shown draining in the same
    reconcile that starts its drain, before anything is deleted.
    """
    drain = {a.index for a in plan.of(ActionKind.DRAIN)}
    undrain = {a.index for a in plan.of(ActionKind.UNDRAIN)}
    out = []
    for pod in pods:
        if pod.index in drain:
            pod = replace(pod, draining_since=now)
        elif pod.index in undrain:
            pod = replace(pod, draining_since=None)
        out.append(pod)
    return tuple(out)
