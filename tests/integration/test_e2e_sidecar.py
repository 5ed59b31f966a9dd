"""End to end on the test cluster with ``spec.router.placement: decode-sidecar``.

No router Deployment: every decode pod runs ``pdserve proxy --local-decode`` next to its engine
(the pod runner runs both containers as processes bound to the pod IP). Clients reach the Ready
decode pods' sidecar port (8200) by pod IP, as the Service would spread them. Checks: the per-slot
counts with equal traffic per decode pod (exact on both roles: the prefill offsets), and a decode
template change under load (the draining pod turns unready first, finishes what it has, then
goes) with 0 failed requests; then a prefill rollout under load.

The pod runner executes ``pdserve`` from the checkout it was started from, so this test needs the
sidecar code in that checkout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.integration.test_e2e_cluster import NAME, WAIT, complete, get_json, pods, ready_ips, stats
from tests.support.kube import eventually
from tests.support.load import Load
from tests.support.operator import Cluster, Operator
from tests.support.specs import sim_manifest

pytestmark = pytest.mark.cluster

SIDECAR_PORT = 8200


def manifest(decode_rev: str = "1", prefill_rev: str = "1") -> dict[str, Any]:
    def template(rev: str) -> dict[str, Any]:
        return {"metadata": {"annotations": {"e2e/rev": rev}}}

    return sim_manifest(
        NAME,
        prefill={"instances": 2, "dataParallel": 2, "template": template(prefill_rev)},
        decode={"instances": 2, "dataParallel": 2, "template": template(decode_rev)},
        router={"placement": "decode-sidecar"},
        rollout={"maxUnavailable": 1, "drainSeconds": 60},
    )


def sidecars(cluster: Cluster) -> Callable[[], list[str]]:
    return lambda: [f"{ip}:{SIDECAR_PORT}" for ip in ready_ips(cluster, "decode")]


def serving(cluster: Cluster) -> bool:
    decode = ready_ips(cluster, "decode")
    if len(ready_ips(cluster, "prefill")) != 2 or len(decode) != 2:
        return False
    for ip in decode:
        view = get_json(f"http://{ip}:{SIDECAR_PORT}/routing/served")
        if view["routable"] != {"prefill": 4, "decode": 2}:  # all prefills, its own two ranks
            return False
    return True


@pytest.fixture
def e2e(operator: Operator, cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    cluster.kubectl("delete", "pdd", NAME, "--ignore-not-found", "--wait=false", check=False)


def test_decode_sidecars_exact_counts_and_rollouts_under_load(e2e: Cluster) -> None:
    e2e.apply(manifest())
    eventually(lambda: serving(e2e), timeout=WAIT, message="decode pods Ready with their sidecars")
    assert not [p for p in pods(e2e, "router")], "no router Deployment pods with decode-sidecar"
    # 8 requests per decode pod: its 2 ranks get 4 each; the 4 prefill slots get 4 each overall
    for ip in ready_ips(e2e, "decode"):
        complete(f"http://{ip}:{SIDECAR_PORT}", 8)
    for role in ("prefill", "decode"):
        for ip in ready_ips(e2e, role):
            assert stats(ip)["by_rank"] == {"0": 4, "1": 4}, f"{role} {ip}: {stats(ip)}"

    for change, role in ((manifest(decode_rev="2"), "decode"), (manifest("2", prefill_rev="2"), "prefill")):
        before = {p["metadata"]["uid"] for p in pods(e2e, role)}
        with Load(sidecars(e2e), concurrency=16) as load:
            time.sleep(2)
            e2e.apply(change)

            def replaced(role: str = role, before: set[str] = before) -> bool:
                now = {p["metadata"]["uid"] for p in pods(e2e, role)}
                return not (now & before) and serving(e2e)

            eventually(replaced, timeout=4 * WAIT, message=f"both {role} pods replaced and served")
            time.sleep(2)
            result = load.stop()
        assert result.ok > 0
        assert result.failed == [], f"{role} rollout: {result.failed[:5]}"
