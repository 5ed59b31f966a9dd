"""Evictions against each role's PodDisruptionBudget, on the real control plane.

The decode pods are placed on a node pool of this test (kwok nodes, Ready at once); the prefill
pod and the router stay on the shared kwok nodes, so only decode is disrupted. A replacement is
kept from becoming Ready by leaving it nowhere to go (every pool node cordoned), which is what a
slow model load looks like to the budget.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.kube import KubeCluster, eventually, gpu_pool
from tests.support.nodes import node_lost
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    Recorder,
    events,
    instance_of,
    pdd_manifest,
    pod_ready,
    routable,
    tables,
)

pytestmark = pytest.mark.cluster

REFUSED = "Cannot evict pod as it would violate the pod's disruption budget"


@pytest.fixture
def pool(pdd_crd: KubeCluster) -> Iterator[tuple[str, list[str]]]:
    """Two dedicated GPU nodes: (their pool label, their names)."""
    with gpu_pool(pdd_crd, 2) as names:
        label = pdd_crd.kubectl(
            "get", "node", names[0], "-o", "jsonpath={.metadata.labels.pdserve\\.test/pool}"
        )
        yield label.stdout, names


def on_pool(name: str, pool: str) -> dict[str, Any]:
    """Two decode instances that select and tolerate the pool only; the rest as pdd_manifest."""
    doc = pdd_manifest(name, prefill_dp=1, decode_instances=2, silent_router=True)
    doc["spec"]["decode"]["template"] = {
        "spec": {
            "nodeSelector": {"pdserve.test/pool": pool},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
            ],
        }
    }
    return doc


def decode_pods(cluster: Cluster, name: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in cluster.pods(name)
        if p["metadata"]["labels"]["pdserve.io/role"] == "decode"
    }


def all_decode_ready_on(cluster: Cluster, name: str, node: str) -> bool:
    pods = decode_pods(cluster, name)
    table = cluster.table(name)
    return (
        len(pods) == 2
        and all(pod_ready(p) and p["spec"].get("nodeName") == node for p in pods.values())
        and len(routable(table, "decode")) == 2
    )


def budget_allows(cluster: Cluster, pdb: str, count: int) -> bool:
    obj = cluster.get("pdb", pdb)
    if not obj:
        return False
    status = obj.get("status") or {}
    return bool(
        status.get("observedGeneration") == obj["metadata"]["generation"]
        and status.get("disruptionsAllowed") == count
    )


def start_drain(cluster: Cluster, node: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``kubectl drain`` in the background; its output lines are collected as they come."""
    kubectl = cluster.kube.kubectl
    proc = subprocess.Popen(
        [str(kubectl), "--kubeconfig", str(cluster.kube.kubeconfig), "drain", node, "--ignore-daemonsets",
         "--delete-emptydir-data", "--timeout=300s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def test_budget_objects_follow_the_spec(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("pdb", prefill_instances=1, decode_instances=3))
    eventually(lambda: budget_allows(cluster, "pdb-decode", 1), timeout=WAIT, message="decode budget")
    decode = cluster.get("pdb", "pdb-decode")
    assert decode is not None
    assert decode["spec"]["minAvailable"] == 2
    assert decode["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert decode["status"]["expectedPods"] == 3  # the role's pods, counted by the disruption controller
    assert decode["metadata"]["ownerReferences"][0]["name"] == "pdb"
    prefill = cluster.get("pdb", "pdb-prefill")
    assert prefill is not None and prefill["spec"]["minAvailable"] == 0  # a lone instance is not protected
    eventually(lambda: budget_allows(cluster, "pdb-prefill", 1), timeout=WAIT, message="prefill budget")

    # The field changes the budget, not the pods.
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("pdb")}
    doc = pdd_manifest("pdb", prefill_instances=1, decode_instances=3)
    doc["spec"]["decode"]["disruptionBudget"] = {"maxUnavailable": "50%"}
    cluster.apply(doc)
    eventually(lambda: budget_allows(cluster, "pdb-decode", 2), timeout=WAIT, message="50% of 3 -> 2")
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("pdb")} == uids


def test_kubectl_drain_never_leaves_decode_without_a_routable_instance(
    operator: Operator, cluster: Cluster, recorder: Recorder, pool: tuple[str, list[str]]
) -> None:
    label, (first, second) = pool
    kubectl = cluster.kube.kubectl
    kubectl("cordon", second)  # both decode pods on the first node
    cluster.apply(on_pool("drain", label))
    eventually(
        lambda: all_decode_ready_on(cluster, "drain", first), timeout=WAIT, message="2 decode on one node"
    )
    eventually(lambda: budget_allows(cluster, "drain-decode", 1), timeout=WAIT, message="budget of 1")
    start = max((r.seq for r in recorder.records), default=0)

    proc, lines = start_drain(cluster, first)
    try:
        # One pod goes; its replacement has nowhere to run (both nodes cordoned), so the second
        # eviction is refused, again and again, while the first pod's replacement is not Ready.
        eventually(
            lambda: any(REFUSED in line for line in lines), timeout=WAIT, message=f"a refusal: {lines}"
        )
        pods = decode_pods(cluster, "drain")
        standing = [p for p in pods.values() if p["spec"].get("nodeName") == first and pod_ready(p)]
        assert len(standing) == 1 and not standing[0]["metadata"].get("deletionTimestamp")
        assert routable(cluster.table("drain"), "decode") == [instance_of(standing[0]["metadata"]["name"])]
        assert proc.poll() is None  # still waiting on the budget
        assert routable(cluster.table("drain"), "prefill") == ["drain-prefill-0"]  # not on that node

        # Room elsewhere: the replacement becomes Ready, the budget frees, the drain finishes.
        kubectl("uncordon", second)
        assert proc.wait(timeout=WAIT) == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    eventually(lambda: all_decode_ready_on(cluster, "drain", second), timeout=WAIT, message="both moved")

    records = recorder.stop()
    during = [(seq, t) for seq, t in tables(records) if seq > start]
    assert during, "the drain wrote no routing table"
    assert all(len(routable(t, "decode")) >= 1 for _, t in during), [
        (seq, routable(t, "decode")) for seq, t in during
    ]
    assert min(len(routable(t, "decode")) for _, t in during) == 1  # the drain did take one at a time
    evicted = {r.name for r in records if r.kind == "pod" and r.seq > start and r.type == "DELETED"}
    assert {instance_of(n) for n in evicted} == {"drain-decode-0", "drain-decode-1"}
    assert len(evicted) == 2


def test_the_eviction_api_answers_429_when_the_budget_is_spent(
    operator: Operator, cluster: Cluster, kube_api: Any, pool: tuple[str, list[str]]
) -> None:
    from kubernetes import client

    label, (first, second) = pool
    kubectl = cluster.kube.kubectl
    kubectl("cordon", second)
    cluster.apply(on_pool("evict", label))
    eventually(
        lambda: all_decode_ready_on(cluster, "evict", first), timeout=WAIT, message="2 decode on one node"
    )
    eventually(lambda: budget_allows(cluster, "evict-decode", 1), timeout=WAIT, message="budget of 1")
    kubectl("cordon", first)  # a replacement will stay Pending

    core = client.CoreV1Api(kube_api)

    def evict(pod: str) -> None:
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=cluster.ns))
        core.create_namespaced_pod_eviction(pod, cluster.ns, body)

    decode_1 = cluster.instance_name("evict-decode-1")
    evict(cluster.instance_name("evict-decode-0"))
    with pytest.raises(client.ApiException) as refused:
        evict(decode_1)
    assert refused.value.status == 429
    assert "disruption budget" in json.loads(refused.value.body)["message"]
    pod = cluster.get("pod", decode_1)
    assert pod is not None and not pod["metadata"].get("deletionTimestamp")
    assert "evict-decode-1" in routable(cluster.table("evict"), "decode")

    # Once the replacement is Ready the budget allows the next eviction.
    kubectl("uncordon", second)
    eventually(lambda: budget_allows(cluster, "evict-decode", 1), timeout=WAIT, message="budget restored")
    evict(decode_1)
    eventually(
        lambda: all_decode_ready_on(cluster, "evict", second),
        timeout=WAIT,
        message="both replaced on the free node",
    )


