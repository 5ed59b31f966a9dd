"""End to end on the test cluster: the operator deploys, the pods really run, clients get answers.

The pod runner (hack/cluster) runs every pod that asks for no GPU as local processes on its
node, bound to the pod's IP: `engine: sim` engine pods run ``pdserve sim`` and the router pods
run ``pdserve proxy --routing-configmap``, both from their rendered command lines, and the router
watches its ConfigMap through the API server with its own service account. Clients reach the
router pods by their pod IPs (Services get no endpoints for loopback IPs); counts are read from
the engines' ``/sim/stats``.

The operator runs as a subprocess of the test (as in test_operator.py), so a test can restart it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.kube import eventually
from tests.support.load import Load
from tests.support.operator import Cluster, Operator, pod_ready
from tests.support.specs import sim_manifest

pytestmark = pytest.mark.cluster

WAIT = 90.0
NAME = "e2e"
ENGINE_PORT = 8000
ROUTER_PORT = 8000


def manifest(
    *, prefill: int = 2, decode: int = 2, routers: int = 2, drain_seconds: int = 30
) -> dict[str, Any]:
    return sim_manifest(
        NAME,
        prefill={"instances": prefill, "dataParallel": 2},
        decode={"instances": decode, "dataParallel": 2},
        router={"replicas": routers},
        rollout={"maxUnavailable": 1, "drainSeconds": drain_seconds},
    )


# --- reading the cluster -------------------------------------------------------------------------


def pods(cluster: Cluster, component: str, name: str = NAME) -> list[dict[str, Any]]:
    """Live (not terminating) pods of deployment ``name``: ``component`` is prefill, decode or router."""
    selector = f"pdserve.io/deployment={name},app.kubernetes.io/component={component}"
    if component in ("prefill", "decode"):
        selector = f"pdserve.io/deployment={name},pdserve.io/role={component}"
    items = json.loads(cluster.kubectl("get", "pods", "-l", selector, "-o", "json"))["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def ready_ips(cluster: Cluster, component: str, name: str = NAME) -> list[str]:
    return sorted(
        p["status"]["podIP"]
        for p in pods(cluster, component, name)
        if pod_ready(p) and p["status"].get("podIP")
    )


def routers(cluster: Cluster) -> Callable[[], list[str]]:
    """The Ready router pods' client addresses, for :class:`Load`."""
    return lambda: [f"{ip}:{ROUTER_PORT}" for ip in ready_ips(cluster, "router")]


