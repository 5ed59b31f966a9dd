"""Rollout planning: every rule of pdserve.deployment.plan.rollout, and whole rollouts driven to the end."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace

import pytest

from pdserve.deployment.plan.rollout import (
    Action,
    ActionKind,
    ObservedPod,
    RolePlan,
    RolloutPolicy,
    apply_drains,
    plan_role,
    replacement_allowance,
    revisions_to_keep,
)
from pdserve.routing.table import Role

NEW = "new"
OLD = "old"


def pod(
    index: int,
    hash_: str | None = NEW,
    ready: bool = True,
    draining_since: float | None = None,
    terminating: bool = False,
    name: str = "",
    node_down_since: float | None = None,
    unschedulable: bool = False,
    created: float = 0.0,
) -> ObservedPod:
    return ObservedPod(
        index,
        name or f"x-decode-{index}-{hash_}",
        hash_,
        ready,
        draining_since,
        terminating,
        node_down_since=node_down_since,
        unschedulable=unschedulable,
        created=created,
    )


def plan(
    pods: Iterable[ObservedPod],
    instances: int,
    max_unavailable: int = 1,
    drain_seconds: float = 30,
    now: float = 1000.0,
    role: Role = Role.DECODE,
    max_surge: int = 0,
    node_loss_seconds: float = 300,
    released: dict[str, str] | None = None,
) -> RolePlan:
    """Planned with no surge unless asked: the in-place rules, as before surge existed."""
    return plan_role(
        role,
        instances=instances,
        template_hash=NEW,
        pods=list(pods),
        policy=RolloutPolicy(max_unavailable, max_surge, drain_seconds, node_loss_seconds),
        now=now,
        released=released,
    )


def kinds(p: RolePlan) -> list[tuple[str, int]]:
    return [(a.kind.value, a.index) for a in p.actions]


# --- in place (maxSurge 0) ------------------------------------------------------------------------


def test_creates_every_missing_index_at_once() -> None:
    assert kinds(plan([], instances=3)) == [("create", 0), ("create", 1), ("create", 2)]


def test_converged_role_has_nothing_to_do() -> None:
    for surge in (0, 1):
        p = plan([pod(0), pod(1)], instances=2, max_surge=surge)
        assert p.actions == ()
        assert p.recheck_after is None


def test_deleted_pod_is_recreated_even_while_others_are_unready() -> None:
    p = plan([pod(0, ready=False), pod(2)], instances=3)
    assert kinds(p) == [("create", 1)]


def test_terminating_pod_does_not_hold_its_index() -> None:
    # Names are unique: the replacement starts while the old pod terminates (an eviction, a delete).
    p = plan([pod(0), pod(1, terminating=True)], instances=2)
    assert kinds(p) == [("create", 1)]


def test_template_change_drains_one_instance_first_not_deletes() -> None:
    p = plan([pod(i, OLD) for i in range(4)], instances=4)
    assert kinds(p) == [("drain", 3)]
    assert p.actions[0].pod == "x-decode-3-old"
    assert p.recheck_after == 30


def test_in_place_replacement_is_created_once_the_old_pod_is_deleted() -> None:
    draining = [pod(0, OLD), pod(1, OLD, draining_since=995.0)]
    assert plan(draining, instances=2).actions == ()  # the old pod still holds index 1
    gone = [pod(0, OLD), pod(1, OLD, draining_since=900.0, terminating=True)]
    assert kinds(plan(gone, instances=2)) == [("create", 1)]


def test_drain_is_deleted_only_after_drain_seconds() -> None:
    pods = [pod(0, OLD), pod(1, OLD, draining_since=990.0)]
    early = plan(pods, instances=2, drain_seconds=30, now=1000.0)
    assert early.actions == ()
    assert early.recheck_after == pytest.approx(20.0)
    late = plan(pods, instances=2, drain_seconds=30, now=1020.0)
    assert kinds(late) == [("delete", 1), ("create", 1)]  # the replacement starts as the old pod goes


def test_released_drain_is_deleted_early_by_name() -> None:
    pods = [pod(0, OLD), pod(1, OLD, draining_since=999.0)]
    p = plan(pods, instances=2, released={"x-decode-1-old": "drained: routers-idle"})
    assert [(a.kind.value, a.pod, a.reason) for a in p.actions] == [
        ("delete", "x-decode-1-old", "drained: routers-idle"),
        ("create", "", "missing"),
    ]


def test_max_unavailable_bounds_concurrent_drains() -> None:
    pods = [pod(i, OLD) for i in range(6)]
    assert kinds(plan(pods, instances=6, max_unavailable=2)) == [("drain", 5), ("drain", 4)]


def test_unready_wanted_pod_uses_up_the_budget() -> None:
    pods = [pod(0, OLD), pod(1, OLD), pod(2, NEW, ready=False)]
    assert plan(pods, instances=3, max_unavailable=1).actions == ()


def test_replacement_waits_for_the_recreated_pod_to_be_ready() -> None:
    pods = [pod(0, OLD), pod(1, OLD), pod(2, OLD), pod(3, NEW, ready=False)]
    assert plan(pods, instances=4).actions == ()
    pods[3] = pod(3, NEW, ready=True)
    assert kinds(plan(pods, instances=4)) == [("drain", 2)]


def test_never_drains_a_role_to_zero_routable_when_it_had_more_than_one() -> None:
    p = plan([pod(0, OLD), pod(1, OLD)], instances=2, max_unavailable=5)
    assert kinds(p) == [("drain", 1)]


def test_single_instance_role_without_surge_is_replaced_with_a_gap() -> None:
    assert kinds(plan([pod(0, OLD)], instances=1)) == [("drain", 0)]


def test_scale_down_removes_highest_index_first_one_at_a_time() -> None:
    p = plan([pod(i) for i in range(5)], instances=2, max_unavailable=1)
    assert kinds(p) == [("drain", 4)]
    p = plan([pod(0), pod(1), pod(2), pod(3), pod(4, draining_since=999.0)], instances=2)
    assert p.actions == ()
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
    assert sorted(kinds(p)) == [("create", 0), ("create", 1), ("delete", 0), ("delete", 1), ("delete", 2)]


def test_draining_pod_wanted_again_is_undrained() -> None:
    p = plan([pod(0), pod(1), pod(2, draining_since=995.0)], instances=3)
    assert kinds(p) == [("undrain", 2)]


def test_stale_draining_pod_is_not_undrained() -> None:
    p = plan([pod(0), pod(1, OLD, draining_since=995.0)], instances=2)
    assert p.actions == ()


def test_pod_without_template_hash_is_stale() -> None:
    p = plan([pod(0, None), pod(1)], instances=2)
    assert kinds(p) == [("drain", 0)]


def test_roles_are_planned_independently() -> None:
    prefill = plan([pod(0, OLD), pod(1, OLD)], instances=2, role=Role.PREFILL)
    decode = plan([pod(0), pod(1)], instances=2, role=Role.DECODE)
    assert {a.role for a in prefill.actions} == {Role.PREFILL}
    assert decode.actions == ()


# --- surge ------------------------------------------------------------------------------------------


def test_surge_creates_the_new_instance_first_and_drains_nothing() -> None:
    p = plan([pod(i, OLD) for i in range(4)], instances=4, max_surge=1)
    assert [(a.kind.value, a.index, a.reason) for a in p.actions] == [
        ("create", 3, "surge: replaces x-decode-3-old")
    ]


def test_surge_waits_for_the_new_pod_then_drains_the_old_in_the_same_pass() -> None:
    starting = [pod(0, OLD), pod(1, OLD), pod(1, NEW, ready=False)]
    assert plan(starting, instances=2, max_surge=1).actions == ()  # budget used, old 1 keeps serving
    ready = [pod(0, OLD), pod(1, OLD), pod(1, NEW)]
    p = plan(ready, instances=2, max_surge=1)
    assert [(a.kind.value, a.pod) for a in p.actions] == [("drain", "x-decode-1-old")]
    assert p.actions[0].reason == "replaced by x-decode-1-new"


def test_surge_budget_counts_draining_old_pods_until_they_terminate() -> None:
    pods = [pod(0, OLD), pod(1, OLD, draining_since=995.0), pod(1, NEW)]
    assert plan(pods, instances=2, max_surge=1).actions == ()
    pods[1] = pod(1, OLD, draining_since=995.0, terminating=True)
    assert kinds(plan(pods, instances=2, max_surge=1)) == [("create", 0)]


def test_surge_of_two_replaces_two_at_once() -> None:
    p = plan([pod(i, OLD) for i in range(4)], instances=4, max_surge=2)
    assert kinds(p) == [("create", 3), ("create", 2)]


def test_single_instance_role_with_surge_has_no_gap() -> None:
    assert kinds(plan([pod(0, OLD)], instances=1, max_surge=1)) == [("create", 0)]
    p = plan([pod(0, OLD), pod(0, NEW)], instances=1, max_surge=1)
    assert [(a.kind.value, a.pod) for a in p.actions] == [("drain", "x-decode-0-old")]


def test_unschedulable_surge_pod_falls_back_to_a_drain_within_max_unavailable() -> None:
    pods = [pod(0, OLD), pod(1, OLD), pod(1, NEW, ready=False, unschedulable=True)]
    p = plan(pods, instances=2, max_surge=1, max_unavailable=1)
    assert [(a.kind.value, a.pod) for a in p.actions] == [("drain", "x-decode-1-old")]
    assert plan(pods, instances=2, max_surge=1, max_unavailable=0).actions == ()


def test_surge_and_no_unavailability_waits_for_room() -> None:
    # maxUnavailable 0: a rollout never takes an instance down; it waits for the scheduler.
    pods = [pod(0, OLD), pod(0, NEW, ready=False)]
    assert plan(pods, instances=1, max_surge=1, max_unavailable=0).actions == ()


def test_broken_new_template_keeps_the_old_pods_serving() -> None:
    # The surge pod never becomes Ready: nothing old is drained, whatever the budget.
    pods = [pod(0, OLD), pod(1, OLD), pod(1, NEW, ready=False)]
    assert plan(pods, instances=2, max_surge=1, max_unavailable=2).actions == ()


def test_reverted_template_deletes_the_unready_surge_pod_and_keeps_the_old() -> None:
    # The "old" pod is current again; the surge pod of the abandoned template goes.
    pods = [pod(0, NEW, name="a"), pod(0, "abandoned", ready=False, name="b")]
    p = plan(pods, instances=1, max_surge=1)
    assert [(a.kind.value, a.pod) for a in p.actions] == [("delete", "b")]


def test_scale_down_blocks_surge_until_the_surplus_is_gone() -> None:
    pods = [pod(0, OLD), pod(1, OLD), pod(2, OLD)]
    p = plan(pods, instances=2, max_surge=1)
    assert kinds(p) == [("drain", 2)]


# --- lost nodes and duplicates --------------------------------------------------------------------


def test_pod_on_a_notready_node_waits_for_the_grace_then_is_replaced() -> None:
    down = [pod(0), pod(1, node_down_since=900.0)]
    early = plan(down, instances=2, now=1000.0, node_loss_seconds=300)
    assert early.actions == ()
    assert early.recheck_after == pytest.approx(200.0)
    late = plan(down, instances=2, now=1200.0, node_loss_seconds=300)
    assert [(a.kind.value, a.index, a.node_lost) for a in late.actions] == [
        ("delete", 1, True),
        ("create", 1, False),
    ]
    assert late.actions[0].reason == "node lost: NotReady for 300s"


def test_lost_pod_stuck_terminating_neither_blocks_its_index_nor_the_budget() -> None:
    stuck = pod(2, terminating=True, node_down_since=0.0)
    p = plan([pod(0), pod(1), stuck], instances=2)
    assert p.actions == ()  # index 2 is past instances: a stuck removal is not "in flight"
    p = plan([pod(0), pod(1, terminating=True, node_down_since=0.0)], instances=2)
    assert kinds(p) == [("create", 1)]


def test_pod_on_a_notready_node_is_not_routable_and_costs_the_budget() -> None:
    pods = [pod(0, OLD), pod(1, OLD, node_down_since=999.0)]
    assert not pods[1].routable
    assert plan(pods, instances=2, max_unavailable=1).actions == ()


def test_duplicate_current_pods_keep_the_ready_oldest() -> None:
    pods = [
        pod(0, name="young", created=20.0),
        pod(0, name="old", created=10.0),
        pod(0, name="unready", ready=False, created=5.0),
    ]
    p = plan(pods, instances=1)
    assert sorted((a.kind.value, a.pod, a.reason) for a in p.actions) == [
        ("delete", "unready", "duplicate of old, not ready"),
        ("drain", "young", "duplicate"),
    ]


def test_apply_drains_marks_the_drained_and_clears_the_undrained() -> None:
    pods = (pod(0), pod(1, draining_since=5.0), pod(2, OLD))
    p = RolePlan(
        Role.DECODE,
        (
            Action(ActionKind.UNDRAIN, Role.DECODE, 1, "", pods[1].name),
            Action(ActionKind.DRAIN, Role.DECODE, 2, "", pods[2].name),
        ),
    )
    after = apply_drains(pods, p, now=42.0)
    assert [x.draining_since for x in after] == [None, None, 42.0]


# --- whole rollouts, simulated: the cluster is a dict of pods, time moves in steps ------------


def simulate(
    start: list[ObservedPod],
    instances: int,
    max_unavailable: int,
    max_surge: int = 0,
    drain: float = 3.0,
    room: int | None = None,
) -> tuple[list[list[ObservedPod]], list[str]]:
    """Runs the planner like the operator does until converged; returns what each pass's table showed.

    Pods become Ready one step after creation; ``room`` is how many pods fit at once (the
    scheduler's verdict: pods past it are unschedulable until others are deleted).
    """
    cluster = {p.name: p for p in start}
    names = itertools.count()
    history = []
    log: list[str] = []
    now = 0.0
    for _ in range(300):
        p = plan(cluster.values(), instances, max_unavailable, drain, now, max_surge=max_surge)
        converged = sorted((x.index, x.template_hash, x.routable) for x in cluster.values()) == [
            (i, NEW, True) for i in range(instances)
        ]
        if converged and not p.actions:
            return history, log
        for a in p.actions:
            log.append(f"{a.kind.value} {a.index}")
            if a.kind is ActionKind.CREATE:
                name = f"new-{a.index}-{next(names)}"
                cluster[name] = pod(a.index, NEW, ready=False, name=name, created=now)
            elif a.kind is ActionKind.DELETE:
                del cluster[a.pod]
            elif a.kind is ActionKind.DRAIN:
                cluster[a.pod] = ObservedPod(**{**cluster[a.pod].__dict__, "draining_since": now})
            elif a.kind is ActionKind.UNDRAIN:
                cluster[a.pod] = ObservedPod(**{**cluster[a.pod].__dict__, "draining_since": None})
        history.append(list(cluster.values()))  # what the table of this pass shows
        now += 1.0
        by_age = sorted(cluster.values(), key=lambda x: (x.created, x.name))
        for n, x in enumerate(by_age):
            fits = room is None or n < room
            if x.template_hash == NEW and x.created < now - 0.5:
                cluster[x.name] = ObservedPod(**{**x.__dict__, "ready": fits, "unschedulable": not fits})
    raise AssertionError(f"did not converge: {log}")


@pytest.mark.parametrize(
    ("instances", "max_unavailable", "max_surge"),
    [(1, 1, 0), (2, 1, 0), (4, 1, 0), (4, 2, 0), (5, 3, 0), (1, 1, 1), (4, 1, 1), (4, 0, 1), (5, 1, 2)],
)
def test_full_rollout_respects_budgets_drains_before_delete_and_keeps_one_routable(
    instances: int, max_unavailable: int, max_surge: int
) -> None:
    start = [pod(i, OLD) for i in range(instances)]
    history, log = simulate(start, instances, max_unavailable, max_surge)
    for snapshot in history:
        unavailable = sum(
            1 for i in range(instances) if not any(p.index == i and p.routable for p in snapshot)
        )
        assert unavailable <= max_unavailable
        if max_surge:
            assert unavailable == 0  # there is room: surge never takes capacity away
        if instances > 1 or max_surge:
            assert any(p.routable for p in snapshot)
        assert len([p for p in snapshot if not p.terminating]) <= instances + max_surge
        for i in range(instances):  # at most one routable pod per index
            assert sum(1 for p in snapshot if p.index == i and p.routable) <= 1
    for n, entry in enumerate(log):
        if entry.startswith("delete"):
            assert f"drain {entry.split()[1]}" in log[:n]
    assert sorted(e for e in log if e.startswith("delete")) == sorted(f"delete {i}" for i in range(instances))


def test_surge_without_room_still_finishes_in_place() -> None:
    # Exactly room for the wanted pods: each surge pod is unschedulable, so each step goes in place.
    history, log = simulate([pod(i, OLD) for i in range(3)], 3, max_unavailable=1, max_surge=1, room=3)
    for snapshot in history:
        assert sum(1 for i in range(3) if not any(p.index == i and p.routable for p in snapshot)) <= 1
    assert sorted(e for e in log if e.startswith("delete")) == ["delete 0", "delete 1", "delete 2"]


def test_full_scale_down_drains_each_removed_pod_in_descending_order() -> None:
    _, log = simulate([pod(i) for i in range(5)], instances=2, max_unavailable=1)
    assert [e for e in log if e.startswith("drain")] == ["drain 4", "drain 3", "drain 2"]
    assert [e for e in log if e.startswith("delete")] == ["delete 4", "delete 3", "delete 2"]


# --- rollouts that change what both roles share (the pairing revision) ----------------------------


def test_last_pod_of_a_still_paired_revision_stays_until_the_new_one_is_paired() -> None:
    keep = revisions_to_keep({Role.PREFILL: ["A", "B"], Role.DECODE: ["A"]}, {r: "B" for r in Role})
    assert keep == {Role.PREFILL: frozenset({"A"}), Role.DECODE: frozenset({"A"})}
    # Prefill: A at index 0 has its B replacement Ready, but it is the last A while decode is all A.
    pods = [
        ObservedPod(0, "p0-a", OLD, True, revision="A"),
        ObservedPod(0, "p0-b", NEW, True, revision="B"),
        ObservedPod(1, "p1-b", NEW, True, revision="B"),
    ]

    def plan_prefill(keep_revisions: frozenset[str]) -> RolePlan:
        policy = RolloutPolicy(max_surge=1)
        return plan_role(
            Role.PREFILL,
            instances=2,
            template_hash=NEW,
            pods=pods,
            policy=policy,
            now=0.0,
            keep_revisions=keep_revisions,
        )

    assert plan_prefill(keep[Role.PREFILL]).actions == ()
    freed = revisions_to_keep({Role.PREFILL: ["A", "B"], Role.DECODE: ["A", "B"]}, {r: "B" for r in Role})
    assert freed == {Role.PREFILL: frozenset(), Role.DECODE: frozenset()}
    assert [(a.kind.value, a.pod) for a in plan_prefill(freed[Role.PREFILL]).actions] == [("drain", "p0-a")]


@pytest.mark.parametrize(
    ("prefill", "decode", "max_surge", "max_unavailable"),
    [(2, 2, 1, 1), (1, 3, 1, 1), (3, 2, 0, 1), (4, 4, 1, 1), (2, 6, 1, 1)],
)
def test_shared_rollout_always_leaves_a_revision_routable_on_both_sides(
    prefill: int, decode: int, max_surge: int, max_unavailable: int
) -> None:
    """Both roles change revision A -> B, planned independently each pass; prefill pods get Ready
    a pass after creation, decode pods four. Some revision is always paired, and neither role
    has more pods on B than one instance ahead of the other at the spec's ratio."""
    sizes = {Role.PREFILL: prefill, Role.DECODE: decode}
    cluster: dict[str, tuple[Role, ObservedPod]] = {
        f"{r.value}-{i}-a": (r, ObservedPod(i, f"{r.value}-{i}-a", OLD, True, revision="A"))
        for r in Role
        for i in range(sizes[r])
    }
    names = itertools.count()
    policy = RolloutPolicy(max_unavailable, max_surge, drain_seconds=2.0)
    for step in range(400):
        now = float(step)
        pods = {r: [p for role, p in cluster.values() if role is r] for r in Role}
        routable = {r: [p.revision for p in pods[r] if p.routable] for r in Role}
        keep = revisions_to_keep(routable, {r: "B" for r in Role})
        on_b = {r: sum(1 for p in pods[r] if p.revision == "B" and not p.terminating) for r in Role}
        allowance = replacement_allowance(
            on_b, sizes, shared=any(p.revision == "A" for r in Role for p in pods[r])
        )
        plans = {
            r: plan_role(
                r,
                instances=sizes[r],
                template_hash=NEW,
                pods=pods[r],
                policy=policy,
                now=now,
                keep_revisions=keep[r],
                max_starts=allowance[r],
            )
            for r in Role
        }
        if not any(p.actions for p in plans.values()) and all(
            sorted(p.index for p in pods[r] if p.routable and p.revision == "B") == list(range(sizes[r]))
            and len(pods[r]) == sizes[r]
            for r in Role
        ):
            return
        for r, plan in plans.items():
            for a in plan.actions:
                if a.kind is ActionKind.CREATE:
                    name = f"{r.value}-{a.index}-b{next(names)}"
                    cluster[name] = (r, ObservedPod(a.index, name, NEW, False, created=now, revision="B"))
                elif a.kind is ActionKind.DELETE:
                    del cluster[a.pod]
                else:
                    since = now if a.kind is ActionKind.DRAIN else None
                    cluster[a.pod] = (r, replace(cluster[a.pod][1], draining_since=since))
        after = {r: {p.revision for role, p in cluster.values() if role is r and p.routable} for r in Role}
        assert after[Role.PREFILL] & after[Role.DECODE], (step, after)
        on_b = {r: sum(1 for role, p in cluster.values() if role is r and p.revision == "B") for r in Role}
        for r, other in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
            ahead = on_b[r] / sizes[r] - on_b[other] / sizes[other]
            assert ahead <= 1 / sizes[other] + 1 / sizes[r] + 1e-9 or on_b[other] == sizes[other], (
                step,
                on_b,
            )
        for name, (r, p) in list(cluster.items()):
            startup = 1.0 if r is Role.PREFILL else 4.0  # decode loads for longer: prefill finishes first
            if not p.ready and now - p.created >= startup - 0.5:
                cluster[name] = (r, replace(p, ready=True))
    raise AssertionError("did not converge")


def test_replacement_allowance_keeps_the_new_revision_at_the_spec_ratio() -> None:
    wanted = {Role.PREFILL: 2, Role.DECODE: 6}
    assert replacement_allowance({Role.PREFILL: 0, Role.DECODE: 0}, wanted, shared=False) == {
        Role.PREFILL: None,
        Role.DECODE: None,
    }
    # Nothing on the new revision yet: prefill may start 1 (ceil(1 * 2/6)), decode 3 (1 * 6/2).
    assert replacement_allowance({Role.PREFILL: 0, Role.DECODE: 0}, wanted, shared=True) == {
        Role.PREFILL: 1,
        Role.DECODE: 3,
    }
    # Prefill ran ahead (2 of 2) while decode has 1 of 6: decode may catch up, prefill is done.
    assert replacement_allowance({Role.PREFILL: 2, Role.DECODE: 1}, wanted, shared=True) == {
        Role.PREFILL: 0,
        Role.DECODE: 8,
    }
