"""The test cluster's LeaderWorkerSet controller (hack/cluster, built from sigs.k8s.io/lws) works.

The CRD is served, and a LeaderWorkerSet of 2 groups of 3 runs on the pod runner as upstream
runs it: the controller makes a leader StatefulSet and one worker StatefulSet per leader, its
pod webhook (registered by URL on 127.0.0.1) labels every pod with its group and worker index and
gives its containers LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX, and with
``RecreateGroupOnPodRestart`` losing one worker recreates its whole group, leader included, while
the other group is left alone.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from typing import Any

import pytest

from tests.support.kube import KubeCluster, eventually

pytestmark = pytest.mark.cluster

LWS_RESOURCE = "leaderworkersets.leaderworkerset.x-k8s.io"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
RUNNER_NODE = "run-node-0"

#: Answers every GET with 200 and, on /env, its own environment: the test reads what the pod
#: runner gave the process, not only what the pod spec says.
ENV_SERVER = textwrap.dedent(
    """
    import http.server, json, os
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
            self.wfile.write(json.dumps(dict(os.environ)).encode())
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
    """
)


def lws_served(cluster: KubeCluster) -> bool:
    out = cluster.kubectl("api-resources", "--api-group=leaderworkerset.x-k8s.io", "-o", "name", check=False)
    return out.returncode == 0 and LWS_RESOURCE in out.stdout.split()


def require_lws(cluster: KubeCluster) -> None:
    """The local cluster must serve LeaderWorkerSets; another one (kind) may lack the controller."""
    if cluster.is_local:
        assert lws_served(cluster), "hack/cluster/up installs the LeaderWorkerSet CRD"
    elif not lws_served(cluster):
        pytest.skip("the cluster in PDSERVE_TEST_KUBECONFIG has no LeaderWorkerSet API")


def require_runner_node(cluster: KubeCluster) -> None:
    """The pods run on the pod runner's node (hack/cluster/up), also when the local cluster is
    reached through PDSERVE_TEST_KUBECONFIG."""
    out = cluster.kubectl("get", "node", RUNNER_NODE, "-o", "json", check=False)
    if out.returncode != 0:
        if cluster.is_local:
            pytest.fail(f"{RUNNER_NODE} is missing: see .cluster/logs/pod-runner.log")
        pytest.skip(f"needs the pod runner's node {RUNNER_NODE} (hack/cluster/up)")


def container(role: str) -> dict[str, Any]:
    return {
        "name": role,
        "image": "python:3",
        "command": ["python3", "-c", ENV_SERVER],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
        # The worker is seen Terminating for a moment (the controller reacts to that, as it would
        # to a kubelet's slower shutdown), not deleted outright.
        "lifecycle": {"preStop": {"sleep": {"seconds": 2}}},
    }


def pod_template(role: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"pdserve.test/role": role}},
        "spec": {"containers": [container(role)], "terminationGracePeriodSeconds": 10},
    }


def leader_worker_set(name: str, replicas: int, size: int) -> dict[str, Any]:
    """Every field the LWS webhook would default is given, so the object means the same without it."""
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template("leader"),
                "workerTemplate": pod_template("worker"),
            },
        },
    }


def lws_pods(cluster: KubeCluster, ns: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", f"{NAME_LABEL}={name}", "-o", "json")
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def all_ready(cluster: KubeCluster, ns: str, name: str, count: int) -> list[dict[str, Any]] | None:
    pods = [p for p in lws_pods(cluster, ns, name) if not p["metadata"].get("deletionTimestamp")]
    return pods if len(pods) == count and all(ready(p) for p in pods) else None


def indices(pod_name: str) -> tuple[str, str]:
    """(group, worker) index by upstream's naming: leader ``<lws>-<group>``, worker
    ``<lws>-<group>-<worker>``."""
    parts = pod_name.split("-")[1:]
    return parts[0], parts[1] if len(parts) > 1 else "0"


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}


def process_env(pod: dict[str, Any]) -> dict[str, str]:
    url = f"http://{pod['status']['podIP']}:8080/env"
    with urllib.request.urlopen(url, timeout=5) as response:
        env: dict[str, str] = json.loads(response.read())
    return env


def test_leaderworkerset_crd_is_served(kube_cluster: KubeCluster) -> None:
    require_lws(kube_cluster)
    doc = json.loads(kube_cluster.kubectl("get", "--raw", "/apis/leaderworkerset.x-k8s.io/v1").stdout)
    resources = {r["name"]: r for r in doc["resources"]}
    assert resources["leaderworkersets"]["kind"] == "LeaderWorkerSet", resources
    assert resources["leaderworkersets"]["namespaced"] is True
    # The scale subresource is what an autoscaler (and `kubectl scale`) uses.
    assert "leaderworkersets/scale" in resources, sorted(resources)


def test_leaderworkerset_webhooks_default_and_validate(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    """The controller's webhooks answer through kube-apiserver (by URL on 127.0.0.1 locally)."""
    require_lws(kube_cluster)
    bare = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "bare"},
        "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": pod_template("worker")}},
    }
    out = kube_cluster.kubectl(
        "create", "--dry-run=server", "-n", kube_namespace, "-o", "json", "-f", "-", input=json.dumps(bare)
    )
    spec = json.loads(out.stdout)["spec"]
    # Set by the mutating webhook only (the CRD's schema defaults replicas and startupPolicy).
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart", spec
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}, spec
    assert spec["rolloutStrategy"]["type"] == "RollingUpdate", spec
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] == 1, spec

    # Refused by the validating webhook (the schema allows it): a rollout that can never progress.
    stuck = json.loads(json.dumps(bare))
    stuck["spec"]["rolloutStrategy"] = {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 0},
    }
    refused = kube_cluster.kubectl(
        "create", "--dry-run=server", "-n", kube_namespace, "-f", "-", input=json.dumps(stuck), check=False
    )
    assert refused.returncode != 0
    assert "vleaderworkerset.kb.io" in refused.stderr, refused.stderr
    assert "must not be 0 when `maxSurge` is 0" in refused.stderr, refused.stderr