def get_json(url: str, timeout: float = 3.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return dict(json.loads(r.read()))


def serving(cluster: Cluster, prefill: int, decode: int, routers: int) -> Callable[[], bool]:
    """Ready engines and routers in the numbers wanted, and every router serving all of them."""

    def check() -> bool:
        router_ips = ready_ips(cluster, "router")
        if len(router_ips) != routers:
            return False
        if len(ready_ips(cluster, "prefill")) != prefill or len(ready_ips(cluster, "decode")) != decode:
            return False
        for ip in router_ips:
            view = get_json(f"http://{ip}:{ROUTER_PORT}/routing/served")
            if view["routable"] != {"prefill": 2 * prefill, "decode": 2 * decode}:
                return False
        return True

    return check


def stats(ip: str) -> dict[str, Any]:
    return get_json(f"http://{ip}:{ENGINE_PORT}/sim/stats")


# --- what the engines saw ----------------------------------------------------------------------


class LastRequests:
    """Polls every engine pod's ``/sim/stats`` and keeps, per pod uid, the newest arrival seen and
    the moment this test first saw the pod's deletion begin."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.last_request_at: dict[str, float] = {}
        self.deletion_seen_at: dict[str, float] = {}
        self.names: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> LastRequests:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        selector = f"pdserve.io/deployment={NAME},pdserve.io/role"
        while not self._stop.wait(0.2):
            try:
                items = json.loads(self.cluster.kubectl("get", "pods", "-l", selector, "-o", "json"))["items"]
            except Exception:
                continue
            now = time.time()
            for pod in items:
                uid, ip = pod["metadata"]["uid"], pod["status"].get("podIP")
                self.names[uid] = pod["metadata"]["name"]
                if pod["metadata"].get("deletionTimestamp"):
                    self.deletion_seen_at.setdefault(uid, now)
                if not ip:
                    continue
                try:
                    at = stats(ip).get("last_request_at")
                except OSError:
                    continue
                if at is not None:
                    self.last_request_at[uid] = max(at, self.last_request_at.get(uid, 0.0))

    def late_requests(self) -> list[str]:
        """Pods that received a request after this test saw their deletion begin."""
        return [
            f"{self.names[uid]} ({uid}): request at {self.last_request_at[uid]:.3f}, "
            f"deletion seen at {seen:.3f}"
            for uid, seen in self.deletion_seen_at.items()
            if self.last_request_at.get(uid, 0.0) > seen
        ]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def e2e(operator: Operator, cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    cluster.kubectl("delete", "pdd", NAME, "--ignore-not-found", "--wait=false", check=False)


def deploy(cluster: Cluster, **shape: int) -> None:
    doc = manifest(**shape)
    cluster.apply(doc)
    spec = doc["spec"]
    eventually(
        serving(
            cluster, spec["prefill"]["instances"], spec["decode"]["instances"], spec["router"]["replicas"]
        ),
        timeout=WAIT,
        message="engines and routers Ready, every router serving every slot",
    )


# --- tests ---------------------------------------------------------------------------------------


def test_routers_serve_with_exact_per_slot_counts(e2e: Cluster) -> None:
    deploy(e2e)
    routers = ready_ips(e2e, "router")
    assert len(routers) == 2
    per_router = 16  # 4 prefill and 4 decode slots: 4 full cycles per router
    for ip in routers:
        complete(f"http://{ip}:{ROUTER_PORT}", per_router)
    for role in ("prefill", "decode"):
        for ip in ready_ips(e2e, role):
            assert stats(ip)["by_rank"] == {"0": 8, "1": 8}, f"{role} {ip}: {stats(ip)}"


def complete(base_url: str, count: int) -> None:
    """``count`` short completions one after the other, each answered 200."""
    for i in range(count):
        body = {"model": "sim-model", "prompt": f"count {i}", "max_tokens": 4}
        req = urllib.request.Request(
            f"{base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200


def test_prefill_template_change_under_load_fails_nothing(e2e: Cluster) -> None:
    deploy(e2e)
    before = {p["metadata"]["uid"] for p in pods(e2e, "prefill")}
    with LastRequests(e2e) as last, Load(routers(e2e), concurrency=32) as load:
        time.sleep(2)
        patch = {"spec": {"prefill": {"template": {"metadata": {"annotations": {"e2e/rev": "2"}}}}}}
        e2e.kubectl("patch", "pdd", NAME, "--type=merge", "-p", json.dumps(patch))

        def replaced() -> bool:
            now = {p["metadata"]["uid"] for p in pods(e2e, "prefill")}
            return not (now & before) and serving(e2e, 2, 2, 2)()

        eventually(replaced, timeout=3 * WAIT, message="both prefill pods replaced and served")
        time.sleep(2)
        result = load.stop()
    assert result.ok > 0
    assert result.failed == []
    assert last.deletion_seen_at, "the rollout deleted no pod"
    assert last.late_requests() == []


def test_decode_pod_deleted_by_hand_under_load_fails_nothing(e2e: Cluster) -> None:
    deploy(e2e)
    victim = pods(e2e, "decode")[0]
    with Load(routers(e2e), concurrency=16) as load:
        time.sleep(2)
        e2e.kubectl("delete", "pod", victim["metadata"]["name"], "--wait=false")

        def back() -> bool:
            # The replacement has a name of its own (unique names: it can start at once).
            names = [p["metadata"]["name"] for p in pods(e2e, "decode")]
            return victim["metadata"]["name"] not in names and len(names) == 2 and serving(e2e, 2, 2, 2)()

        eventually(back, timeout=2 * WAIT, message="the deleted decode pod recreated and served")
        result = load.stop()
    assert result.ok > 0
    assert result.failed == []


def test_scale_decode_down_under_load_fails_nothing(e2e: Cluster) -> None:
    deploy(e2e, decode=3)
    with Load(routers(e2e), concurrency=16) as load:
        time.sleep(2)
        e2e.kubectl(
            "patch", "pdd", NAME, "--type=merge", "-p", json.dumps({"spec": {"decode": {"instances": 1}}})
        )
        eventually(serving(e2e, 2, 1, 2), timeout=2 * WAIT, message="decode scaled to 1 and served")
        eventually(lambda: len(pods(e2e, "decode")) == 1, timeout=WAIT, message="two decode pods gone")
        result = load.stop()
    assert result.ok > 0
    assert result.failed == []


def test_router_pod_deleted_under_load_cuts_only_its_own_streams(e2e: Cluster) -> None:
    deploy(e2e)
    victim = pods(e2e, "router")[0]
    victim_ip = victim["status"]["podIP"]
    with Load(routers(e2e), concurrency=16, max_tokens=64) as load:
        time.sleep(2)
        deleted_at = time.monotonic()
        e2e.kubectl("delete", "pod", victim["metadata"]["name"], "--wait=false")

        def new_router_serves() -> bool:
            fresh = [
                p["status"]["podIP"]
                for p in pods(e2e, "router")
                if p["metadata"]["uid"] != victim["metadata"]["uid"] and pod_ready(p)
            ]
            return len(fresh) == 2 and all(
                get_json(f"http://{ip}:{ROUTER_PORT}/routing/served")["routable"]["decode"] == 4
                for ip in fresh
            )

        eventually(new_router_serves, timeout=WAIT, message="a new router pod Ready and serving")
        replaced_after = time.monotonic() - deleted_at
        time.sleep(2)
        result = load.stop()
    print(f"router replaced and serving {replaced_after:.1f}s after the delete")
    assert result.ok > 0
    assert [f for f in result.failed if f[0] != f"{victim_ip}:{ROUTER_PORT}"] == []


def test_operator_restarted_mid_rollout_converges(e2e: Cluster, operator: Operator) -> None:
    deploy(e2e)
    patch = {"spec": {"decode": {"template": {"metadata": {"annotations": {"e2e/rev": "2"}}}}}}
    e2e.kubectl("patch", "pdd", NAME, "--type=merge", "-p", json.dumps(patch))

    def draining() -> bool:
        items = json.loads(e2e.kubectl("get", "pods", "-l", "pdserve.io/role=decode", "-o", "json"))["items"]
        return any("pdserve.io/draining-since" in (p["metadata"].get("annotations") or {}) for p in items)

    eventually(draining, timeout=WAIT, message="a decode pod draining")
    assert operator.stop() == 0
    operator.start()

    def converged() -> bool:
        live = pods(e2e, "decode")
        hashes = Counter((p["metadata"].get("annotations") or {}).get("e2e/rev") for p in live)
        return hashes == Counter({"2": 2}) and serving(e2e, 2, 2, 2)()

    eventually(converged, timeout=3 * WAIT, message="both decode pods on the new template and served")
    names = [p["metadata"]["name"] for p in pods(e2e, "decode")]
    assert sorted(names) == sorted(set(names)) and len(names) == 2
