"""Around the decision (pdserve.deployment.plan.scaling): who owns the counts, what a role runs,
and what the status says; and ScalingLimited in the status (plan/status.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.deployment.plan.autoscale import Limit, RoleState, decide
from pdserve.deployment.plan.rollout import ObservedPod
from pdserve.deployment.plan.scaling import (
    autoscaling_status,
    limits_condition,
    missing_resource,
    role_state,
    stored_counts,
    with_counts,
)
from pdserve.deployment.plan.status import Observation, compute_status
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.deployment.spec.pddeployment import PDDeployment
from tests.support.specs import sim_manifest
from tests.unit.test_autoscale import OLD, signals


def deployment(prefill: int = 2, decode: int = 3, bounds: dict[str, Any] | None = None) -> PDDeployment:
    autoscaling = {
        "prefill": {"minInstances": 1, "maxInstances": 8},
        "decode": {"minInstances": 2, "maxInstances": 8},
        "objectives": {"ttftMilliseconds": 1000, "itlMilliseconds": 40},
        **(bounds or {}),
    }
    doc = sim_manifest(
        "d", prefill={"instances": prefill}, decode={"instances": decode}, autoscaling=autoscaling
    )
    return parse_pddeployment(doc)


def stored(prefill: int, decode: int, started: tuple[int, int] = (2, 3)) -> dict[str, Any]:
    return {
        "autoscaling": {
            "prefill": {"desiredInstances": prefill, "startedFrom": started[0]},
            "decode": {"desiredInstances": decode, "startedFrom": started[1]},
        }
    }


def test_the_spec_instances_are_the_start_and_the_status_holds_the_count() -> None:
    pdd = deployment()
    assert stored_counts(pdd, None).desired == {"prefill": 2, "decode": 3}
    # the autoscaler moved them since; applying the same manifest (same instances) changes nothing
    assert stored_counts(pdd, stored(5, 6)).desired == {"prefill": 5, "decode": 6}


def test_a_changed_spec_instances_is_a_new_start() -> None:
    counts = stored_counts(deployment(prefill=4), stored(5, 6))
    assert counts.desired == {"prefill": 4, "decode": 6}
    assert counts.started_from == {"prefill": 4, "decode": 3}


def test_counts_follow_changed_bounds_and_garbage_is_ignored() -> None:
    pdd = deployment(bounds={"decode": {"minInstances": 7, "maxInstances": 8}})
    assert stored_counts(pdd, stored(5, 3)).desired == {"prefill": 5, "decode": 7}
    bad = {"autoscaling": {"prefill": {"desiredInstances": "many", "startedFrom": 2}, "decode": []}}
    assert stored_counts(deployment(), bad).desired == {"prefill": 2, "decode": 3}


def test_with_counts_changes_only_the_counts() -> None:
    pdd = deployment()
    scaled = with_counts(pdd, {"prefill": 7, "decode": 1})
    assert (scaled.spec.prefill.instances, scaled.spec.decode.instances) == (7, 1)
    assert replace(scaled.spec, prefill=pdd.spec.prefill, decode=pdd.spec.decode) == pdd.spec


def pod(index: int, ready: bool = True, created: float = 0.0, **extra: Any) -> ObservedPod:
    return ObservedPod(index, f"p{index}", "h", ready, created=created, **extra)


def test_role_state_counts_ready_starting_and_unplaceable() -> None:
    units = [
        pod(0),
        pod(1, dp_size=4),
        pod(2, ready=False, created=90.0),  # starting
        pod(3, ready=False, created=0.0),  # older than the startup timeout: broken, not starting
        pod(4, ready=False, created=95.0, unschedulable=True),
        pod(5, draining_since=50.0),  # draining: neither ready nor starting
        pod(6, terminating=True),
    ]
    message = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    state = role_state(6, units, 2, now=100.0, startup_timeout=60.0, unschedulable_messages=[message])
    assert state == RoleState(
        desired=6,
        ready=2,
        starting=2,
        unschedulable=1,
        slots=6,
        unschedulable_reason="Insufficient nvidia.com/gpu",
    )
    assert missing_resource(["node(s) had untolerated taint"]) == "node(s) had untolerated taint"


def test_the_status_has_the_counts_the_decision_and_its_figures() -> None:
    pdd = deployment()
    spec = pdd.spec.autoscaling
    assert spec is not None
    counts = stored_counts(pdd, None)
    s = signals(ttft_ms=2500, itl_ms=20)
    roles = {"prefill": RoleState(2, 2), "decode": RoleState(3, 3)}
    decision = decide(spec, 0.0, roles, s, OLD)
    counts = replace(counts, desired=decision.counts)
    status = autoscaling_status(spec, counts, decision, s, None, "2026-01-01T00:00:00Z")
    assert status["prefill"]["desiredInstances"] == decision.counts["prefill"] > 2
    assert status["prefill"]["startedFrom"] == 2 and status["prefill"]["objectiveRatio"] > 2
    assert status["lastScaleTime"] == status["lastDecisionTime"] == "2026-01-01T00:00:00Z"
    assert status["reason"] == decision.reason
    assert status["measured"]["requests"] == 200 and status["measured"]["windowSeconds"] == 60
    assert 2300 < status["measured"]["ttftMilliseconds"] < 2700
    assert status["summary"].startswith("TTFT 2.") and "/1s ITL" in status["summary"]
    # between decisions the figures stay, the counts are today's
    later = autoscaling_status(spec, counts, None, None, status, "2026-01-01T00:00:10Z")
    assert later["reason"] == status["reason"] and later["lastDecisionTime"] == status["lastDecisionTime"]
    assert later["prefill"] == status["prefill"]


def test_scaling_limited_is_a_condition_only_with_autoscaling() -> None:
    plain = compute_status(Observation(1, 1, (), 0, 0), None, "t")
    assert [c["type"] for c in plain["conditions"]] == ["Ready", "Progressing", "Degraded"]
    limit = Limit(
        "prefill", "InsufficientResources", "prefill: 1 pod(s) cannot be placed (Insufficient x/gpu)"
    )
    obs = Observation(1, 1, (), 0, 0, autoscaling={"summary": "s"}, scaling_limited=limits_condition([limit]))
    status = compute_status(obs, None, "t")
    condition = status["conditions"][-1]
    assert condition["type"] == "ScalingLimited" and condition["status"] == "True"
    assert condition["reason"] == "InsufficientResources" and "x/gpu" in condition["message"]
    assert status["autoscaling"] == {"summary": "s"}
    calm = compute_status(replace(obs, scaling_limited=limits_condition([])), status, "t2")
    assert calm["conditions"][-1]["reason"] == "DesiredWithinRange"
    assert calm["conditions"][-1]["lastTransitionTime"] == "t2"
    # autoscaling turned off: the status section goes (null in the merge patch), and the condition
    off = compute_status(Observation(1, 1, (), 0, 0), calm, "t3")
    assert off["autoscaling"] is None
    assert "ScalingLimited" not in [c["type"] for c in off["conditions"]]


def test_a_multi_node_role_scales_by_whole_groups() -> None:
    """An instance of 16 ranks over 8-GPU nodes is a group of two pods: the autoscaler's count
    is in groups, every pod of a new instance is rendered, none of a removed one."""
    from pdserve.deployment.render.groups import render_all
    from pdserve.deployment.render.names import GROUP_LABEL, ROLE_LABEL

    doc = sim_manifest(
        "mn",
        gpusPerNode=8,
        prefill={"instances": 1, "dataParallel": 16},
        decode={"instances": 1},
        autoscaling={
            "prefill": {"maxInstances": 4},
            "decode": {"maxInstances": 4},
            "objectives": {"ttftMilliseconds": 1000, "itlMilliseconds": 40},
        },
    )
    pdd = parse_pddeployment(doc)
    for count in (1, 3, 2):
        pods = [
            o
            for o in render_all(with_counts(pdd, {"prefill": count, "decode": 1}))
            if o["kind"] == "Pod" and o["metadata"]["labels"][ROLE_LABEL] == "prefill"
        ]
        groups = {p["metadata"]["labels"][GROUP_LABEL] for p in pods}
        assert len(groups) == count and len(pods) == 2 * count
