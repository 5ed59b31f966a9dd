"""Largest pods first, on the real scheduler: a shape that fits the cluster's GPUs becomes Ready
(1 prefill x TP8 + 6 decode x TP1 on two 8-GPU nodes, which spread decode pods used to block), and
a pod that cannot fit shows in the status, the conditions and ``kubectl describe pdd``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.kube import KubeCluster, eventually, gpu_pool
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    instance_of,
    ready,
)
from tests.support.specs import manifest

pytestmark = pytest.mark.cluster


@pytest.fixture
def two_nodes(pdd_crd: KubeCluster) -> Iterator[str]:
    """Two dedicated 8-GPU nodes; the test's pods select and tolerate them only."""
    with gpu_pool(pdd_crd, 2) as names:
        pool = pdd_crd.kubectl(
            "get", "node", names[0], "-o", "jsonpath={.metadata.labels.pdserve\\.test/pool}"
        )
        yield pool.stdout


def shape(name: str, pool: str, prefill: int, prefill_tp: int, decode: int, decode_tp: int) -> dict[str, Any]:
    template = {
        "spec": {
            "nodeSelector": {"pdserve.test/pool": pool},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
            ],
        }
    }
    return manifest(
        name,
        model="meta-llama/Llama-3.3-70B-Instruct",
        prefill={"instances": prefill, "tensorParallel": prefill_tp, "template": template},
        decode={"instances": decode, "tensorParallel": decode_tp, "template": template},
    )


def test_a_shape_that_fits_becomes_ready_with_the_big_pod_placed_first(
    operator: Operator,
    cluster: Cluster,
    two_nodes: str,
) -> None:
    cluster.apply(shape("pack", two_nodes, 1, 8, 6, 1))  # 14 of 16 GPUs
    eventually(lambda: ready(cluster, "pack"), timeout=WAIT, message="Ready")
    pods = cluster.pods("pack")
    nodes = {instance_of(p["metadata"]["name"]): p["spec"]["nodeName"] for p in pods}
    prefill_node = nodes["pack-prefill-0"]
    # The prefill pod has a node of its own; every decode pod shares the other one.
    assert {n for name, n in nodes.items() if "decode" in name} == set(nodes.values()) - {prefill_node}
    assert all(not p["spec"].get("schedulingGates") for p in pods)
    events = json.loads(
        cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=pack", "-o", "json")
    )
    # The decode pods were created gated and released once the prefill pod was bound.
    assert any(e["reason"] == "Ungated" and "pack-decode-" in e["message"] for e in events["items"])


def test_a_pod_that_cannot_fit_shows_in_status_conditions_and_describe(
    operator: Operator,
    cluster: Cluster,
    two_nodes: str,
) -> None:
    cluster.apply(shape("toomany", two_nodes, 3, 8, 0, 8))  # 24 GPUs wanted, 16 there

    def degraded() -> dict[str, Any]:
        c = cluster.condition("toomany", "Degraded")
        return c if c.get("status") == "True" else {}

    condition = eventually(degraded, timeout=WAIT, message="Degraded=True")
    assert condition["reason"] == "PodsUnschedulable"
    assert condition["message"].startswith("pod toomany-prefill-")
    assert "Insufficient nvidia.com/gpu" in condition["message"]  # the scheduler's own words
    assert cluster.condition("toomany", "Ready")["status"] == "False"
    described = " ".join(cluster.kubectl("describe", "pdd", "toomany").split())
    assert "PodsUnschedulable" in described and "Insufficient nvidia.com/gpu" in described

    # Room appears (a third node of the pool): the pod is placed and the condition clears. (Not
    # Ready: with no decode instance its router, which really runs, has nothing to route to.)
    def placed() -> bool:
        return (
            cluster.condition("toomany", "Degraded").get("status") == "False"
            and cluster.status("toomany")["prefill"]["readyInstances"] == 3
        )

    with gpu_pool(cluster.kube, 1, labels={"pdserve.test/pool": two_nodes}):
        try:
            eventually(placed, timeout=WAIT, message="all prefill pods Ready on a third node")
        except AssertionError as exc:
            pods = cluster.kubectl("get", "pods", "-o", "wide")
            raise AssertionError(
                f"{exc}\n{json.dumps(cluster.status('toomany'), indent=1)}\n{pods}"
            ) from None
        assert cluster.condition("toomany", "Degraded")["status"] == "False"
        cluster.kubectl("delete", "pdd", "toomany", "--wait=true")  # off the node before it goes