def test_leaderworkerset_groups_run_labelled_and_recreate_as_a_group(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    require_lws(kube_cluster)
    require_runner_node(kube_cluster)
    ns, name = kube_namespace, "grp"
    kube_cluster.apply(json.dumps(leader_worker_set(name, replicas=2, size=3)), namespace=ns)

    pods = eventually(
        lambda: all_ready(kube_cluster, ns, name, 6), timeout=180, interval=1, message="6 Ready LWS pods"
    )
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert sorted(by_name) == ["grp-0", "grp-0-1", "grp-0-2", "grp-1", "grp-1-1", "grp-1-2"]
    for pod_name, pod in by_name.items():
        group, worker = indices(pod_name)
        labels = pod["metadata"]["labels"]
        assert labels[NAME_LABEL] == name
        assert (labels[GROUP_LABEL], labels[WORKER_LABEL]) == (group, worker), (pod_name, labels)
        assert labels["pdserve.test/role"] == ("leader" if worker == "0" else "worker"), pod_name
        assert pod["spec"]["nodeName"] == RUNNER_NODE, pod_name
        expected = {
            "LWS_LEADER_ADDRESS": f"grp-{group}.grp.{ns}",
            "LWS_GROUP_SIZE": "3",
            "LWS_WORKER_INDEX": worker,
        }
        spec_env = env_of(pod)
        assert {k: spec_env.get(k) for k in expected} == expected, (pod_name, spec_env)
        # The pod runner ran the process with that environment.
        running = process_env(pod)
        assert {k: running.get(k) for k in expected} == expected, pod_name
    # The controller's own view: one leader StatefulSet of 2, a worker StatefulSet of 2 per group.
    sts = json.loads(kube_cluster.kubectl("get", "statefulsets", "-n", ns, "-o", "json").stdout)["items"]
    assert {s["metadata"]["name"]: s["spec"]["replicas"] for s in sts} == {"grp": 2, "grp-0": 2, "grp-1": 2}
    eventually(
        lambda: (
            json.loads(kube_cluster.kubectl("get", "lws", name, "-n", ns, "-o", "json").stdout)["status"].get(
                "readyReplicas"
            )
            == 2
        ),
        timeout=60,
        message="LeaderWorkerSet status.readyReplicas == 2",
    )

    uids = {n: p["metadata"]["uid"] for n, p in by_name.items()}
    kube_cluster.kubectl("delete", "pod", "grp-1-2", "-n", ns, "--wait=false")

    def group_one_recreated() -> list[dict[str, Any]] | None:
        current = all_ready(kube_cluster, ns, name, 6)
        if current is None:
            return None
        group_one = [p for p in current if p["metadata"]["labels"][GROUP_LABEL] == "1"]
        renewed = all(p["metadata"]["uid"] != uids[p["metadata"]["name"]] for p in group_one)
        return current if renewed else None

    pods = eventually(group_one_recreated, timeout=180, interval=1, message="group 1 recreated and Ready")
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    # The leader went too (RecreateGroupOnPodRestart), not only the worker that was deleted...
    assert after["grp-1"] != uids["grp-1"] and after["grp-1-1"] != uids["grp-1-1"]
    # ...and the other group was not touched.
    assert {n: after[n] for n in ("grp-0", "grp-0-1", "grp-0-2")} == {
        n: uids[n] for n in ("grp-0", "grp-0-1", "grp-0-2")
    }
    events = json.loads(
        kube_cluster.kubectl(
            "get", "events", "-n", ns, "--field-selector", "reason=RecreateGroupOnPodRestart", "-o", "json"
        ).stdout
    )["items"]
    assert any("grp-1-2" in e["message"] for e in events), [e["message"] for e in events]
