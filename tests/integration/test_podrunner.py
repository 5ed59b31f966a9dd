"""The test cluster's pod runner (hack/cluster/podrunner.py) runs pods for real, like a kubelet.

Raw pods on run-node-0: their environment (ConfigMap, Secret, downward API, ``$(VAR)``), their
probes and conditions, restarts with back-off, deletion (preStop, SIGTERM, SIGKILL after the
grace period), the service-account token, refusal of what the runner does not support,
placement (GPU pods on kwok nodes, the rest on the runner) and a rendered ``engine: vllm`` pod
served by the ``vllm`` stand-in. Each test reaches its pod by the pod IP.
"""

from __future__ import annotations

import copy
import json
import os
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.routing import Role
from tests.support.kube import KubeCluster, eventually
from tests.support.specs import sim_manifest, vllm_manifest

pytestmark = pytest.mark.cluster

RUNNER_NODE = "run-node-0"

#: A server that answers GET /env with its environment and GET /ready with 200 once a POST
#: /ready/on arrived (503 again after /ready/off).
ENV_SERVER = textwrap.dedent(
    """
    import http.server, json, os, sys
    state = {"ready": False}
    class H(http.server.BaseHTTPRequestHandler):
        def _send(self, code, body):
            self.send_response(code); self.end_headers(); self.wfile.write(json.dumps(body).encode())
        def do_GET(self):
            if self.path == "/ready":
                return self._send(200 if state["ready"] else 503, state)
            if self.path.startswith("/file/"):
                try:
                    return self._send(200, open(self.path[len("/file"):]).read())
                except OSError as exc:
                    return self._send(404, str(exc))
            self._send(200, {"env": dict(os.environ), "argv": sys.argv})
        def do_POST(self):
            state["ready"] = self.path == "/ready/on"
            self._send(200, state)
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer((sys.argv[1], 8080), H).serve_forever()
    """
)


@pytest.fixture
def ns(local_namespace: str) -> str:
    """The test's namespace: its pods run on the pod runner of the local test cluster."""
    return local_namespace


def pod_json(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)
    return out


def create(cluster: KubeCluster, ns: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl(
        "create",
        "-n",
        ns,
        "-f",
        "-",
        input=json.dumps({"kind": "List", "apiVersion": "v1", "items": list(objects)}),
    )


def pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 10, **spec},
    }


def server_container(**extra: Any) -> dict[str, Any]:
    return {
        "name": "web",
        "image": "python:3",
        "command": ["python3", "-c", ENV_SERVER],
        "args": ["0.0.0.0"],
        "ports": [{"name": "http", "containerPort": 8080}],
        **extra,
    }


