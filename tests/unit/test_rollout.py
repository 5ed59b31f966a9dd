"""Rollout planning: every rule of pdserve.deployment.rollout, and whole rollouts driven to the end."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from pdserve.deployment.rollout import Action, ActionKind, ObservedPod, RolePlan, apply_drains, plan_role
from pdserve.routing.table import Role

NEW = "new"
OLD = "old"


def pod(
    index: int,
    hash_: str | None = NEW,
    ready: bool = True,
    draining_since: float | None = None,
    terminating: bool = False,
) -> ObservedPod:
    return ObservedPod(index, f"x-decode-{index}", hash_, ready, draining_since, terminating)


def plan(
    pods: Iterable[ObservedPod],
    instances: int,
    max_unavailable: int = 1,
    drain_seconds: float = 30,
    now: float = 1000.0,
    role: Role = Role.DECODE,
) -> RolePlan:
    return plan_role(
        role,
        instances=instances,
        template_hash=NEW,
        pods=list(pods),
        max_unavailable=max_unavailable,
        drain_seconds=drain_seconds,
        now=now,
    )


def kinds(p: RolePlan) -> list[tuple[str, int]]:
    return [(a.kind.value, a.index) for a in p.actions]


def test_creates_every_missing_index_at_once() -> None:
    assert kinds(plan([], instances=3)) == [("create", 0), ("create", 1), ("create", 2)]


def test_converged_role_has_nothing_to_do() -> None:
    p = plan([pod(0), pod(1)], instances=2)
    assert p.actions == ()
    assert p.recheck_after is None


def test_deleted_pod_is_recreated_even_while_others_are_unready() -> None:
    p = plan([pod(0, ready=False), pod(2)], instances=3)
    assert kinds(p) == [("create", 1)]


def test_terminating_pod_is_waited_for_not_recreated() -> None:
    # Its name is still taken; the create comes once it is gone.
    assert plan([pod(0), pod(1, terminating=True)], instances=2).actions == ()


def test_template_change_drains_one_instance_first_not_deletes() -> None:
    p = plan([pod(i, OLD) for i in range(4)], instances=4)
    assert kinds(p) == [("drain", 3)]
    assert p.recheck_after == 30


def test_drain_is_deleted_only_after_drain_seconds() -> None:
    pods = [pod(0, OLD), pod(1, OLD, draining_since=990.0)]
    early = plan(pods, instances=2, drain_seconds=30, now=1000.0)
    assert early.actions == ()
    assert early.recheck_after == pytest.approx(20.0)
    late = plan(pods, instances=2, drain_seconds=30, now=1020.0)
    assert kinds(late) == [("delete", 1)]


def test_max_unavailable_bounds_concurrent_drains() -> None:
    pods = [pod(i, OLD) for i in range(6)]
    assert kinds(plan(pods, instances=6, max_unavailable=2)) == [("drain", 5), ("drain", 4)]


def test_unready_wanted_pod_uses_up_the_budget() -> None:
    pods = [pod(0, OLD), pod(1, OLD), pod(2, NEW, ready=False)]
    assert plan(pods, instances=3, max_unavailable=1).actions == ()


def test_replacement_waits_for_the_recreated_pod_to_be_ready() -> None:
    # Index 3 was replaced and its new pod is still starting: nothing else may go down.
    pods = [pod(0, OLD), pod(1, OLD), pod(2, OLD), pod(3, NEW, ready=False)]
    assert plan(pods, instances=4).actions == ()
    pods[3] = pod(3, NEW, ready=True)
    assert kinds(plan(pods, instances=4)) == [("drain", 2)]


def test_never_drains_a_role_to_zero_routable_when_it_had_more_than_one() -> None:
    p = plan([pod(0, OLD), pod(1, OLD)], instances=2, max_unavailable=5)
    assert kinds(p) == [("drain", 1)]


def test_single_instance_role_is_replaced_with_a_gap() -> None:
    # No surge: one instance can only be replaced by taking it down.
    assert kinds(plan([pod(0, OLD)], instances=1)) == [("drain", 0)]


def test_scale_down_removes_highest_index_first_one_at_a_time() -> None:
    p = plan([pod(i) for i in range(5)], instances=2, max_unavailable=1)
    assert kinds(p) == [("drain", 4)]
    # While 4 drains, nothing else starts.
    p = plan([pod(0), pod(1), pod(2), pod(3), pod(4, draining_since=999.0)], instances=2)
    assert p.actions == ()
    # Once 4 is gone, 3 is next.
    assert kinds(plan([pod(i) for i in range(4)], instances=2)) == [("drain", 3)]


def test_scale_down_with_larger_budget_drains_several() -> None:
    p = plan([pod(i) for i in range(5)], instances=2, max_unavailable=2)
    assert kinds(p) == [("drain", 4), ("drain", 3)]


def test_replacement_goes_before_scale_down_so_surplus_keeps_serving() -> None:
    p = plan([pod(0, OLD), pod(1, OLD), pod(2, OLD)], instances=1)
    assert kinds(p) == [("drain", 0)]


def test_unready_unwanted_pods_are_deleted_without_drain_or_budget() -> None:
    pods = [pod(0, OLD, ready=False), pod(1, OLD, ready=False), pod(2, ready=False)]
    p = plan(pods, instances=2)
    assert sorted(kinds(p)) == [("delete", 0), ("delete", 1), ("delete", 2)]


def test_draining_pod_wanted_again_is_undrained() -> None:
    # Scaled 3 -> 2 (index 2 draining), then back to 3.
    p = plan([pod(0), pod(1), pod(2, draining_since=995.0)], instances=3)
    assert kinds(p) == [("undrain", 2)]


def test_stale_draining_pod_is_not_undrained() -> None:
    p = plan([pod(0), pod(1, OLD, draining_since=995.0)], instances=2)
    assert p.actions == ()


def test_pod_without_template_hash_is_stale() -> None:
    p = plan([ObservedPod(0, "x-decode-0", None, True), pod(1)], instances=2)
    assert kinds(p) == [("drain", 0)]


def test_two_pods_for_one_index_are_refused() -> None:
    with pytest.raises(ValueError, match="index 0"):
        plan([pod(0), ObservedPod(0, "other", NEW, True)], instances=1)


def test_roles_are_planned_independently() -> None:
    # A prefill rollout yields only prefill actions; decode, converged, gets none.
    prefill = plan([pod(0, OLD), pod(1, OLD)], instances=2, role=Role.PREFILL)
    decode = plan([pod(0), pod(1)], instances=2, role=Role.DECODE)
    assert {a.role for a in prefill.actions} == {Role.PREFILL}
    assert decode.actions == ()


def test_apply_drains_marks_the_drained_and_clears_the_undrained() -> None:
    pods = (pod(0), pod(1, draining_since=5.0), pod(2, OLD))
    p = RolePlan(
        Role.DECODE,
        (Action(ActionKind.UNDRAIN, Role.DECODE, 1, ""), Action(ActionKind.DRAIN, Role.DECODE, 2, "")),
    )
    after = apply_drains(pods, p, now=42.0)
    assert [x.draining_since for x in after] == [None, None, 42.0]


# --- whole rollouts, simulated: the cluster is a dict of pods, time moves in steps ------------


def simulate(
    start: list[ObservedPod], instances: int, max_unavailable: int, drain: float = 3.0
) -> tuple[list[dict[int, ObservedPod]], list[str]]:
    """Runs the planner like the operator does until converged; pods become Ready one step after creation."""
    cluster = {p.index: p for p in start}
    history = []
    log: list[str] = []
    now = 0.0
    for _ in range(200):
        p = plan(cluster.values(), instances, max_unavailable, drain, now)
        history.append(dict(cluster))
        settled = all(x.template_hash == NEW and x.ready for x in cluster.values())
        converged = settled and len(cluster) == instances
        if converged and not p.actions:
            return history, log
        for a in p.actions:
            log.append(f"{a.kind.value} {a.index}")
            if a.kind is ActionKind.CREATE:
                cluster[a.index] = pod(a.index, NEW, ready=False)
            elif a.kind is ActionKind.DELETE:
                del cluster[a.index]
            elif a.kind is ActionKind.DRAIN:
                cluster[a.index] = pod(a.index, cluster[a.index].template_hash, True, now)
            elif a.kind is ActionKind.UNDRAIN:
                cluster[a.index] = pod(a.index, cluster[a.index].template_hash, True, None)
        now += 1.0
        # Pods created in an earlier step become Ready.
        for i, x in list(cluster.items()):
            if not x.ready and x.template_hash == NEW and f"create {i}" in log:
                cluster[i] = pod(i, NEW, True, x.draining_since)
    raise AssertionError(f"did not converge: {log}")


@pytest.mark.parametrize(("instances", "max_unavailable"), [(1, 1), (2, 1), (4, 1), (4, 2), (5, 3)])
def test_full_rollout_respects_budget_drains_before_delete_and_keeps_one_routable(
    instances: int, max_unavailable: int
) -> None:
    history, log = simulate([pod(i, OLD) for i in range(instances)], instances, max_unavailable)
    for snapshot in history:
        unavailable = sum(1 for i in range(instances) if i not in snapshot or not snapshot[i].routable)
        assert unavailable <= max_unavailable
        if instances > 1:
            assert any(p.routable for p in snapshot.values())
    # Every delete follows a drain of the same index.
    for n, entry in enumerate(log):
        if entry.startswith("delete"):
            index = entry.split()[1]
            assert f"drain {index}" in log[:n]
    assert sorted(e for e in log if e.startswith("delete")) == sorted(f"delete {i}" for i in range(instances))


def test_full_scale_down_drains_each_removed_pod_in_descending_order() -> None:
    _, log = simulate([pod(i) for i in range(5)], instances=2, max_unavailable=1)
    assert [e for e in log if e.startswith("drain")] == ["drain 4", "drain 3", "drain 2"]
    assert [e for e in log if e.startswith("delete")] == ["delete 4", "delete 3", "delete 2"]
