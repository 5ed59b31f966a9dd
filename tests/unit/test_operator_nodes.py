"""The operator's watch-fed node view: allocatable GPUs per node, and since when a node is lost.

The event sequences are in the shape the API server sends (tests/fixtures/nodes/ holds one
recorded on the test cluster: a kwok node whose heartbeat was stopped, then restored).
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any, cast

from pdserve.operator.cluster.cache import ClusterCache
from pdserve.operator.cluster.nodes import NodeCache, lost_since, parse_time, quantity, ready_condition
from pdserve.operator.control.controller import Controller, Key
from pdserve.operator.reconcile.reconciler import Reconciler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"

T0 = "2026-05-01T10:00:00Z"
T1 = "2026-05-01T10:05:00Z"
T2 = "2026-05-01T10:06:00Z"


def node(
    name: str,
    version: int,
    ready: str | None = "True",
    since: str | None = T0,
    gpus: object = "8",
) -> dict[str, Any]:
    conditions = []
    if ready is not None:
        condition = {"type": "Ready", "status": ready, "reason": "KubeletReady", "lastHeartbeatTime": T0}
        if since is not None:
            condition["lastTransitionTime"] = since
        conditions.append({"type": "MemoryPressure", "status": "False", "lastTransitionTime": T0})
        conditions.append(condition)
    allocatable = {"cpu": "96", "memory": "1Ti", "pods": "110"}
    if gpus is not None:
        allocatable["nvidia.com/gpu"] = gpus
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": str(version),
            "annotations": {"kwok.x-k8s.io/node": "fake"},
        },
        "spec": {},
        "status": {"allocatable": allocatable, "conditions": conditions},
    }


def synced(*bodies: dict[str, Any], now: float = 1000.0) -> NodeCache:
    cache = NodeCache(clock=lambda: now)
    cache.replace(bodies, "1")
    return cache


# --- pure helpers -------------------------------------------------------------------------------


def test_quantities_are_whole_numbers_and_anything_else_counts_as_none() -> None:
    assert quantity("8") == 8
    assert quantity(4) == 4
    assert quantity("") == 0
    assert quantity("8Gi") == 0
    assert quantity("1.5") == 0
    assert quantity(None) == 0
    assert quantity("-2") == 0


def test_timestamps_parse_and_malformed_ones_are_none() -> None:
    assert parse_time(T0) == 1777629600.0
    assert parse_time("2026-05-01T10:00:00.250000Z") == 1777629600.25
    assert parse_time("yesterday") is None
    assert parse_time(None) is None


def test_lost_since_reads_the_ready_condition() -> None:
    assert lost_since(node("a", 1), now=5.0) is None
    assert lost_since(node("a", 1, ready="Unknown", since=T1), now=5.0) == parse_time(T1)
    assert lost_since(node("a", 1, ready="False", since=T1), now=5.0) == parse_time(T1)
    # No readable transition time: lost since first seen so.
    assert lost_since(node("a", 1, ready="Unknown", since=None), now=5.0) == 5.0
    assert lost_since(node("a", 1, ready="Unknown", since="garbage"), now=5.0) == 5.0
    # A node that has not reported a Ready condition yet is not lost (the lifecycle controller
    # marks it Unknown after its startup grace).
    assert lost_since(node("a", 1, ready=None), now=5.0) is None


# --- the cache ----------------------------------------------------------------------------------


def test_nothing_is_known_until_a_list_went_in() -> None:
    cache = NodeCache()
    assert not cache.ready_known()
    assert cache.allocatable("nvidia.com/gpu") is None  # the fit check is skipped, not failed
    cache.event("ADDED", node("a", 5, ready="Unknown", since=T1))
    assert not cache.ready_known()
    assert cache.not_ready_since("a") == parse_time(T1)  # what events showed is still answered
    cache.replace([node("a", 5, ready="Unknown", since=T1), node("b", 6)], "6")
    assert cache.ready_known()
    assert sorted(cast(list[int], cache.allocatable("nvidia.com/gpu"))) == [8, 8]


def test_allocatable_per_node_with_malformed_and_missing_quantities() -> None:
    cache = synced(node("a", 1), node("b", 2, gpus="4"), node("c", 3, gpus="lots"), node("d", 4, gpus=None))
    assert sorted(cast(list[int], cache.allocatable("nvidia.com/gpu"))) == [0, 0, 4, 8]
    assert cache.allocatable("amd.com/gpu") == [0, 0, 0, 0]


def test_ready_unknown_ready() -> None:
    cache = synced(node("a", 1))
    assert cache.not_ready_since("a") is None
    assert cache.event("MODIFIED", node("a", 2, ready="Unknown", since=T1)) is True
    assert cache.not_ready_since("a") == parse_time(T1)
    # A heartbeat-less status rewrite with the same condition is no change.
    assert cache.event("MODIFIED", node("a", 3, ready="Unknown", since=T1)) is False
    assert cache.event("MODIFIED", node("a", 4, ready="True", since=T2)) is True
    assert cache.not_ready_since("a") is None
    assert cache.event("MODIFIED", node("a", 5, ready="True", since=T2)) is False


def test_false_then_unknown_stays_lost_since_the_first() -> None:
    cache = synced(node("a", 1))
    cache.event("MODIFIED", node("a", 2, ready="False", since=T1))
    # The lifecycle controller moves lastTransitionTime when False turns Unknown.
    assert cache.event("MODIFIED", node("a", 3, ready="Unknown", since=T2)) is False
    assert cache.not_ready_since("a") == parse_time(T1)


def test_older_versions_never_overwrite_newer_ones() -> None:
    cache = synced(node("a", 1))
    cache.event("MODIFIED", node("a", 10, ready="Unknown", since=T1))
    assert cache.event("MODIFIED", node("a", 9, ready="True")) is False
    assert cache.not_ready_since("a") == parse_time(T1)
    # An unparseable version counts as the newest.
    bogus = node("a", 0, ready="True")
    bogus["metadata"]["resourceVersion"] = "not-a-number"
    assert cache.event("MODIFIED", bogus) is True
    assert cache.not_ready_since("a") is None


def test_a_deleted_node_is_lost_since_its_deletion_and_leaves_allocatable() -> None:
    now = [2000.0]
    cache = NodeCache(clock=lambda: now[0])
    cache.replace([node("a", 1), node("b", 2)], "2")
    assert cache.event("DELETED", node("a", 3)) is True
    assert cache.not_ready_since("a") == 2000.0
    assert cache.allocatable("nvidia.com/gpu") == [8]
    # A late event of the deleted node does not bring it back...
    now[0] = 2001.0
    assert cache.event("MODIFIED", node("a", 2)) is False
    assert cache.not_ready_since("a") == 2000.0
    # ...a node registered again under that name (a newer version) does.
    assert cache.event("ADDED", node("a", 7)) is True
    assert cache.not_ready_since("a") is None
    assert cache.allocatable("nvidia.com/gpu") == [8, 8]


def test_deleting_a_lost_node_keeps_it_lost_since_it_was_lost() -> None:
    cache = NodeCache(clock=lambda: parse_time(T2) or 0.0)
    cache.replace([node("a", 1)], "1")
    cache.event("MODIFIED", node("a", 2, ready="Unknown", since=T1))
    assert cache.event("DELETED", node("a", 3, ready="Unknown", since=T1)) is False
    assert cache.not_ready_since("a") == parse_time(T1)
    assert cache.allocatable("nvidia.com/gpu") == []


def test_a_list_drops_nodes_it_lacks_unless_the_watch_saw_them_later() -> None:
    now = 3000.0
    cache = NodeCache(clock=lambda: now)
    cache.replace([node("a", 1), node("b", 2)], "2")
    cache.event("ADDED", node("c", 9))  # newer than the next LIST
    changed = cache.replace([node("b", 2)], "5")
    assert changed == ["a"]
    assert cache.not_ready_since("a") == now
    assert cache.not_ready_since("c") is None
    assert sorted(cast(list[int], cache.allocatable("nvidia.com/gpu"))) == [8, 8]


def test_unknown_nodes_and_unreadable_nodes_answer_none() -> None:
    cache = synced(node("a", 1, ready="Unknown", since=T1))
    assert cache.not_ready_since("nowhere") is None
    cache.unreadable()
    assert not cache.ready_known()
    assert cache.not_ready_since("a") is None
    assert cache.allocatable("nvidia.com/gpu") is None


def test_tombstones_are_forgotten_after_an_hour() -> None:
    now = [0.0]
    cache = NodeCache(clock=lambda: now[0])
    cache.replace([node("a", 1), node("b", 2)], "2")
    cache.event("DELETED", node("a", 3))
    now[0] = 3700.0
    cache.event("MODIFIED", node("b", 4))
    assert cache.not_ready_since("a") is None


def test_events_are_not_mutated() -> None:
    body = node("a", 2, ready="Unknown", since=T1)
    before = copy.deepcopy(body)
    synced(node("a", 1)).event("MODIFIED", body)
    assert body == before


def test_recorded_kwok_node_loss() -> None:
    """The events a watch delivered while tests/support/nodes.node_lost stopped a kwok node's
    heartbeat, then restored it, then the node was deleted (tests/integration/test_cluster_nodes.py
    with PDSERVE_RECORD_NODE_EVENTS). kwok's restore sets Ready's lastTransitionTime back to the
    node's creation, before the Unknown transition: only the status counts, not the order of times."""
    recorded = json.loads((FIXTURES / "kwok-node-lost.json").read_text())
    cache = NodeCache()
    cache.replace([recorded["listed"]], recorded["listed"]["metadata"]["resourceVersion"])
    name = recorded["listed"]["metadata"]["name"]
    states = [cache.not_ready_since(name) is not None]
    for event in recorded["events"]:
        cache.event(event["type"], event["object"])
        states.append(cache.not_ready_since(name) is not None)
    # Ready, then lost for a while, then Ready again, then deleted (lost for good).
    collapsed = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    assert collapsed == [False, True, False, True]
    assert recorded["events"][-1]["type"] == "DELETED"
    unknown = [
        e for e in recorded["events"] if (ready_condition(e["object"]) or {}).get("status") == "Unknown"
    ]
    assert unknown