def condition(p: dict[str, Any], kind: str) -> str | None:
    for c in (p.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return str(c["status"])
    return None


def running_ip(cluster: KubeCluster, ns: str, name: str) -> str:
    def ip() -> str | None:
        p = pod_json(cluster, ns, name)
        status = p.get("status") or {}
        return status.get("podIP") if status.get("phase") == "Running" else None

    return eventually(ip, timeout=60, message=f"pod {name} Running with an IP")


def http(method: str, url: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def gone(cluster: KubeCluster, ns: str, name: str) -> bool:
    out = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "name", check=False)
    return out.returncode != 0 and "NotFound" in out.stderr


def test_env_from_configmap_secret_downward_api_and_expansion(kube_cluster: KubeCluster, ns: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cfg"},
        "data": {"greeting": "hello", "A": "1"},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "sec"},
        "stringData": {"token": "s3cret", "B": "2"},
    }
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
        {"name": "MISSING", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "requests.memory", "divisor": "1Mi"}}},
        {"name": "MSG", "value": "$(GREETING) from $(POD_NAME) at $(POD_IP), $$(GREETING) $(UNDEFINED)"},
    ]
    container = server_container(
        env=env,
        envFrom=[{"configMapRef": {"name": "cfg"}, "prefix": "CM_"}, {"secretRef": {"name": "sec"}}],
        args=["$(POD_IP)", "$(GREETING)"],
        resources={"requests": {"memory": "64Mi"}},
    )
    create(kube_cluster, ns, config, secret, pod("env", [container]))
    ip = running_ip(kube_cluster, ns, "env")
    assert ip.startswith("127.128.")
    _, body = eventually(lambda: http("GET", f"http://{ip}:8080/env"), timeout=30, message="the env server")
    got = body["env"]
    assert got["POD_NAME"] == "env" and got["POD_NS"] == ns and got["POD_IP"] == ip
    assert got["NODE"] == RUNNER_NODE and got["APP"] == "env"
    assert got["GREETING"] == "hello" and got["TOKEN"] == "s3cret" and "MISSING" not in got
    assert got["CM_greeting"] == "hello" and got["CM_A"] == "1" and got["B"] == "2"
    assert got["MEM"] == "64"
    assert got["MSG"] == f"hello from env at {ip}, $(GREETING) $(UNDEFINED)"
    assert got["HOSTNAME"] == "env" and got["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert body["argv"][1:] == [ip, "hello"]


def test_volumes_configmap_secret_downward_api_and_memory_empty_dir(
    kube_cluster: KubeCluster, ns: str
) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "files"},
        "data": {"a": "1", "b": "2"},
    }
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "stringData": {"key": "k1"}}
    volumes = [
        {"name": "cfg", "configMap": {"name": "files", "items": [{"key": "a", "path": "sub/a.txt"}]}},
        {"name": "whole", "configMap": {"name": "files"}},
        {"name": "sec", "secret": {"secretName": "keys"}},
        {
            "name": "info",
            "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]},
        },
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "cfg", "mountPath": "/etc/podrunner-test/cfg", "readOnly": True},
        {"name": "whole", "mountPath": "/etc/podrunner-test/whole"},
        {"name": "whole", "mountPath": "/etc/podrunner-test/b-only", "subPath": "b"},
        {"name": "sec", "mountPath": "/etc/podrunner-test/sec"},
        {"name": "info", "mountPath": "/etc/podrunner-test/info"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    create(
        kube_cluster,
        ns,
        config,
        secret,
        pod("vols", [server_container(volumeMounts=mounts)], volumes=volumes),
    )
    ip = running_ip(kube_cluster, ns, "vols")

    def read(path: str) -> Any:
        code, body = http("GET", f"http://{ip}:8080/file{path}")
        return body if code == 200 else None

    assert eventually(lambda: read("/etc/podrunner-test/cfg/sub/a.txt"), timeout=30, message="a.txt") == "1"
    assert read("/etc/podrunner-test/cfg/b") is None  # items: only the listed key
    assert read("/etc/podrunner-test/b-only") == "2"
    assert read("/etc/podrunner-test/sec/key") == "k1"
    assert read("/etc/podrunner-test/info/labels") == 'app="vols"'
    # The mounts are the container's own: the host sees none of them.
    assert not Path("/etc/podrunner-test/cfg/sub/a.txt").exists()
    # A ConfigMap change reaches a directory mount (the kubelet's atomic ..data swap).
    config["data"]["b"] = "changed"
    kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(config))
    eventually(lambda: read("/etc/podrunner-test/whole/b") == "changed", timeout=30, message="the update")


def test_missing_configmap_key_is_a_config_error_until_it_appears(kube_cluster: KubeCluster, ns: str) -> None:
    env = [{"name": "G", "valueFrom": {"configMapKeyRef": {"name": "late", "key": "g"}}}]
    create(kube_cluster, ns, pod("late", [server_container(env=env)]))

    def waiting_reason() -> str | None:
        statuses = (pod_json(kube_cluster, ns, "late").get("status") or {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting", {}).get("reason") if statuses else None

    eventually(
        lambda: waiting_reason() == "CreateContainerConfigError",
        timeout=30,
        message="CreateContainerConfigError",
    )
    late = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "late"}, "data": {"g": "now"}}
    create(kube_cluster, ns, late)
    ip = running_ip(kube_cluster, ns, "late")
    _, body = eventually(lambda: http("GET", f"http://{ip}:8080/env"), timeout=30, message="the env server")
    assert body["env"]["G"] == "now"


