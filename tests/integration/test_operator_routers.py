"""The operator and its routers: the router's RBAC as rendered, drains that end on what the
routers say (or at the bound), and a real `pdserve proxy` reading the table with the operator's
RBAC and answering the format the operator parses.

In the kwok test cluster the router pods are Ready but nothing answers at their IP, so every
drain here ends by ``timeout`` (drainSeconds 1); the real router runs as a local process with a
TokenRequest token of the ServiceAccount the operator created.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.plan.drain import DrainReason, drain_verdict
from pdserve.operator.dataplane.routers import fetch_reports
from tests.support.kube import eventually, kubectl_for, router_kubeconfig
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    events,
    instance_of,
    pdd_manifest,
    ready,
)
from tests.support.pdstack import HttpAnswer, configmap_proxy_args, http
from tests.support.procs import ProcessGroup, free_port, wait_http

pytestmark = pytest.mark.cluster


def can_i(on: Cluster, account: str, *what: str) -> str:
    """``kubectl auth can-i`` as the router's ServiceAccount: "yes" or "no"."""
    subject = f"system:serviceaccount:{on.ns}:{account}"
    out = on.kube.kubectl("auth", "can-i", *what, "-n", on.ns, "--as", subject, check=False)
    return out.stdout.strip()


def router_pod_address(cluster: Cluster, deployment: str) -> tuple[str, dict[str, int]]:
    """The IP and named ports of the deployment's one router pod, where a test runs a real router
    in its place; skips unless the IP is on loopback (the kwok test cluster)."""
    selector = f"pdserve.io/deployment={deployment},app.kubernetes.io/component=router"
    (pod,) = json.loads(cluster.kubectl("get", "pods", "-o", "json", "-l", selector))["items"]
    ip = pod["status"]["podIP"]
    if not ip.startswith("127."):
        pytest.skip(f"router pod IP {ip} is not on loopback (not the kwok test cluster)")
    return ip, {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}


def test_the_router_may_read_its_routing_configmap_and_nothing_else(
    operator: Operator,
    cluster: Cluster,
) -> None:
    cluster.apply(pdd_manifest("rbac"))
    eventually(lambda: ready(cluster, "rbac"), timeout=WAIT, message="Ready=True")
    for kind in ("serviceaccount", "role", "rolebinding"):
        obj = cluster.get(kind, "rbac-router")
        assert obj is not None, kind
        assert obj["metadata"]["ownerReferences"][0]["name"] == "rbac"  # garbage-collected with it
    account = "rbac-router"
    assert can_i(cluster, account, "get", "configmap/rbac-routing") == "yes"
    assert can_i(cluster, account, "watch", "configmap/rbac-routing") == "yes"
    assert can_i(cluster, account, "list", "configmap/rbac-routing") == "yes"
    assert can_i(cluster, account, "get", "configmap/other-routing") == "no"
    assert can_i(cluster, account, "list", "configmaps") == "no"  # only by name
    assert can_i(cluster, account, "update", "configmap/rbac-routing") == "no"
    assert can_i(cluster, account, "get", "secrets") == "no"
    assert can_i(cluster, account, "get", "pods") == "no"

    router = cluster.get("deployment", "rbac-router")
    assert router is not None
    pod = router["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("rbac-router", True)
    args = pod["containers"][0]["args"]
    assert args[args.index("--routing-configmap") + 1] == "$(POD_NAMESPACE)/rbac-routing"


def test_a_drain_ends_at_the_bound_when_the_routers_do_not_answer_and_says_so(
    operator: Operator,
    cluster: Cluster,
) -> None:
    cluster.apply(pdd_manifest("roll", drain_seconds=1, silent_router=True))
    eventually(lambda: ready(cluster, "roll"), timeout=WAIT, message="Ready=True")
    eventually(lambda: cluster.status("roll").get("routers", {}).get("ready") == 1, timeout=WAIT)
    status = cluster.status("roll")
    # The kwok router pod is Ready but does not answer: not current, nothing served.
    assert status["routers"] == {"ready": 1, "current": 0, "summary": "0/1"}
    assert "servedGeneration" not in status
    columns = cluster.kubectl("get", "pdd", "roll", "--no-headers").split()
    assert columns[6] == "0/1"  # the Routers column

    old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("roll")}
    cluster.apply(
        pdd_manifest("roll", drain_seconds=1, decode_args=["--max-num-seqs", "64"], silent_router=True)
    )
    drained = eventually(lambda: events(cluster, "roll", "Drained"), timeout=WAIT, message="a Drained Event")
    assert any(
        re.match(r"Pod roll-decode-1-\w{5} drained: timeout, 1 router \(roll-router-", m)
        and "unreachable" in m
        for m in drained
    ), drained
    assert any("left the table at generation" in m for m in drained), drained
    assert operator.metric('pdserve_operator_drains_total{reason="timeout"}') >= 1
    assert operator.metric('pdserve_operator_router_queries_total{outcome="error"}') >= 1

    def replaced() -> bool:
        decode = [p for p in cluster.pods("roll") if "-decode-" in p["metadata"]["name"]]
        return len(decode) == 2 and not any(p["metadata"]["uid"] in old.values() for p in decode)

    eventually(replaced, timeout=WAIT, message="every decode pod replaced")
    eventually(lambda: ready(cluster, "roll"), timeout=WAIT, message="Ready again")


