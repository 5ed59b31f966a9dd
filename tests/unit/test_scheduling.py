"""Largest pods first: which new pods start gated, which gates lift, and what the status says."""

from __future__ import annotations

from typing import Any

from pdserve.deployment.plan.scheduling import (
    GATE,
    Placement,
    gate_new,
    placement_of,
    to_ungate,
    unschedulable_messages,
    with_gate,
)
from pdserve.deployment.plan.status import Observation, compute_status
from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.routing import Role
from tests.support.specs import pdd_of

NOW = "2026-12-03T00:00:00Z"


def test_small_pods_created_with_a_larger_one_start_gated() -> None:
    new = [Placement("p0", 8), *[Placement(f"d{i}", 1) for i in range(6)]]
    assert gate_new(new, []) == {f"d{i}" for i in range(6)}
    # Equal sizes never wait for each other; nor does the simulator (no GPUs).
    assert gate_new([Placement("a", 8), Placement("b", 8)], []) == set()
    assert gate_new([Placement("a", 0), Placement("b", 0)], []) == set()


def test_a_new_small_pod_waits_only_for_larger_pods_still_to_be_placed() -> None:
    bound = [Placement("p0", 8, bound=True)]
    assert gate_new([Placement("d0", 1)], bound) == set()
    waiting = [Placement("p0", 8)]
    assert gate_new([Placement("d0", 1)], waiting) == {"d0"}
    given_up = [Placement("p0", 8, unschedulable="0/2 nodes are available")]
    assert gate_new([Placement("d0", 1)], given_up) == set()
    leaving = [Placement("p0", 8, terminating=True)]
    assert gate_new([Placement("d0", 1)], leaving) == set()


def test_gates_lift_from_the_largest_down() -> None:
    pods = [Placement("p0", 8), Placement("m0", 4, gated=True), Placement("d0", 1, gated=True)]
    assert to_ungate(pods) == []
    pods[0] = Placement("p0", 8, bound=True)
    assert to_ungate(pods) == ["m0"]  # d0 still waits for m0, which is about to be placed
    pods[1] = Placement("m0", 4, bound=True)
    assert to_ungate(pods) == ["d0"]
    # A larger pod the scheduler cannot place holds nobody back.
    assert to_ungate([Placement("p0", 8, unschedulable="no"), Placement("d0", 1, gated=True)]) == ["d0"]


def test_placement_is_read_from_the_pod() -> None:
    pdd = pdd_of(image="i", prefill={"tensorParallel": 8})
    pod: dict[str, Any] = with_gate(instance_pod(pdd, Role.PREFILL, 0))
    assert pod["spec"]["schedulingGates"] == [{"name": GATE}]
    assert placement_of(pod, "nvidia.com/gpu") == Placement("r1-prefill-0", 8, gated=True)
    pod["spec"]["nodeName"] = "n1"
    pod["status"] = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
    assert placement_of(pod, "nvidia.com/gpu").bound
    pod["spec"].pop("nodeName")
    message = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    pod["status"] = {
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        ]
    }
    placement = placement_of(pod, "nvidia.com/gpu")
    assert placement.unschedulable == message and not placement.waiting
    assert unschedulable_messages([placement]) == [f"pod r1-prefill-0: {message}"]
    gated = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}
    pod["status"] = {"conditions": [gated]}
    assert placement_of(pod, "nvidia.com/gpu").unschedulable is None  # held back by us, not refused


def test_an_unschedulable_pod_makes_the_deployment_degraded_with_the_schedulers_words() -> None:
    message = "pod r1-prefill-2: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    status = compute_status(Observation(3, 1, (), 1, 1, unschedulable=[message]), None, NOW)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "PodsUnschedulable",
        message,
    )
    fine = compute_status(Observation(3, 1, (), 1, 1), status, NOW)
    assert next(c for c in fine["conditions"] if c["type"] == "Degraded")["status"] == "False"
