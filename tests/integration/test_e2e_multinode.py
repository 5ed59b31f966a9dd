"""Multi-node instances end to end on the test cluster: the operator creates each group (leader
first, then its worker with the leader's pod IP), the pod runner runs one simulator process per
pod, the workers join their leader, and the router sends every (instance, global rank) slot to
its node with the node's local rank. ``gpusPerNode: 2`` splits DP4 into two pods of two ranks;
the simulator pods ask for no GPU, so they run on the pod runner's node."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.test_e2e_cluster import complete, get_json, ready_ips
from tests.support.kube import eventually
from tests.support.operator import Cluster, Operator, ready
from tests.support.specs import sim_manifest

pytestmark = pytest.mark.cluster

NAME = "e2e"  # the helpers of test_e2e_cluster read this deployment
WAIT = 120.0


def manifest() -> dict[str, Any]:
    return sim_manifest(
        NAME,
        gpusPerNode=2,
        prefill={"instances": 1, "dataParallel": 4},
        decode={"instances": 1, "dataParallel": 2},
        router={"replicas": 1},
        rollout={"drainSeconds": 5},
    )


def by_global_rank(ips: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for ip in ips:
        for rank, n in get_json(f"http://{ip}:8000/sim/stats")["by_rank"].items():
            out[rank] = out.get(rank, 0) + n
    return out


def serving(cluster: Cluster) -> bool:
    routers = ready_ips(cluster, "router")
    if len(routers) != 1 or not ready(cluster, NAME):
        return False
    view = get_json(f"http://{routers[0]}:8000/routing/served")
    return bool(view["routable"] == {"prefill": 4, "decode": 2})


def test_a_multi_node_prefill_serves_every_global_rank_and_is_replaced_whole(
    operator: Operator, cluster: Cluster
) -> None:
    cluster.apply(manifest())
    try:
        eventually(lambda: serving(cluster), timeout=WAIT, message="the group Ready and routed")
        prefill_ips = ready_ips(cluster, "prefill")
        assert len(prefill_ips) == 2  # one group of two pods
        (router,) = ready_ips(cluster, "router")
        complete(f"http://{router}:8000", 8)  # lcm(4 prefill slots, 2 decode slots) = 4: two rounds
        assert by_global_rank(prefill_ips) == {"0": 2, "1": 2, "2": 2, "3": 2}
        assert by_global_rank(ready_ips(cluster, "decode")) == {"0": 4, "1": 4}

        # A worker deleted by hand: the whole group goes and a new one serves.
        pods = json.loads(cluster.kubectl("get", "pods", "-l", "pdserve.io/role=prefill", "-o", "json"))[
            "items"
        ]
        worker = next(p for p in pods if p["metadata"]["labels"].get("pdserve.io/group-node") == "1")
        old_group = worker["metadata"]["labels"]["pdserve.io/group"]
        cluster.kubectl("delete", "pod", worker["metadata"]["name"], "--wait=false")

        def new_group_serving() -> bool:
            table = cluster.table(NAME)
            names = [i.name for i in table.prefill if i.routable] if table else []
            return serving(cluster) and len(names) == 1 and names[0] != old_group

        eventually(new_group_serving, timeout=WAIT, message="a new prefill group Ready and routed")
        new_ips = ready_ips(cluster, "prefill")
        assert len(new_ips) == 2 and not set(new_ips) & set(prefill_ips)
        complete(f"http://{router}:8000", 8)
        assert by_global_rank(new_ips) == {"0": 2, "1": 2, "2": 2, "3": 2}
    finally:
        cluster.kubectl("delete", "pdd", NAME, "--ignore-not-found", "--wait=false", check=False)