def test_without_a_ready_router_a_drain_ends_at_once(
    operator: Operator,
    cluster: Cluster,
) -> None:
    """No router pod, nobody can send the pod work: no-routers, long before drainSeconds (600)."""
    manifest = pdd_manifest("bare", drain_seconds=600)
    manifest["spec"]["router"] = {"replicas": 0}
    cluster.apply(manifest)
    eventually(lambda: ready(cluster, "bare"), timeout=WAIT, message="Ready=True")
    shrunk = pdd_manifest("bare", decode_instances=1, drain_seconds=600)
    shrunk["spec"]["router"] = {"replicas": 0}
    cluster.apply(shrunk)
    drained = eventually(lambda: events(cluster, "bare", "Drained"), timeout=WAIT, message="Drained")
    assert re.match(r"Pod bare-decode-1-\w{5} drained: no-routers, 0 routers", drained[0]), drained
    assert operator.metric('pdserve_operator_drains_total{reason="no-routers"}') == 1
    assert cluster.status("bare")["routers"] == {"ready": 0, "current": 0, "summary": "0/0"}


def test_a_real_router_reads_the_table_with_the_operators_rbac_and_reports_it(
    operator: Operator,
    cluster: Cluster,
    tmp_path: Path,
) -> None:
    cluster.apply(pdd_manifest("live", decode_instances=2))
    eventually(lambda: ready(cluster, "live"), timeout=WAIT, message="Ready=True")
    written = cluster.status("live")["routingGeneration"]
    d1 = cluster.instance_name("live-decode-1")

    kubectl = kubectl_for(cluster.kube.kubeconfig)
    kubeconfig = router_kubeconfig(kubectl, cluster.ns, "live-router", tmp_path)
    group = ProcessGroup(tmp_path)
    try:
        proxy = group.start("router", configmap_proxy_args(f"{cluster.ns}/live-routing", kubeconfig))

        def serving() -> dict[str, Any] | None:
            doc: dict[str, Any] = http("GET", proxy.url + "/routing/served").json()
            return doc if doc["generation"] == written else None

        doc = eventually(serving, timeout=WAIT, message="the router serves the written generation")
        assert doc["deployment"] == "live" and doc["error"] is None
        (report,) = asyncio.run(fetch_reports([("router", "127.0.0.1")], proxy.port, "live", 5.0))
        assert (report.answered, report.generation) == (True, written)
        assert {instance_of(n) for n in report.routable} == {
            "live-prefill-0",
            "live-decode-0",
            "live-decode-1",
        }
        assert report.in_flight == dict.fromkeys(report.routable, 0)
        # A routable instance keeps its drain waiting; one the router no longer has may go.
        waiting = drain_verdict(d1, written, 0.0, 1.0, 30, [report])
        assert waiting.waiting_for == (f"router: still routes to {d1}",)
        gone = drain_verdict("live-decode-9", written, 0.0, 1.0, 30, [report])
        assert gone.reason is DrainReason.ROUTERS_IDLE
        assert drain_verdict("live-decode-9", written + 1, 0.0, 1.0, 30, [report]).done is False

        # Scale decode down: the operator drains decode-1 and writes it out of the table; the
        # real router follows through the watch and then reports nothing in flight to it.
        cluster.apply(pdd_manifest("live", decode_instances=1))

        def without_decode_1() -> dict[str, Any] | None:
            doc: dict[str, Any] = http("GET", proxy.url + "/routing/served").json()
            row = doc["instances"].get(d1)
            return doc if row is None or not row["routable"] else None

        eventually(without_decode_1, timeout=WAIT, message="the router stops routing to decode-1")
        (report,) = asyncio.run(fetch_reports([("router", "127.0.0.1")], proxy.port, "live", 5.0))
        assert report.generation is not None and report.generation > written
        assert drain_verdict(d1, report.generation, 0.0, 1.0, 30, [report]).done
    finally:
        group.stop_all()


