"""Multi-node groups judged as one unit (pdserve.deployment.plan.gangs,
pdserve.operator.cluster.views.gang_pass)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.plan.gangs import (
    Group,
    Member,
    Verdict,
    judge,
)
from pdserve.deployment.render.names import (
    GROUP_FORMED_ANNOTATION,
    GROUP_LABEL,
    GROUP_NODE_LABEL,
    GROUP_SIZE_ANNOTATION,
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
)
from pdserve.deployment.render.routing_table import NodeEndpoint
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.operator.cluster.views import gang_pass, lws_stand_in, pod_view
from tests.support.specs import sim_manifest

TIMEOUT = 600.0
NOW = 10_000.0


def member(rank: int, **kw: Any) -> Member:
    ready = kw.pop("ready", True)
    return Member(
        name=f"g-prefill-0-abcde{'' if rank == 0 else f'-{rank}'}",
        node_rank=rank,
        ready=ready,
        unready_since=None if ready else kw.pop("unready_since", NOW - 10),
        ip=kw.pop("ip", f"127.128.0.{rank + 1}"),
        **kw,
    )


def group(*members: Member, size: int = 3, formed: bool = True) -> Group:
    return Group("g-prefill-0-abcde", size, members, formed)


def test_a_whole_ready_group_is_ready() -> None:
    g = group(member(0), member(1), member(2))
    assert g.ready and judge(g, NOW, TIMEOUT).verdict is Verdict.WHOLE


def test_a_new_leader_gets_its_workers_once_it_has_an_address() -> None:
    waiting = judge(group(member(0, ready=False, ip=None), formed=False), NOW, TIMEOUT)
    assert waiting.verdict is Verdict.FORMING and waiting.create == ()
    addressed = judge(group(member(0, ready=False), formed=False), NOW, TIMEOUT)
    assert addressed.verdict is Verdict.FORMING and addressed.create == (1, 2)
    assert addressed.recheck_after == pytest.approx(TIMEOUT - 10)


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ((member(0), member(1, failed=True), member(2)), "restarted"),
        ((member(0), member(1, terminating=True), member(2)), "being deleted"),
        ((member(0), member(2)), "node 1 of the group is gone"),
        ((member(1), member(2)), "leader gone"),
        ((member(0, terminating=True), member(1), member(2)), "leader gone"),
    ],
)
def test_a_formed_group_that_loses_a_member_is_broken(members: tuple[Member, ...], why: str) -> None:
    verdict = judge(group(*members), NOW, TIMEOUT)
    assert verdict.verdict is Verdict.BROKEN and why in verdict.reason


def test_a_group_going_away_whole_is_not_broken_again() -> None:
    g = group(member(0, terminating=True), member(1, terminating=True), member(2, terminating=True))
    assert judge(g, NOW, TIMEOUT).verdict is Verdict.WHOLE


def test_gang_timeout_replaces_a_group_that_never_became_whole() -> None:
    late = member(2, ready=False, unready_since=NOW - TIMEOUT - 1, unschedulable=True)
    verdict = judge(group(member(0, ready=False), member(1), late), NOW, TIMEOUT)
    assert verdict.verdict is Verdict.BROKEN
    assert f"gang timeout: pod {late.name} not scheduled after 601s" in verdict.reason
    on_time = judge(group(member(0), member(1), member(2, ready=False)), NOW, TIMEOUT)
    assert on_time.verdict is Verdict.WHOLE and on_time.recheck_after == pytest.approx(TIMEOUT - 10)


# --- pods read into units ---------------------------------------------------------------------

SPEC = sim_manifest(
    "g",
    metadata={"namespace": "ns", "uid": "u1", "generation": 1},
    model="m",
    prefill={"instances": 1, "dataParallel": 4},
    decode={"instances": 1},
)


def pod(
    name: str, rank: int, ready: bool = True, ip: str | None = "127.128.0.9", **extra: Any
) -> dict[str, Any]:
    labels = {
        ROLE_LABEL: "prefill",
        INSTANCE_LABEL: "0",
        TEMPLATE_HASH_LABEL: "h",
        GROUP_LABEL: "g-prefill-0-abcde",
        GROUP_NODE_LABEL: str(rank),
    }
    annotations = {GROUP_SIZE_ANNOTATION: "2", **extra.pop("annotations", {})}
    args = [
        "--data-parallel-hybrid-lb",
        "--data-parallel-start-rank",
        str(2 * rank),
        "--data-parallel-size-local",
        "2",
    ]
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": annotations,
            "creationTimestamp": "2026-12-04T10:00:00Z",
        },
        "spec": {"containers": [{"name": "engine", "args": args}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **extra,
        },
    }


def views(*pods: dict[str, Any]) -> list[Any]:
    pdd = parse_pddeployment(SPEC)
    out = [pod_view(pdd, p, lambda _node: None) for p in pods]
    assert all(v is not None for v in out)
    return out


def test_gang_pass_makes_one_ready_unit_with_per_node_endpoints() -> None:
    got = gang_pass(
        views(
            pod("g-prefill-0-abcde", 0, ip="127.128.0.1", annotations={GROUP_FORMED_ANNOTATION: "x"}),
            pod("g-prefill-0-abcde-1", 1, ip="127.128.0.2"),
        ),
        NOW,
        TIMEOUT,
    )
    assert not got.broken and not got.forming and len(got.units) == 1
    unit = got.units[0]
    assert unit.observed.name == "g-prefill-0-abcde" and unit.observed.ready
    assert unit.pod_names == ("g-prefill-0-abcde", "g-prefill-0-abcde-1")
    assert unit.endpoints == (NodeEndpoint("127.128.0.1", 0, 2), NodeEndpoint("127.128.0.2", 2, 2))


def test_gang_pass_breaks_a_group_whose_worker_restarted() -> None:
    restarted = {"containerStatuses": [{"name": "engine", "restartCount": 1}]}
    got = gang_pass(
        views(
            pod("g-prefill-0-abcde", 0, annotations={GROUP_FORMED_ANNOTATION: "x"}),
            pod("g-prefill-0-abcde-1", 1, **restarted),
        ),
        NOW,
        TIMEOUT,
    )
    assert got.units == [] and len(got.broken) == 1
    unit, why = got.broken[0]
    assert "g-prefill-0-abcde-1 failed or restarted" in why
    assert [name for name, _ in unit.members] == ["g-prefill-0-abcde", "g-prefill-0-abcde-1"]


def test_gang_pass_asks_for_the_workers_of_a_new_leader() -> None:
    got = gang_pass(views(pod("g-prefill-0-abcde", 0, ready=False)), NOW, TIMEOUT)
    assert not got.broken and len(got.units) == 1 and not got.units[0].observed.ready
    assert [(u.observed.name, ranks) for u, ranks in got.forming] == [("g-prefill-0-abcde", (1,))]


def test_a_leaderworkerset_without_pods_stands_for_its_group() -> None:
    """Backend lws: until the controller creates the pods (or while it restarts the group), the
    object is one unit, not Ready and not forming (the controller makes the members)."""
    pdd = parse_pddeployment(SPEC)
    lws = {
        "metadata": {
            "name": "g-prefill-0-abcde",
            "namespace": "ns",
            "creationTimestamp": "2026-12-04T10:00:00Z",
        },
        "spec": {"leaderWorkerTemplate": {"leaderTemplate": pod("ignored", 0)}},
    }
    stand_in = lws_stand_in(lws)
    assert stand_in is not None and stand_in["metadata"]["name"] == "g-prefill-0-abcde-0"
    assert "resourceVersion" not in stand_in["metadata"]
    view = pod_view(pdd, stand_in, lambda _node: None)
    assert view is not None and view.lws
    got = gang_pass([view], NOW, TIMEOUT)
    assert not got.broken and not got.forming and len(got.units) == 1
    unit = got.units[0]
    assert (
        unit.observed.name == "g-prefill-0-abcde"
        and not unit.observed.ready
        and not unit.observed.terminating
    )
    assert unit.leader_pod == "g-prefill-0-abcde-0"
    assert lws_stand_in({**lws, "metadata": {**lws["metadata"], "deletionTimestamp": "x"}}) is None