def test_readiness_probe_sets_ready_both_ways(kube_cluster: KubeCluster, ns: str) -> None:
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1}
    create(kube_cluster, ns, pod("probe", [server_container(readinessProbe=probe)]))
    ip = running_ip(kube_cluster, ns, "probe")
    eventually(lambda: http("GET", f"http://{ip}:8080/ready")[0] == 503, timeout=30, message="the server")
    p = pod_json(kube_cluster, ns, "probe")
    assert condition(p, "Ready") == "False" and p["status"]["containerStatuses"][0]["ready"] is False
    http("POST", f"http://{ip}:8080/ready/on")
    eventually(
        lambda: condition(pod_json(kube_cluster, ns, "probe"), "Ready") == "True", timeout=30, message="Ready"
    )
    p = pod_json(kube_cluster, ns, "probe")
    assert condition(p, "ContainersReady") == "True" and p["status"]["containerStatuses"][0]["ready"] is True
    http("POST", f"http://{ip}:8080/ready/off")
    eventually(
        lambda: condition(pod_json(kube_cluster, ns, "probe"), "Ready") == "False",
        timeout=30,
        message="unready",
    )


def test_exited_process_restarts_with_count_and_back_off(kube_cluster: KubeCluster, ns: str) -> None:
    crash = {"name": "crash", "image": "busybox", "command": ["sh", "-c", "echo started; exit 3"]}
    create(kube_cluster, ns, pod("crash", [crash]))

    def status() -> dict[str, Any] | None:
        statuses = (pod_json(kube_cluster, ns, "crash").get("status") or {}).get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 2 else None

    s = eventually(status, timeout=60, message="two restarts")
    assert s["lastState"]["terminated"]["exitCode"] == 3
    assert s["lastState"]["terminated"]["reason"] == "Error"
    # After the second crash the kubelet waits 10 s, then 20 s: CrashLoopBackOff in between.
    eventually(
        lambda: (
            (
                pod_json(kube_cluster, ns, "crash")["status"]["containerStatuses"][0]["state"].get("waiting")
                or {}
            ).get("reason")
            == "CrashLoopBackOff"
        ),
        timeout=60,
        message="CrashLoopBackOff",
    )


def test_liveness_failure_restarts_the_container(kube_cluster: KubeCluster, ns: str) -> None:
    probe = {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 1, "failureThreshold": 2}
    create(
        kube_cluster,
        ns,
        pod("live", [server_container(livenessProbe=probe)], terminationGracePeriodSeconds=2),
    )

    def restarted() -> bool:
        statuses = (pod_json(kube_cluster, ns, "live").get("status") or {}).get("containerStatuses") or []
        return bool(statuses) and statuses[0]["restartCount"] >= 1

    eventually(restarted, timeout=60, message="a restart after the liveness probe failed")


