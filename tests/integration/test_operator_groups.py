"""Multi-node instances on the real API server (pods backend): a group forms leader first, routes
only when whole, is replaced whole when a member goes, and a group that cannot be placed is
removed after the gang timeout. ``engine: vllm`` pods land on kwok's four 8-GPU nodes (Ready,
nothing runs), so the groups are real pods scheduled by the real scheduler."""

from __future__ import annotations

import json
from typing import Any

from pdserve.routing.table import RoutingTable
from tests.support.kube import eventually
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    Recorder,
    events,
    pdd_manifest,
    pod_ready,
    ready,
    tables,
)

GROUP = "pdserve.io/group"
NODE_RANK = "pdserve.io/group-node"


def group_manifest(name: str, *, prefill_instances: int = 1, gang_timeout: int = 600) -> dict[str, Any]:
    """Prefill DP16 on 8-GPU nodes: two pods per instance (ranks 0-7 and 8-15); decode DP8: one."""
    doc = pdd_manifest(name, prefill_instances=prefill_instances, prefill_dp=16, decode_instances=1)
    doc["spec"]["decode"]["dataParallel"] = 8
    doc["spec"]["multiNode"] = {"gangTimeoutSeconds": gang_timeout}
    return doc


def groups(cluster: Cluster, name: str, role: str = "prefill") -> dict[str, list[dict[str, Any]]]:
    """Live pods of the role, by group (the leader's name)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for pod in cluster.pods(name):
        meta = pod["metadata"]
        if meta["labels"].get("pdserve.io/role") == role and not meta.get("deletionTimestamp"):
            out.setdefault(meta["labels"].get(GROUP, meta["name"]), []).append(pod)
    return out


def whole_groups(cluster: Cluster, name: str) -> dict[str, list[dict[str, Any]]]:
    return {g: ps for g, ps in groups(cluster, name).items() if len(ps) == 2 and all(map(pod_ready, ps))}


def prefill(table: RoutingTable | None) -> list[Any]:
    return list(table.prefill) if table else []


def test_a_group_forms_leader_first_and_routes_per_node(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(group_manifest("mn"))
    eventually(lambda: ready(cluster, "mn"), timeout=WAIT)
    (leader, members), *_ = whole_groups(cluster, "mn").items()
    by_rank = {int(p["metadata"]["labels"][NODE_RANK]): p for p in members}
    assert by_rank[0]["metadata"]["name"] == leader and by_rank[1]["metadata"]["name"] == f"{leader}-1"
    assert by_rank[0]["spec"]["nodeName"] != by_rank[1]["spec"]["nodeName"]  # one node each
    env = {e["name"]: e.get("value") for e in by_rank[1]["spec"]["containers"][0]["env"]}
    assert env["PDSERVE_LEADER_ADDRESS"] == by_rank[0]["status"]["podIP"]  # the leader's address
    assert by_rank[0]["metadata"]["annotations"]["pdserve.io/group-formed"]
    (instance,) = prefill(cluster.table("mn"))
    assert instance.name == leader and instance.dp_size == 16 and instance.routable
    ips = [by_rank[r]["status"]["podIP"] for r in (0, 1)]
    assert [(e.url, e.first_rank, e.ranks) for e in instance.endpoints] == [
        (f"http://{ips[0]}:8000", 0, 8),
        (f"http://{ips[1]}:8000", 8, 8),
    ]
    status = cluster.status("mn")["prefill"]
    assert (status["readyInstances"], status["pods"], status["readyPods"]) == (1, 2, 2)


def test_a_deleted_worker_takes_its_group_out_of_the_table_and_the_group_is_replaced(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    cluster.apply(group_manifest("mnr"))
    eventually(lambda: ready(cluster, "mnr"), timeout=WAIT)
    (old, _), *_ = whole_groups(cluster, "mnr").items()
    recorder.start()
    cluster.kubectl("delete", "pod", f"{old}-1", "--wait=false")
    eventually(lambda: old not in groups(cluster, "mnr"), timeout=WAIT)  # the leader went with it
    eventually(lambda: ready(cluster, "mnr") and old not in whole_groups(cluster, "mnr"), timeout=WAIT)
    (new, _), *_ = whole_groups(cluster, "mnr").items()
    assert new != old
    records = recorder.stop()
    # The old group left the table before its leader was deleted, and never came back.
    written = sorted(tables(records), key=lambda st: st[0])

    def routes_old(t: RoutingTable) -> bool:
        return any(i.name == old and i.routable for i in prefill(t))

    served = next(seq for seq, t in written if routes_old(t))
    left = next(seq for seq, t in written if seq > served and not routes_old(t))
    leader_deleted = min(
        r.seq
        for r in records
        if r.kind == "pod" and r.name == old and r.obj["metadata"].get("deletionTimestamp")
    )
    assert left <= leader_deleted
    assert not any(routes_old(t) for seq, t in written if seq > left)
    assert any(old in e for e in events(cluster, "mnr", "GroupReplaced"))  # deleted or gone, by timing
    assert old in cluster.status("mnr")["lastGroupReplacement"]["message"]


def test_a_group_that_cannot_be_placed_is_removed_after_the_gang_timeout(
    operator: Operator, cluster: Cluster
) -> None:
    # Decode takes one node, the first prefill group two: the second group's worker has no node left.
    cluster.apply(group_manifest("mng", prefill_instances=2, gang_timeout=10))
    eventually(lambda: "lastGroupReplacement" in cluster.status("mng"), timeout=WAIT)
    message = cluster.status("mng")["lastGroupReplacement"]["message"]
    assert "gang timeout" in message
    assert events(cluster, "mng", "GroupReplaced")
    assert len(whole_groups(cluster, "mng")) == 1  # the placed group keeps serving
    assert len(prefill(cluster.table("mng"))) >= 1


def test_backend_lws_runs_each_instance_as_one_leaderworkerset(operator: Operator, cluster: Cluster) -> None:
    """The LWS controller (built into the test cluster) creates and restarts the group; the
    operator creates one LeaderWorkerSet per instance and routes it once every pod is Ready."""
    doc = group_manifest("mnl")
    doc["spec"]["multiNode"]["backend"] = "lws"
    cluster.apply(doc)
    eventually(lambda: ready(cluster, "mnl"), timeout=WAIT)
    sets = json.loads(cluster.kubectl("get", "leaderworkersets", "-o", "json"))["items"]
    assert len(sets) == 1  # prefill only: decode DP8 fits a node, it stays one pod
    name = sets[0]["metadata"]["name"]
    assert name.startswith("mnl-prefill-0-") and sets[0]["spec"]["leaderWorkerTemplate"]["size"] == 2
    (instance,) = prefill(cluster.table("mnl"))
    assert instance.name == name and instance.routable and len(instance.endpoints) == 2
    pods = {p["metadata"]["name"]: p for p in groups(cluster, "mnl")[name]}
    assert sorted(pods) == [f"{name}-0", f"{name}-0-1"]
    assert [e.url for e in instance.endpoints] == [
        f"http://{pods[n]['status']['podIP']}:8000" for n in (f"{name}-0", f"{name}-0-1")
    ]
    # A lost worker: the controller recreates the group, the operator takes it out of the
    # table meanwhile and routes the same LeaderWorkerSet again once it is whole.
    old_uid = pods[f"{name}-0"]["metadata"]["uid"]
    cluster.kubectl("delete", "pod", f"{name}-0-1", "--wait=false")

    def regrouped() -> bool:
        now = {p["metadata"]["name"]: p for p in groups(cluster, "mnl").get(name, [])}
        leader = now.get(f"{name}-0")
        return (
            bool(leader)
            and leader["metadata"]["uid"] != old_uid
            and len(now) == 2
            and all(map(pod_ready, now.values()))
        )

    eventually(regrouped, timeout=WAIT)
    eventually(
        lambda: (
            ready(cluster, "mnl") and [i.name for i in prefill(cluster.table("mnl")) if i.routable] == [name]
        ),
        timeout=WAIT,
    )
    assert len(json.loads(cluster.kubectl("get", "leaderworkersets", "-o", "json"))["items"]) == 1


def test_multi_node_groups_scale_and_roll_as_units(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    """gpusPerNode 4 on kwok's 8-GPU nodes: prefill DP8 is a group of two 4-GPU pods. Scaling
    adds whole groups; a template change starts a whole new group beside each old one (surge),
    routes it once whole, and drains the old group before deleting every pod of it."""
    doc = group_manifest("mns")
    doc["spec"]["gpusPerNode"] = 4
    doc["spec"]["prefill"]["dataParallel"] = 8
    doc["spec"]["decode"]["dataParallel"] = 4
    cluster.apply(doc)
    eventually(lambda: ready(cluster, "mns"), timeout=WAIT)
    doc["spec"]["prefill"]["instances"] = 2
    cluster.apply(doc)
    eventually(lambda: ready(cluster, "mns") and len(whole_groups(cluster, "mns")) == 2, timeout=WAIT)
    eventually(lambda: cluster.status("mns")["prefill"]["readyPods"] == 4, timeout=WAIT)
    old = set(whole_groups(cluster, "mns"))
    recorder.start()
    doc["spec"]["prefill"]["args"] = ["--max-num-seqs", "128"]  # a template change
    cluster.apply(doc)

    def rolled() -> bool:
        current = whole_groups(cluster, "mns")
        return (
            ready(cluster, "mns")
            and len(current) == 2
            and not set(current) & old
            and set(groups(cluster, "mns")) == set(current)
        )

    eventually(rolled, timeout=2 * WAIT)
    records = recorder.stop()
    written = sorted(tables(records), key=lambda st: st[0])
    # Every recorded table routes two whole prefill groups at most (surge never routes both the
    # old and the new group of one index: they share the index, 2 wanted + 1 surge in flight).
    for _, t in written:
        assert sum(1 for i in prefill(t) if i.routable) <= 2
        assert all(len(i.endpoints) == 2 for i in prefill(t) if i.routable)
    # Each old group left the table (draining) before its leader was deleted.
    for group in old:
        deleted = min(
            (
                r.seq
                for r in records
                if r.kind == "pod" and r.name == group and r.obj["metadata"].get("deletionTimestamp")
            ),
            default=None,
        )
        assert deleted is not None, f"{group} was not deleted"
        before = [t for seq, t in written if seq < deleted]
        assert before and not any(i.name == group and i.routable for i in prefill(before[-1]))