def test_pods_of_a_lost_node_leave_the_table_at_once_and_are_replaced_after_the_grace(
    operator: Operator, cluster: Cluster, recorder: Recorder, pool: tuple[str, list[str]]
) -> None:
    """kwok stops heartbeating for the node (its Lease taken over): the node lifecycle controller
    marks it Unknown; the operator takes its pods out of the table at once, and after
    rollout.nodeLossSeconds deletes them (they stay Terminating: nobody confirms they stopped)
    and replaces them on the other node under new names, at most one routable pod per index."""
    label, (first, second) = pool
    kubectl = cluster.kube.kubectl
    kubectl("cordon", second)
    doc = on_pool("lost", label)
    doc["spec"]["rollout"]["nodeLossSeconds"] = 8
    cluster.apply(doc)
    eventually(
        lambda: all_decode_ready_on(cluster, "lost", first), timeout=WAIT, message="2 decode on one node"
    )
    kubectl("uncordon", second)
    stranded = set(decode_pods(cluster, "lost"))
    start = max((r.seq for r in recorder.records), default=0)

    with node_lost(cluster.kube, first) as lost:
        seen_unknown = time.time()
        eventually(
            lambda: routable(cluster.table("lost"), "decode") == [], timeout=15, message="out of the table"
        )
        out_after = time.time() - seen_unknown
        degraded = eventually(
            lambda: (c := cluster.condition("lost", "Degraded")).get("reason") == "NodeNotReady" and c,
            timeout=15,
            message="Degraded NodeNotReady",
        )
        assert all(name in degraded["message"] for name in stranded), degraded

        def replaced() -> bool:
            pods = decode_pods(cluster, "lost")
            fresh = [p for n, p in pods.items() if n not in stranded]
            return (
                len(fresh) == 2
                and all(pod_ready(p) and p["spec"].get("nodeName") == second for p in fresh)
                and sorted(routable(cluster.table("lost"), "decode")) == ["lost-decode-0", "lost-decode-1"]
            )

        eventually(replaced, timeout=WAIT, message="replacements Ready on the other node")
        for (
            name
        ) in stranded:  # deleted: Terminating on the unreachable node, or gone (tests/support/nodes.py)
            pod = cluster.get("pod", name)
            assert pod is None or pod["metadata"].get("deletionTimestamp"), name
        lost_events = eventually(
            lambda: events(cluster, "lost", "NodeLost"), timeout=WAIT, message="NodeLost"
        )
        assert all(name in " ".join(lost_events) for name in stranded), lost_events
        eventually(
            lambda: cluster.condition("lost", "Degraded").get("status") == "False",
            timeout=WAIT,
            message="Degraded cleared once the stranded pods are deleted",
        )
        assert operator.metric("pdserve_operator_node_loss_replacements_total") == 2
        print(f"node {lost.name} Unknown: its pods left the table {out_after:.1f}s after it was seen")
    eventually(
        lambda: not (set(decode_pods(cluster, "lost")) & stranded), timeout=WAIT, message="stuck pods gone"
    )

    records = recorder.stop()
    gone = False  # once out of the table, the stranded pods never come back to it
    for seq, table in tables(records):
        if seq > start:
            names = [instance_of(i.name) for i in table.decode if i.routable]
            assert len(names) == len(set(names)), (seq, names)  # one routable pod per index
            back = {i.name for i in table.decode if i.routable} & stranded
            assert not (gone and back), (seq, back)
            gone = gone or not back
