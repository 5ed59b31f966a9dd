"""Status computation: per-role counts, summaries, and the three conditions with their transitions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.deployment.plan.rollout import ObservedPod
from pdserve.deployment.plan.status import Observation, RoleObservation, compute_status
from pdserve.routing.table import Role

T0 = "2025-01-01T00:00:00Z"
T1 = "2025-01-01T00:05:00Z"


def pods(n: int, hash_: str = "h", ready: bool = True, start: int = 0) -> list[ObservedPod]:
    return [ObservedPod(i, f"p-{i}", hash_, ready) for i in range(start, start + n)]


def observe(
    prefill: Sequence[ObservedPod],
    decode: Sequence[ObservedPod],
    *,
    prefill_instances: int = 2,
    decode_instances: int = 2,
    router_available: int = 1,
    problems: Sequence[str] = (),
    error: str | None = None,
) -> Observation:
    return Observation(
        generation=3,
        routing_generation=7,
        roles=(
            RoleObservation(Role.PREFILL, prefill_instances, 8, "h", "pdserve.io/role=prefill", prefill),
            RoleObservation(Role.DECODE, decode_instances, 1, "h", "pdserve.io/role=decode", decode),
        ),
        router_replicas=1,
        router_available=router_available,
        problems=problems,
        error=error,
    )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_converged_deployment_is_ready_and_counts_slots() -> None:
    status = compute_status(observe(pods(2), pods(2)), None, T0)
    assert status["observedGeneration"] == 3
    assert status["routingGeneration"] == 7
    assert status["prefill"] == {
        "instances": 2,
        "readyInstances": 2,
        "updatedInstances": 2,
        "availableInstances": 2,
        "unreachableInstances": 0,
        "slots": 16,
        "readySlots": 16,
        "summary": "2/2",
        "selector": "pdserve.io/role=prefill",
        "templateHash": "h",
    }
    assert status["decode"]["readySlots"] == 2
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "AllInstancesReady")
    assert c["Progressing"]["status"] == "False"
    assert c["Degraded"]["status"] == "False"
    assert "prefill 2/2 instances (16/16 slots) ready" in c["Ready"]["message"]


def test_starting_deployment_is_progressing_not_ready() -> None:
    status = compute_status(observe(pods(1, ready=False), []), None, T0)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "InstancesNotReady")
    assert c["Progressing"]["status"] == "True"
    assert "decode: 0/2 updated, 0/2 ready" in c["Progressing"]["message"]
    assert status["prefill"]["summary"] == "0/2"
    assert status["prefill"]["readySlots"] == 0


def test_rollout_counts_old_pods_as_ready_but_not_updated() -> None:
    prefill = [ObservedPod(0, "p-0", "old", True), ObservedPod(1, "p-1", "h", True)]
    status = compute_status(observe(prefill, pods(2)), None, T0)
    assert status["prefill"]["readyInstances"] == 2
    assert status["prefill"]["updatedInstances"] == 1
    c = conditions(status)
    assert c["Ready"]["reason"] == "RollingOut"
    assert "prefill: 1/2 updated" in c["Progressing"]["message"]


def test_ready_slots_count_what_each_pod_runs() -> None:
    # Prefill going from DP4 to DP8 (the spec says 8): one old DP4 pod, one new DP8 pod, one unready.
    prefill = [
        ObservedPod(0, "p-0", "old", True, dp_size=4),
        ObservedPod(1, "p-1", "h", True, dp_size=8),
        ObservedPod(2, "p-2", "h", False, dp_size=8),
    ]
    status = compute_status(observe(prefill, pods(2), prefill_instances=3), None, T0)
    assert (status["prefill"]["slots"], status["prefill"]["readySlots"]) == (24, 12)
    assert "prefill 2/3 instances (12/24 slots) ready" in conditions(status)["Ready"]["message"]


def test_draining_and_terminating_pods_are_not_ready() -> None:
    decode = [
        ObservedPod(0, "d-0", "h", True),
        ObservedPod(1, "d-1", "h", True, draining_since=1.0),
        ObservedPod(2, "d-2", "h", True, terminating=True),
    ]
    status = compute_status(observe(pods(2), decode, decode_instances=2), None, T0)
    assert status["decode"]["instances"] == 2  # the terminating pod no longer counts
    assert status["decode"]["readyInstances"] == 1


def test_scale_down_in_progress() -> None:
    status = compute_status(observe(pods(2), pods(3), decode_instances=2), None, T0)
    c = conditions(status)
    assert c["Ready"]["reason"] == "ScalingDown"
    assert "decode: 1 to remove" in c["Progressing"]["message"]


def test_router_not_available_keeps_ready_false() -> None:
    status = compute_status(observe(pods(2), pods(2), router_available=0), None, T0)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "RouterNotReady")
    assert "router 0/1 available" in c["Ready"]["message"]


def test_invalid_spec_is_degraded_with_the_problems() -> None:
    problems = ["spec.prefill: an instance needs 16 nvidia.com/gpu, but no node has more than 8"]
    status = compute_status(observe([], [], problems=problems), None, T0)
    c = conditions(status)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "InvalidSpec")
    assert c["Degraded"]["message"] == problems[0]
    assert c["Ready"]["status"] == "False"
    assert c["Progressing"]["status"] == "False"


def test_reconcile_error_is_degraded() -> None:
    status = compute_status(observe(pods(2), pods(2), error="forbidden: pods"), None, T0)
    c = conditions(status)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"], c["Degraded"]["message"]) == (
        "True",
        "ReconcileError",
        "forbidden: pods",
    )


def test_last_transition_time_moves_only_when_status_flips() -> None:
    first = compute_status(observe(pods(1, ready=False), []), None, T0)
    # Same state later: nothing changes, so the status is identical (no write needed).
    again = compute_status(observe(pods(1, ready=False), []), first, T1)
    assert again == first
    # Still not ready, but a different message: the time stays.
    more = compute_status(observe(pods(2, ready=False), pods(1)), first, T1)
    assert conditions(more)["Ready"]["lastTransitionTime"] == T0
    # Ready flips: its time moves, Degraded (unchanged False) keeps the old one.
    ready = compute_status(observe(pods(2), pods(2)), more, T1)
    assert conditions(ready)["Ready"]["lastTransitionTime"] == T1
    assert conditions(ready)["Degraded"]["lastTransitionTime"] == T0


def test_routing_generation_is_kept_when_unknown() -> None:
    obs = observe(pods(2), pods(2))
    unknown = Observation(obs.generation, None, obs.roles, 1, 1)
    assert "routingGeneration" not in compute_status(unknown, None, T0)
    assert compute_status(unknown, {"routingGeneration": 4}, T0)["routingGeneration"] == 4


def test_surge_and_unreachable_pods_show_in_the_rollout_status() -> None:
    old = [ObservedPod(i, f"d-{i}-old", "old", True) for i in range(2)]
    surge = ObservedPod(1, "d-1-new", "h", False)
    lost = ObservedPod(0, "d-0-lost", "h", True, node_down_since=5.0)
    obs = observe(pods(2), [*old, surge, lost])
    obs = replace(obs, unreachable=("pod d-0-lost: node n1 NotReady since T",))
    status = compute_status(obs, None, T0)
    decode = status["decode"]
    assert (decode["instances"], decode["readyInstances"], decode["updatedInstances"]) == (4, 2, 2)
    assert (decode["availableInstances"], decode["unreachableInstances"]) == (2, 1)
    c = conditions(status)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "NodeNotReady")
    assert "1 surge" in c["Progressing"]["message"]
    assert "1 on NotReady nodes" in c["Progressing"]["message"]


def test_unpaired_revisions_are_named_in_progressing() -> None:
    old = [ObservedPod(0, "d-0-old", "old", True)]
    obs = replace(observe(pods(1), old), unpaired=("revision 'b' has 8 routable prefill slot(s) ...",))
    message = conditions(compute_status(obs, None, T0))["Progressing"]["message"]
    assert message.endswith("; revision 'b' has 8 routable prefill slot(s) ...")
