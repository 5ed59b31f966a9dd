"""`pdserve proxy --routing-configmap` against the real API server of the test cluster.

The router runs as a real process with a kubeconfig holding a ServiceAccount token (TokenRequest)
whose Role grants get/list/watch on the one ConfigMap (resourceNames), as the operator sets it
up; the backends are real `pdserve sim` processes, so requests really flow. The API server
"going away" is a loopback TCP forwarder between router and API server that the test cuts
(the API server itself is shared by the whole session).

410 Gone is covered by the unit tests of the event handling (tests/unit/test_proxy_kubewatch.py):
forcing it here would need the API server's watch cache to evict the router's resourceVersion,
which it does not do for fresh events below its upper bound of about 100k events. The outage
test below exercises the resume-from-resourceVersion path that a 410 would interrupt.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.forwarder import Forwarder
from tests.support.kube import (
    KubeCluster,
    Tool,
    apply_objects,
    grant_router_access,
    kubectl_for,
    router_kubeconfig,
    router_role,
)
from tests.support.pdstack import (
    PDStack,
    configmap_proxy_args,
    decode_sim,
    eventually,
    http,
    module_stack,
    only_these_serve,
    prefill_sim,
    proxy_metric,
)
from tests.support.procs import Proc, free_port

pytestmark = pytest.mark.cluster

ACCOUNT = "llama-router"
CONFIGMAP = "llama-routing"


# no table yet: the tests write the ConfigMap
stack = module_stack(
    "configmap", {"p0": prefill_sim(), "p1": prefill_sim(), "d0": decode_sim(), "d1": decode_sim()}
)


class Cm:
    """The test's routing ConfigMap, written through the API as the operator writes it."""

    def __init__(self, api: Any, namespace: str, name: str = CONFIGMAP) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    def put(self, text: str) -> str:
        """Create or replace ``routing.json``; the new resourceVersion."""
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"name": self.name}, "data": {"routing.json": text}}
        try:
            obj = self.core.replace_namespaced_config_map(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            obj = self.core.create_namespaced_config_map(self.namespace, body)
        return str(obj.metadata.resource_version)

    def put_table(self, doc: dict[str, Any]) -> str:
        return self.put(json.dumps(doc))


def start_router(stack: PDStack, configmap: str, kubeconfig: Path, name: str = "router") -> Proc:
    return stack.group.start(f"{name}-{free_port()}", configmap_proxy_args(configmap, kubeconfig))


def served(proxy: Proc) -> dict[str, Any]:
    return http("GET", proxy.url + "/routing/served").json()  # type: ignore[no-any-return]


def ready(proxy: Proc) -> tuple[int, dict[str, Any]]:
    answer = http("GET", proxy.url + "/ready")
    return answer.status, answer.json()


def metric(proxy: Proc, name: str, **labels: str) -> float:
    return proxy_metric(proxy.url, name, **labels)


def unready_because(proxy: Proc, needle: str) -> str:
    """Wait until /ready's reason mentions ``needle``; it must be a 503; the reason."""
    eventually(lambda: needle in ready(proxy)[1].get("reason", ""), timeout=10)
    status, body = ready(proxy)
    assert status == 503 and body["generation"] is None, body
    return str(body["reason"])


def serving(proxy: Proc, generation: int, timeout: float = 15.0) -> None:
    eventually(lambda: served(proxy)["generation"] == generation, timeout=timeout)


def router_access(
    cluster: KubeCluster,
    namespace: str,
    directory: Path,
    configmap: str = CONFIGMAP,
    with_role: bool = True,
    server: str | None = None,
) -> tuple[Tool, Path]:
    """The router's ServiceAccount (and Role + RoleBinding on ``configmap``); its token kubeconfig
    for the API server, or for ``server``."""
    kubectl = kubectl_for(cluster.kubeconfig)
    grant_router_access(kubectl, namespace, ACCOUNT, configmap, with_role=with_role)
    return kubectl, router_kubeconfig(kubectl, namespace, ACCOUNT, directory, server=server)


@pytest.fixture
def access(kube_cluster: KubeCluster, kube_namespace: str, tmp_path: Path) -> Path:
    return router_access(kube_cluster, kube_namespace, tmp_path)[1]


def test_serves_the_configmap_and_follows_every_update(
    stack: PDStack, kube_api: Any, kube_namespace: str, access: Path
) -> None:
    s = stack.sims
    cm = Cm(kube_api, kube_namespace)
    first = stack.table([s["p0"]], [s["d0"]])
    cm.put_table(first)
    proxy = start_router(stack, cm.ref, access)
    eventually(lambda: ready(proxy)[0] == 200, timeout=15)
    view = served(proxy)
    assert (view["generation"], view["source"], view["deployment"]) == (
        first["generation"],
        f"configmap {cm.ref}",
        "test",
    )
    only_these_serve(stack, proxy.url, [s["p0"]], [s["d0"]])

    latencies: list[float] = []
    shapes = [([s["p1"]], [s["d1"]]), ([s["p0"], s["p1"]], [s["d0"], s["d1"]]), ([s["p1"]], [s["d0"]])]
    for prefill, decode in shapes * 2:
        doc = stack.table(prefill, decode)
        written = time.monotonic()
        cm.put_table(doc)
        while served(proxy)["generation"] != doc["generation"]:
            assert time.monotonic() - written < 15, f"generation {doc['generation']} not served"
            time.sleep(0.005)
        latencies.append(time.monotonic() - written)
        only_these_serve(stack, proxy.url, prefill, decode)
    print(
        f"\nConfigMap write -> served by the router (incl. the write call): "
        f"median {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms, "
        f"all {[round(x * 1000) for x in latencies]} ms"
    )
    good = stack.generation

    # malformed tables are refused; the last good one keeps serving, with a metric and the reason
    rv = cm.put('{"apiVersion": "pdserve.io/v1alpha1", "kind": "RoutingTable"')
    eventually(lambda: metric(proxy, "pdserve_proxy_routing_reload_errors_total") == 1, timeout=10)
    debug = http("GET", proxy.url + "/debug/routing").json()
    assert debug["generation"] == good
    assert debug["last_reload_error"].startswith(
        f"ConfigMap {cm.ref} (resourceVersion {rv}) rejected, keeping generation {good}: not valid JSON"
    )
    bad = stack.table([s["p0"]], [s["d1"]])
    bad["decode"][0]["dpSize"] = "one"
    cm.put_table(bad)
    eventually(lambda: metric(proxy, "pdserve_proxy_routing_reload_errors_total") == 2, timeout=10)
    assert "decode[0].dpSize: expected an integer >= 1" in served(proxy)["error"]
    assert ready(proxy)[0] == 200 and served(proxy)["generation"] == good
    only_these_serve(stack, proxy.url, [s["p1"]], [s["d0"]])  # the last good shape
    fixed = stack.table([s["p0"]], [s["d1"]])
    cm.put_table(fixed)
    serving(proxy, fixed["generation"])
    assert served(proxy)["error"] is None
    only_these_serve(stack, proxy.url, [s["p0"]], [s["d1"]])
    token = yaml.safe_load(access.read_text())["users"][0]["user"]["token"]
    assert token not in proxy.log() and token not in json.dumps(served(proxy))


def test_missing_role_is_named_and_the_router_recovers_once_granted(
    stack: PDStack, kube_cluster: KubeCluster, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    kubectl, kubeconfig = router_access(kube_cluster, kube_namespace, tmp_path, with_role=False)
    cm = Cm(kube_api, kube_namespace)
    doc = stack.table([stack.sims["p0"]], [stack.sims["d0"]])
    cm.put_table(doc)
    proxy = start_router(stack, cm.ref, kubeconfig)
    reason = unready_because(proxy, "forbidden")
    expected = (
        f"cannot list ConfigMap {cm.ref}: forbidden: the router's service account "
        f'system:serviceaccount:{kube_namespace}:{ACCOUNT} cannot list configmaps "{CONFIGMAP}" in namespace '
        f"{kube_namespace}; grant get, list and watch on it (Role {ACCOUNT} with resourceNames [{CONFIGMAP}]"
    )
    assert expected in reason, reason
    assert expected in proxy.log()
    assert metric(proxy, "pdserve_proxy_routing_watch_errors_total", reason="forbidden") >= 1
    assert served(proxy)["generation"] is None and served(proxy)["instances"] == {}

    apply_objects(kubectl, router_role(kube_namespace, ACCOUNT, CONFIGMAP)[1:])  # Role + RoleBinding
    granted = time.monotonic()
    eventually(lambda: ready(proxy)[0] == 200, timeout=20)  # retries back off to at most 10 s
    print(f"\nready {time.monotonic() - granted:.1f} s after the Role was granted")
    assert served(proxy)["generation"] == doc["generation"]
    only_these_serve(stack, proxy.url, [stack.sims["p0"]], [stack.sims["d0"]])


def test_wrong_configmap_name_says_which_object_and_waits_for_it(
    stack: PDStack, kube_cluster: KubeCluster, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    typo = "llama-routnig"  # the router may read it, but it is not there
    _, kubeconfig = router_access(kube_cluster, kube_namespace, tmp_path, configmap=typo)
    Cm(kube_api, kube_namespace).put_table(stack.table([stack.sims["p0"]], [stack.sims["d0"]]))
    wrong = Cm(kube_api, kube_namespace, typo)
    proxy = start_router(stack, wrong.ref, kubeconfig)
    reason = unready_because(proxy, "not found")
    assert f"ConfigMap {wrong.ref} not found: no ConfigMap '{typo}' in namespace {kube_namespace}" in reason
    assert "watching for it to be created" in reason
    doc = stack.table([stack.sims["p1"]], [stack.sims["d1"]])
    wrong.put_table(doc)  # the watch sees it appear: no polling, no restart
    serving(proxy, doc["generation"], timeout=5)
    assert ready(proxy)[0] == 200 and served(proxy)["error"] is None


def test_unreachable_api_server_at_start_then_reachable(
    stack: PDStack, kube_cluster: KubeCluster, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens here yet
    _, kubeconfig = router_access(kube_cluster, kube_namespace, tmp_path, server=f"https://127.0.0.1:{port}")
    cm = Cm(kube_api, kube_namespace)
    doc = stack.table([stack.sims["p0"]], [stack.sims["d1"]])
    cm.put_table(doc)
    proxy = start_router(stack, cm.ref, kubeconfig)
    reason = unready_because(proxy, "cannot reach")
    assert f"cannot reach the API server at https://127.0.0.1:{port} to read ConfigMap {cm.ref}" in reason
    assert metric(proxy, "pdserve_proxy_routing_watch_errors_total", reason="unreachable") >= 1
    assert metric(proxy, "pdserve_proxy_routing_source_up") == 0
    forwarder = Forwarder(api_port(kube_cluster), port=port).start()
    try:
        eventually(lambda: ready(proxy)[0] == 200, timeout=20)
        assert served(proxy)["generation"] == doc["generation"]
        assert metric(proxy, "pdserve_proxy_routing_source_up") == 1
    finally:
        forwarder.close()


def api_port(cluster: KubeCluster) -> int:
    server = json.loads(cluster.kubectl("config", "view", "--minify", "-o", "json").stdout)["clusters"][0]
    port = urlsplit(server["cluster"]["server"]).port
    assert port is not None
    return port


def test_api_server_going_away_keeps_the_last_table_serving(
    stack: PDStack, kube_cluster: KubeCluster, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    s = stack.sims
    forwarder = Forwarder(api_port(kube_cluster)).start()
    try:
        _, kubeconfig = router_access(kube_cluster, kube_namespace, tmp_path, server=forwarder.url)
        cm = Cm(kube_api, kube_namespace)
        first = stack.table([s["p0"]], [s["d0"]])
        cm.put_table(first)
        proxy = start_router(stack, cm.ref, kubeconfig)
        eventually(lambda: ready(proxy)[0] == 200, timeout=15)

        forwarder.close()  # the API server is gone for this router
        eventually(lambda: "cannot reach the API server" in (served(proxy)["error"] or ""), timeout=15)
        second = stack.table([s["p1"]], [s["d1"]])
        cm.put_table(second)  # written while the router cannot see it
        time.sleep(1.0)
        assert ready(proxy)[0] == 200  # the last good table keeps serving
        assert served(proxy)["generation"] == first["generation"]
        only_these_serve(stack, proxy.url, [s["p0"]], [s["d0"]])
        assert metric(proxy, "pdserve_proxy_routing_source_up") == 0

        forwarder = Forwarder(forwarder.target[1], port=forwarder.port).start()  # back on the same port
        serving(proxy, second["generation"], timeout=20)
        assert served(proxy)["error"] is None
        assert metric(proxy, "pdserve_proxy_routing_watch_restarts_total") >= 1
        only_these_serve(stack, proxy.url, [s["p1"]], [s["d1"]])
    finally:
        forwarder.close()


def test_deleted_configmap_keeps_the_last_table_and_says_so(
    stack: PDStack, kube_api: Any, kube_namespace: str, access: Path
) -> None:
    cm = Cm(kube_api, kube_namespace)
    doc = stack.table([stack.sims["p0"]], [stack.sims["d0"]])
    cm.put_table(doc)
    proxy = start_router(stack, cm.ref, access)
    eventually(lambda: ready(proxy)[0] == 200, timeout=15)
    cm.core.delete_namespaced_config_map(cm.name, cm.namespace)
    message = (
        f"ConfigMap {cm.ref} was deleted; keeping generation {doc['generation']} until it is written again"
    )
    eventually(lambda: served(proxy)["error"] == message, timeout=10)
    assert ready(proxy)[0] == 200 and message in proxy.log()
    only_these_serve(stack, proxy.url, [stack.sims["p0"]], [stack.sims["d0"]])
    again = stack.table([stack.sims["p1"]], [stack.sims["d0"]])
    cm.put_table(again)
    serving(proxy, again["generation"], timeout=5)
    assert served(proxy)["error"] is None


def test_rejected_token_is_explained(
    stack: PDStack, kube_cluster: KubeCluster, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    """A token the API server does not accept (here: one for a deleted ServiceAccount)."""
    kubectl, kubeconfig = router_access(kube_cluster, kube_namespace, tmp_path)
    kubectl("delete", "serviceaccount", ACCOUNT, "-n", kube_namespace)  # its tokens die with it
    cm = Cm(kube_api, kube_namespace)
    cm.put_table(stack.table([stack.sims["p0"]], [stack.sims["d0"]]))
    proxy = start_router(stack, cm.ref, kubeconfig)
    reason = unready_because(proxy, "unauthorized")
    assert f"token of system:serviceaccount:{kube_namespace}:{ACCOUNT}" in reason
