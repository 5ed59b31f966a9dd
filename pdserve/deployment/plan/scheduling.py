"""Largest pods first: scheduling gates that keep small engine pods from fragmenting GPU nodes,
and the scheduler's word on pods that cannot be placed.

Why: the default scheduler places pods one at a time and spreads them (its default scoring
prefers the least allocated node). Measured in the test cluster: 1 prefill x TP8 and 6 decode x
TP1 on two 8-GPU nodes (14 of 16 GPUs) never became Ready: the decode pods landed on both nodes
first and no node had 8 free GPUs left for the prefill pod.

What pdserve does (Pod scheduling gates, GA in Kubernetes 1.30):

* an engine pod is created with the gate :data:`GATE` when a pod of the same deployment that
  needs more GPUs is still waiting to be placed (or is created in the same pass), so the
  scheduler does not even consider it;
* the operator removes the gate once no larger pod is waiting: every larger pod is bound to a
  node, gone, or reported Unschedulable by the scheduler (it had its chance with the smaller
  pods held back; then holding them helps nobody, and the status says why the large one waits).

Pods of equal size (and the simulator, which asks for no GPU) are never gated. A cluster-wide
answer is a bin-packing scheduler profile (``NodeResourcesFit`` with the ``MostAllocated``
scoring strategy for the GPU resource), which packs small pods onto already used nodes for every
workload; gates need no scheduler configuration and work with it.

A pod that the scheduler reports Unschedulable (``PodScheduled=False``, reason
``Unschedulable``) appears in the PDDeployment's status as ``Degraded=True``, reason
``PodsUnschedulable``, with the scheduler's message (:func:`unschedulable_messages`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GATE = "pdserve.io/largest-first"


@dataclass(frozen=True)
class Placement:
    """What scheduling needs to know of one engine pod (read from the pod, or about to be created)."""

    name: str
    gpus: int
    bound: bool = False  # spec.nodeName is set
    gated: bool = False  # carries GATE
    unschedulable: str | None = None  # the scheduler's message when PodScheduled=False/Unschedulable
    terminating: bool = False

    @property
    def waiting(self) -> bool:
        """Still to be placed, and the scheduler has not given up on it."""
        return not self.bound and not self.terminating and self.unschedulable is None


def placement_of(pod: Mapping[str, Any], gpu_resource: str) -> Placement:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    containers = spec.get("containers") or []
    limits = [((c.get("resources") or {}).get("limits") or {}).get(gpu_resource) for c in containers]
    gpus = sum(int(str(v)) for v in limits if v is not None and str(v).isdigit())
    conditions: list[Mapping[str, Any]] = status.get("conditions") or []
    scheduled: Mapping[str, Any] = next((c for c in conditions if c.get("type") == "PodScheduled"), {})
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = str(scheduled.get("message") or "the scheduler found no node")
    return Placement(
        name=str(meta.get("name", "")),
        gpus=gpus,
        bound=bool(spec.get("nodeName")),
        gated=any(g.get("name") == GATE for g in spec.get("schedulingGates") or []),
        unschedulable=unschedulable,
        terminating=bool(meta.get("deletionTimestamp")),
    )


def gate_new(new: Sequence[Placement], existing: Iterable[Placement]) -> set[str]:
    """Names of the pods about to be created that must start gated."""
    waiting = [p for p in existing if p.waiting] + list(new)
    return {p.name for p in new if any(other.gpus > p.gpus for other in waiting)}


def to_ungate(pods: Sequence[Placement]) -> list[str]:
    """Gated pods with no larger pod still waiting to be placed."""
    waiting = [p for p in pods if p.waiting]
    return [
        p.name
        for p in pods
        if p.gated and not p.terminating and not any(o.gpus > p.gpus for o in waiting if o.name != p.name)
    ]


def unschedulable_messages(pods: Iterable[Placement]) -> list[str]:
    """``pod <name>: <the scheduler's message>`` for every live pod the scheduler cannot place."""
    return [f"pod {p.name}: {p.unschedulable}" for p in pods if p.unschedulable and not p.terminating]


def with_gate(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod manifest with :data:`GATE` among its scheduling gates (added at creation only)."""
    gates = list(pod["spec"].get("schedulingGates") or [])
    if not any(g.get("name") == GATE for g in gates):
        gates.append({"name": GATE})
    pod["spec"]["schedulingGates"] = gates
    return pod
