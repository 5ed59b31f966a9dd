"""The autoscaler inside a reconcile pass: the counts to plan with, and every ``syncPeriodSeconds``
a decision (pdserve.deployment.plan.autoscale) on freshly fetched signals.

The counts live in the status (pdserve.deployment.plan.scaling); the decisions' memory (past
recommendations for the stabilisation windows, past scale events for the step policies, the
decode's latency line) lives here, per PDDeployment. A new leader, or a restarted operator,
starts with an empty memory: its first scale-down waits a whole window, the safe side.

A pass that changes a count writes it to the status in the same pass, posts a ``Scaled`` Event
with the reason, and the rest of the pass already plans with it: creates the new instances
(they enter the routing table when Ready) or drains the surplus through the routers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment.plan.autoscale import ROLES, Decision, Limit, Memory, decide
from pdserve.deployment.plan.scaling import (
    Counts,
    autoscaling_status,
    limits_condition,
    role_state,
    stored_counts,
    with_counts,
)
from pdserve.deployment.plan.scheduling import placement_of
from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.render.names import ROLE_LABEL
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.operator import metrics
from pdserve.operator.cluster.kube import Kube
from pdserve.operator.cluster.views import PodView, rfc3339
from pdserve.operator.dataplane.memory import Key, PerDeployment
from pdserve.operator.dataplane.signals import gather
from pdserve.operator.reconcile.steps import Event
from pdserve.routing import Role

Gather = Callable[[Kube, PDDeployment, Sequence[PodView], float], Signals]


@dataclass
class _State:
    memory: Memory = field(default_factory=Memory)
    next_at: float = 0.0  # when the next decision is due (monotonic with the reconciler's clock)
    limits: tuple[Limit, ...] = ()


@dataclass(frozen=True)
class ScalingPass:
    """What a pass needs from the autoscaler besides the counts."""

    status: Mapping[str, Any] | None  # status.autoscaling; None: no spec.autoscaling
    limited: tuple[bool, str, str] | None  # condition ScalingLimited
    events: tuple[Event, ...] = ()
    recheck_after: float | None = None  # seconds to the next decision


NO_AUTOSCALING = ScalingPass(None, None)


class Autoscaler(PerDeployment[_State]):
    def __init__(self, kube: Kube, fetch: Gather = gather) -> None:
        super().__init__(kube)
        self._fetch = fetch

    def _forgotten(self, key: Key) -> None:
        metrics.forget_autoscaler(*key)

    def counts(self, pdd: PDDeployment, body: Mapping[str, Any]) -> PDDeployment:
        """The deployment at the stored counts (no decision): for a pass that will not scale."""
        if pdd.spec.autoscaling is None:
            return pdd
        return with_counts(pdd, stored_counts(pdd, body.get("status")).desired)

    def scale(
        self,
        pdd: PDDeployment,
        body: Mapping[str, Any],
        units: Sequence[PodView],
        raw_pods: Sequence[Mapping[str, Any]],
        now: float,
    ) -> tuple[PDDeployment, ScalingPass]:
        """The deployment at the counts to plan with now, deciding first when a decision is due."""
        key = (pdd.namespace, pdd.name)
        spec = pdd.spec.autoscaling
        if spec is None:
            self.forget(key)
            return pdd, NO_AUTOSCALING
        previous = (body.get("status") or {}).get("autoscaling")
        counts = stored_counts(pdd, body.get("status"))
        state = self._state(key, lambda: _State(next_at=now))
        decision: Decision | None = None
        signals: Signals | None = None
        events: list[Event] = []
        if now >= state.next_at:
            roles = {
                role: role_state(
                    counts.desired[role],
                    [u.observed for u in units if u.role.value == role],
                    pdd.spec.role(Role(role)).data_parallel,
                    now,
                    pdd.spec.role(Role(role)).startup_timeout_seconds,
                    _unschedulable(pdd, raw_pods, role),
                )
                for role in ROLES
            }
            signals = self._fetch(self._kube, pdd, units, spec.objectives.window_seconds)
            decision = decide(spec, now, roles, signals, state.memory)
            state.memory, state.limits = decision.memory, decision.limits
            state.next_at = now + spec.sync_period_seconds
            counts = Counts(decision.counts, counts.started_from)
            metrics.record_decision(pdd.namespace, pdd.name, decision, signals.known)
            if decision.changed:
                events.append(Event("Normal", "Scaled", decision.reason))
        status = autoscaling_status(spec, counts, decision, signals, previous, rfc3339(now))
        scaling = ScalingPass(
            status, limits_condition(state.limits), tuple(events), max(state.next_at - now, 0.0)
        )
        return with_counts(pdd, counts.desired), scaling


def _unschedulable(pdd: PDDeployment, raw_pods: Sequence[Mapping[str, Any]], role: str) -> list[str]:
    """The scheduler's messages for the role's pods it cannot place."""
    out = []
    for pod in raw_pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(ROLE_LABEL) != role:
            continue
        placement = placement_of(pod, pdd.spec.gpu_resource)
        if placement.unschedulable and not placement.terminating:
            out.append(placement.unschedulable)
    return out