def test_a_drain_ends_as_soon_as_the_real_router_lets_go(
    operator: Operator,
    cluster: Cluster,
    tmp_path: Path,
) -> None:
    """A real `pdserve proxy` listens at the kwok router pod's own IP (loopback 127.128.x.y) and
    ports, with the operator's RBAC: the operator asks it, and the drain ends by routers-idle
    long before drainSeconds (600)."""
    cluster.apply(pdd_manifest("idle", decode_instances=2, drain_seconds=600, silent_router=True))
    eventually(lambda: ready(cluster, "idle"), timeout=WAIT, message="Ready=True")
    ip, ports = router_pod_address(cluster, "idle")
    kubectl = kubectl_for(cluster.kube.kubeconfig)
    kubeconfig = router_kubeconfig(kubectl, cluster.ns, "idle-router", tmp_path)
    group = ProcessGroup(tmp_path)
    try:
        admin = str(ports["admin"])
        args = configmap_proxy_args(f"{cluster.ns}/idle-routing", kubeconfig, "--admin-port", admin)
        args[args.index("--host") + 1] = ip
        group.start("router", args, port=ports["http"], health=None)
        written = cluster.status("idle")["routingGeneration"]
        d1 = cluster.instance_name("idle-decode-1")

        def current() -> bool:
            s = cluster.status("idle")
            return s.get("servedGeneration") == written and s.get("routers", {}).get("summary") == "1/1"

        eventually(current, timeout=WAIT, message="the operator sees the real router current")

        cluster.apply(pdd_manifest("idle", decode_instances=1, drain_seconds=600, silent_router=True))
        drained = eventually(lambda: events(cluster, "idle", "Drained"), timeout=WAIT, message="Drained")
        assert drained[0].startswith(
            f"Pod {d1} drained: routers-idle, 1 router, left the table at generation"
        )

        def decode_pods() -> list[str]:
            return [
                instance_of(p["metadata"]["name"])
                for p in cluster.pods("idle")
                if "decode" in p["metadata"]["name"]
            ]

        eventually(lambda: decode_pods() == ["idle-decode-0"], timeout=WAIT, message="decode-1 deleted")
        assert http("GET", f"http://{ip}:{admin}/routing/served").json()["instances"].get(d1) in (
            None,
            {"role": "decode", "in_table": False, "routable": False, "in_flight": 0},
        )
    finally:
        group.stop_all()