# --- the controller -----------------------------------------------------------------------------


def pod(
    namespace: str, deployment: str, name: str, node_name: str | None, version: int = 1
) -> dict[str, Any]:
    spec = {"nodeName": node_name} if node_name else {}
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "resourceVersion": str(version),
            "labels": {"pdserve.io/deployment": deployment, "pdserve.io/role": "decode"},
        },
        "spec": spec,
    }


def test_cache_finds_the_deployments_with_a_pod_on_a_node() -> None:
    cache = ClusterCache()
    cache.pod_event("ADDED", pod("ns", "a", "a-decode-0", "n1"))
    cache.pod_event("ADDED", pod("ns", "b", "b-decode-0", "n2"))
    cache.pod_event("ADDED", pod("other", "a", "a-decode-0", "n1"))
    cache.pod_event("ADDED", pod("ns", "c", "c-decode-0", None))  # not scheduled yet
    cache.pod_event("ADDED", pod("ns", "d", "d-decode-0", "n1"))
    cache.pod_event("DELETED", pod("ns", "d", "d-decode-0", "n1", version=2))
    assert cache.deployments_on_node("n1") == {("ns", "a"), ("other", "a")}
    assert cache.deployments_on_node("n3") == set()


class _Unused:
    def close(self) -> None:
        pass


async def test_a_readiness_flip_requests_every_deployment_with_a_pod_on_the_node() -> None:
    cache = ClusterCache()
    nodes = NodeCache()
    nodes.replace([node("n1", 1), node("n2", 2)], "2")
    cache.pod_event("ADDED", pod("ns", "a", "a-decode-0", "n1"))
    cache.pod_event("ADDED", pod("ns", "b", "b-decode-0", "n1"))
    cache.pod_event("ADDED", pod("ns", "c", "c-decode-0", "n2"))
    # The reconciler is never reached: requests are recorded before the coalescer sees them.
    controller = Controller(cast(Reconciler, _Unused()), cache, nodes=nodes)
    requested: list[Key] = []
    controller.request = lambda key, full=False: requested.append(key)  # type: ignore[method-assign]
    controller.node_event("MODIFIED", node("n1", 3))  # still Ready: nothing to do
    assert requested == []
    controller.node_event("MODIFIED", node("n1", 4, ready="Unknown", since=T1))
    assert requested == [("ns", "a"), ("ns", "b")]
    requested.clear()
    controller.node_event("DELETED", node("n2", 5))
    assert requested == [("ns", "c")]
    await asyncio.sleep(0)
    await controller.close()