HANDLER_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    log = sys.argv[1]
    def note(text):
        with open(log, "a") as f:
            f.write(text + "\\n")
    def on_term(*_):
        note("sigterm")
        if sys.argv[2] == "exit":
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    note("started")
    while True:
        time.sleep(0.1)
    """
)


def handler_pod(name: str, shared: Path, on_term: str, grace: int) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "python:3",
        "command": ["python3", "-c", HANDLER_SCRIPT, "/shared/events", on_term],
        "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo prestop >> /shared/events"]}}},
    }
    return pod(
        name,
        [container],
        terminationGracePeriodSeconds=grace,
        volumes=[{"name": "shared", "hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}}],
    )


def test_deletion_runs_prestop_then_sigterm_and_removes_the_pod(
    kube_cluster: KubeCluster, ns: str, tmp_path: Path
) -> None:
    create(kube_cluster, ns, handler_pod("stop", tmp_path, "exit", 30))
    events = tmp_path / "events"
    running_ip(kube_cluster, ns, "stop")
    eventually(lambda: events.is_file() and "started" in events.read_text(), timeout=30, message="started")
    kube_cluster.kubectl("delete", "pod", "stop", "-n", ns, "--wait=false")
    eventually(lambda: gone(kube_cluster, ns, "stop"), timeout=60, message="the pod object deleted")
    assert events.read_text().split() == ["started", "prestop", "sigterm"]


def test_sigkill_after_the_grace_period(kube_cluster: KubeCluster, ns: str, tmp_path: Path) -> None:
    create(kube_cluster, ns, handler_pod("stubborn", tmp_path, "ignore", 2))
    events = tmp_path / "events"
    running_ip(kube_cluster, ns, "stubborn")
    eventually(lambda: events.is_file() and "started" in events.read_text(), timeout=30, message="started")
    pid = int(
        pod_json(kube_cluster, ns, "stubborn")["status"]["containerStatuses"][0]["containerID"].split("//")[1]
    )
    assert Path(f"/proc/{pid}").exists()
    kube_cluster.kubectl("delete", "pod", "stubborn", "-n", ns, "--wait=false")
    eventually(lambda: gone(kube_cluster, ns, "stubborn"), timeout=60, message="the pod object deleted")
    assert events.read_text().split() == ["started", "prestop", "sigterm"]  # it ignored SIGTERM...
    assert not Path(f"/proc/{pid}").exists()  # ...and SIGKILL ended it


API_CALLER = textwrap.dedent(
    """
    import json, os, ssl, sys, urllib.request, urllib.error
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    token = open(f"{sa}/token").read()
    ns = open(f"{sa}/namespace").read()
    ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
    base = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
    def call(path):
        req = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + token})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, None
    code, cm = call(f"/api/v1/namespaces/{ns}/configmaps/allowed")
    denied, _ = call(f"/api/v1/namespaces/{ns}/secrets")
    print("results", code, denied, cm and cm["data"]["k"], flush=True)
    sys.exit(0 if (code, denied, cm and cm["data"]["k"]) == (200, 403, "v") else 1)
    """
)


def test_service_account_token_calls_the_api_as_the_service_account(
    kube_cluster: KubeCluster, ns: str
) -> None:
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "allowed"}, "data": {"k": "v"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "read-one"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": ["allowed"],
                    "verbs": ["get"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "read-one"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-one"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    ]
    caller = {"name": "caller", "image": "python:3", "command": ["python3", "-c", API_CALLER]}
    create(
        kube_cluster,
        ns,
        *objects,
        pod("caller", [caller], serviceAccountName="reader", restartPolicy="Never"),
    )

    def phase() -> str | None:
        value = (pod_json(kube_cluster, ns, "caller").get("status") or {}).get("phase")
        return value if value in ("Succeeded", "Failed") else None

    assert eventually(phase, timeout=60, message="the caller pod to finish") == "Succeeded"


def test_unsupported_volume_is_reported_not_ignored(kube_cluster: KubeCluster, ns: str) -> None:
    container = server_container(volumeMounts=[{"name": "data", "mountPath": "/data"}])
    volumes = [{"name": "data", "nfs": {"server": "127.0.0.1", "path": "/export"}}]
    create(kube_cluster, ns, pod("nfs", [container], volumes=volumes, nodeName=RUNNER_NODE))

    def waiting() -> dict[str, Any] | None:
        statuses = (pod_json(kube_cluster, ns, "nfs").get("status") or {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting") if statuses else None

    state = eventually(waiting, timeout=30, message="a waiting state")
    assert state["reason"] == "RunnerUnsupported"
    assert "spec.volumes[0].nfs" in state["message"]

    def warning() -> bool:
        events = json.loads(kube_cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        return any(e["reason"] == "RunnerUnsupported" and e["type"] == "Warning" for e in events)

    eventually(warning, timeout=30, message="a RunnerUnsupported Warning event")
    kube_cluster.kubectl("delete", "pod", "nfs", "-n", ns, "--wait=false")
    eventually(lambda: gone(kube_cluster, ns, "nfs"), timeout=30, message="the unsupported pod deleted")


def test_gpu_pods_land_on_kwok_nodes_and_the_rest_on_the_runner(kube_cluster: KubeCluster, ns: str) -> None:
    gpu = {
        "name": "c",
        "image": "x",
        "command": ["sleep", "3600"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    plain = {"name": "c", "image": "x", "command": ["sleep", "3600"]}
    create(kube_cluster, ns, pod("gpu", [gpu]), pod("plain", [plain]))

    def node_of(name: str) -> str | None:
        p = pod_json(kube_cluster, ns, name)
        return p["spec"].get("nodeName") if condition(p, "Ready") == "True" else None

    assert eventually(lambda: node_of("gpu"), timeout=60, message="the GPU pod Ready").startswith("gpu-node-")
    assert eventually(lambda: node_of("plain"), timeout=60, message="the plain pod Ready") == RUNNER_NODE
    tolerations = pod_json(kube_cluster, ns, "gpu")["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def vllm_engine_pod(namespace: str) -> dict[str, Any]:
    pdd = parse_pddeployment(
        vllm_manifest(
            "v",
            metadata={"namespace": namespace, "generation": 1},
            model="Qwen/Qwen3-0.6B",
            servedModelName="qwen",
            prefill={
                "instances": 1,
                "dataParallel": 2,
                "args": ["--max-model-len", "2048", "--enforce-eager"],
            },
            decode={"instances": 1},
        )
    )
    rendered = copy.deepcopy(instance_pod(pdd, Role.PREFILL, 0))
    rendered["metadata"].pop("ownerReferences", None)  # no PDDeployment object here
    spec = rendered["spec"]
    spec["nodeName"] = RUNNER_NODE
    for c in spec["containers"]:
        for section in ("requests", "limits"):
            for key in [k for k in (c.get("resources") or {}).get(section, {}) if k.endswith("/gpu")]:
                del c["resources"][section][key]
    return rendered


def test_rendered_vllm_engine_pod_runs_the_stand_in_and_turns_ready(
    kube_cluster: KubeCluster, ns: str
) -> None:
    engine = vllm_engine_pod(ns)
    create(kube_cluster, ns, engine)
    name = engine["metadata"]["name"]
    eventually(
        lambda: condition(pod_json(kube_cluster, ns, name), "Ready") == "True", timeout=90, message="Ready"
    )
    ip = pod_json(kube_cluster, ns, name)["status"]["podIP"]
    _, models = http("GET", f"http://{ip}:8000/v1/models")
    assert [m["id"] for m in models["data"]] == ["qwen"]
    log = Path(os.environ.get("PDSERVE_CLUSTER_DIR") or Path(__file__).resolve().parents[2] / ".cluster")
    text = (log / "logs" / "pods" / f"{ns}_{name}_engine.log").read_text()
    assert "pdserve simulator" in text and "--role prefill --dp-size 2" in text


def test_rendered_sim_engines_and_router_serve_a_request_by_pod_ip(
    kube_cluster: KubeCluster, ns: str
) -> None:
    """The operator's objects for ``engine: sim``, applied by hand: engines and router really run."""
    metadata = {"namespace": ns, "generation": 1}
    pdd = parse_pddeployment(
        sim_manifest(
            "s", metadata=metadata, prefill={"instances": 1}, decode={"instances": 1, "dataParallel": 2}
        )
    )
    objects = render_all(pdd)
    pods = [o for o in objects if o["kind"] == "Pod"]
    create(kube_cluster, ns, *pods)
    observed = []
    for p in pods:
        name = p["metadata"]["name"]
        eventually(
            lambda n=name: condition(pod_json(kube_cluster, ns, n), "Ready") == "True",
            timeout=60,
            message=name,
        )
        role = Role(p["metadata"]["labels"]["pdserve.io/role"])
        ip = pod_json(kube_cluster, ns, name)["status"]["podIP"]
        observed.append(
            ObservedInstance(role, int(p["metadata"]["labels"]["pdserve.io/instance"]), name, ip, True)
        )
    table = build_routing_table(pdd, observed, None)
    rest = [o for o in render_all(pdd, table) if o["kind"] != "Pod"]
    create(kube_cluster, ns, *rest)

    def router_ip() -> str | None:
        listed = json.loads(
            kube_cluster.kubectl(
                "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=router", "-o", "json"
            ).stdout
        )["items"]
        ready = [p for p in listed if condition(p, "Ready") == "True"]
        return ready[0]["status"]["podIP"] if ready else None

    ip = eventually(router_ip, timeout=60, message="the router pod Ready")
    request = urllib.request.Request(
        f"http://{ip}:8000/v1/completions",
        data=json.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.loads(response.read())
    assert body["choices"][0]["text"] == " tok0 tok1 tok2 tok3"
    # The request went through both engines: one prefill leg, one decode leg, on the pods' own IPs.
    legs = {}
    for o in observed:
        _, stats = http("GET", f"http://{o.pod_ip}:8000/sim/stats")
        legs[o.role] = (stats["role"], stats["dp_size"], stats["by_leg"])
    assert legs[Role.PREFILL] == ("prefill", 1, {"prefill": 1, "decode": 0, "plain": 0})
    assert legs[Role.DECODE] == ("decode", 2, {"prefill": 0, "decode": 1, "plain": 0})