def test_a_drain_waits_for_the_stream_on_the_pod_then_ends_routers_idle(
    operator: Operator,
    cluster: Cluster,
    tmp_path: Path,
) -> None:
    """Real `pdserve sim` engines and a real router at the kwok pods' own IPs: a stream running on
    decode-1 when it starts draining keeps its pod alive, finishes whole, and then the drain ends
    by routers-idle (drainSeconds 600 is never reached)."""
    cluster.apply(pdd_manifest("busy", decode_instances=2, drain_seconds=600, silent_router=True))
    eventually(lambda: ready(cluster, "busy"), timeout=WAIT, message="Ready=True")
    pods = {p["metadata"]["name"]: p for p in cluster.pods("busy")}
    d1 = cluster.instance_name("busy-decode-1")
    router_ip, ports = router_pod_address(cluster, "busy")
    model = "Qwen/Qwen2.5-0.5B-Instruct"
    group = ProcessGroup(tmp_path)
    try:
        for name, pod in sorted(pods.items()):
            ip = pod["status"]["podIP"]
            role = pod["metadata"]["labels"]["pdserve.io/role"]
            timing = ["--ttft-ms", "2", "--itl-ms", "50", "--tokens", "120"]  # 6 s streams
            notes = pod["metadata"]["annotations"]
            args = ["sim", "--role", role, "--host", ip, "--model", model, "--instance-name", name]
            args += ["--dp-size", notes["pdserve.io/dp-size"], "--tp-size", notes["pdserve.io/tp-size"]]
            args += ["--kv-host", ip, "--kv-port", str(free_port()), *timing]
            group.start(name, args, port=8000, health=None)
        for pod in pods.values():
            wait_http(f"http://{pod['status']['podIP']}:8000/health", timeout=30)
        kubeconfig = router_kubeconfig(
            kubectl_for(cluster.kube.kubeconfig), cluster.ns, "busy-router", tmp_path
        )
        admin = str(ports["admin"])
        args = configmap_proxy_args(f"{cluster.ns}/busy-routing", kubeconfig, "--admin-port", admin)
        args[args.index("--host") + 1] = router_ip
        group.start("router", args, port=ports["http"], health=None)
        served_url = f"http://{router_ip}:{admin}/routing/served"
        eventually(lambda: http("GET", f"http://{router_ip}:{admin}/ready").status == 200, timeout=WAIT)

        answers: list[HttpAnswer] = []

        def stream() -> None:
            body = {"model": model, "prompt": "hello", "max_tokens": 120, "stream": True}
            answers.append(http("POST", f"http://{router_ip}:{ports['http']}/v1/completions", body))

        threads = [threading.Thread(target=stream) for _ in range(2)]  # one per decode slot
        for t in threads:
            t.start()

        def on_decode_1() -> bool:
            assert not answers, (
                f"a stream ended before the drain: {[(a.status, a.body[:200]) for a in answers]}"
            )
            row = http("GET", served_url).json()["instances"].get(d1) or {}
            return bool(row.get("in_flight"))

        eventually(on_decode_1, timeout=WAIT, message="a stream on decode-1")
        cluster.apply(pdd_manifest("busy", decode_instances=1, drain_seconds=600, silent_router=True))

        def drained_in_router() -> dict[str, Any] | None:
            row = http("GET", served_url).json()["instances"].get(d1) or {}
            return row if not row.get("routable") else None

        eventually(drained_in_router, timeout=WAIT, message="the router stops routing to decode-1")
        # Read the pod, then the router: a stream still counted after the read means it was
        # counted at the read too, and no drain can end while one is (only ever fewer now).
        checked = 0
        while True:
            pod = cluster.get("pod", d1)
            row = http("GET", served_url).json()["instances"].get(d1) or {}
            if not row.get("in_flight"):
                break
            assert pod is not None and not pod["metadata"].get("deletionTimestamp"), "deleted mid-stream"
            checked += 1
            time.sleep(0.2)
        assert checked > 0
        for t in threads:
            t.join(timeout=60)
        assert [a.status for a in answers] == [200, 200]
        assert all(a.body.rstrip().endswith(b"data: [DONE]") for a in answers), [
            a.body[-200:] for a in answers
        ]

        drained = eventually(lambda: events(cluster, "busy", "Drained"), timeout=WAIT, message="Drained")
        assert drained[0].startswith(f"Pod {d1} drained: routers-idle, 1 router"), drained
        assert operator.metric('pdserve_operator_drains_total{reason="routers-idle"}') == 1
    finally:
        group.stop_all()
