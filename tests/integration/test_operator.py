"""The operator against the real control plane (kwok makes pods Running and Ready with IPs).

Each test runs ``pdserve operator --namespace <its namespace>`` as a subprocess, as users run it,
which also lets a test restart it. Rollouts are watched through the API (every version of every
pod and of the routing ConfigMap) and the rules are checked on that record, not on timings.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.kube import eventually
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    Recorder,
    instance_of,
    pdd_manifest,
    pod_ready,
    ready,
    routable,
    table_before,
    tables,
)

pytestmark = pytest.mark.cluster

# --- tests ---------------------------------------------------------------------------------------


def test_apply_renders_pods_table_status_and_printer_columns(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("demo", prefill_dp=2, decode_instances=2, decode_tp=2))
    eventually(lambda: ready(cluster, "demo"), timeout=WAIT, message="Ready=True")

    pods = {instance_of(p["metadata"]["name"]): p for p in cluster.pods("demo")}
    assert sorted(pods) == ["demo-decode-0", "demo-decode-1", "demo-prefill-0"]
    for instance, pod in pods.items():  # unique names: <instance>-<suffix>, the index a label
        assert pod["metadata"]["name"] != instance and instance_of(pod["metadata"]["name"]) == instance
        assert pod["metadata"]["labels"]["pdserve.io/instance"] == instance[-1]
        assert pod["spec"]["hostname"] == pod["metadata"]["name"].removeprefix("demo-")
    prefill = pods["demo-prefill-0"]["spec"]["containers"][0]
    argv = [*prefill.get("command", []), *prefill.get("args", [])]
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "2"
    decode = pods["demo-decode-0"]["spec"]["containers"][0]
    dargv = [*decode.get("command", []), *decode.get("args", [])]
    assert dargv[dargv.index("--tensor-parallel-size") + 1] == "2"
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == "2"
    for pod in pods.values():
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("PDDeployment", "demo", True)

    table = cluster.table("demo")
    assert table is not None
    ips = {name: p["status"]["podIP"] for name, p in pods.items()}
    names = {name: p["metadata"]["name"] for name, p in pods.items()}
    assert [(i.name, i.url, i.dp_size, i.routable) for i in table.prefill] == [
        (names["demo-prefill-0"], f"http://{ips['demo-prefill-0']}:8000", 2, True)
    ]
    assert [(i.name, i.url, i.routable) for i in table.decode] == [
        (names["demo-decode-0"], f"http://{ips['demo-decode-0']}:8000", True),
        (names["demo-decode-1"], f"http://{ips['demo-decode-1']}:8000", True),
    ]

    status = cluster.status("demo")
    assert status["observedGeneration"] == cluster.get("pdd", "demo")["metadata"]["generation"]  # type: ignore[index]
    assert status["routingGeneration"] == table.generation
    assert (status["prefill"]["slots"], status["prefill"]["readySlots"]) == (2, 2)
    assert (status["decode"]["readyInstances"], status["decode"]["summary"]) == (2, "2/2")
    assert status["decode"]["selector"] == "pdserve.io/deployment=demo,pdserve.io/role=decode"

    columns = cluster.kubectl("get", "pdd", "demo", "--no-headers").split()
    assert columns[:6] == ["demo", "True", "1/1", "2/2", "2", "2"]

    for kind, name in (("service", "demo"), ("service", "demo-engines"), ("deployment", "demo-router")):
        obj = cluster.get(kind, name)
        assert obj is not None, f"{kind} {name} missing"
        assert obj["metadata"]["ownerReferences"][0]["name"] == "demo"

    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=demo", "-o", "json")
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Created", "Ready"} <= reasons


def test_repeated_reconciles_change_nothing(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("idle"))
    eventually(lambda: ready(cluster, "idle"), timeout=WAIT, message="Ready=True")

    def versions() -> dict[str, str]:
        objs = [*cluster.pods("idle")]
        for kind, name in (
            ("configmap", "idle-routing"),
            ("pdd", "idle"),
            ("service", "idle"),
            ("deployment", "idle-router"),
            ("pdb", "idle-prefill"),
            ("pdb", "idle-decode"),
        ):
            obj = cluster.get(kind, name)
            assert obj is not None
            objs.append(obj)
        return {f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in objs}

    # Let the router's own status settle (its Deployment status is written by the controller-manager).
    eventually(lambda: (v := versions()) == versions() and v, timeout=WAIT, message="quiet cluster")
    before = versions()
    reconciles = operator.metric("pdserve_operator_reconciles_total")
    eventually(
        lambda: operator.metric("pdserve_operator_reconciles_total") >= reconciles + 3,
        timeout=WAIT,
        message="three resyncs",
    )
    assert versions() == before


def test_unready_pod_leaves_the_table_and_comes_back(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("flaky", decode_instances=2))
    eventually(lambda: ready(cluster, "flaky"), timeout=WAIT, message="Ready=True")
    generation = cluster.table("flaky").generation  # type: ignore[union-attr]
    flaky_1 = cluster.instance_name("flaky-decode-1")

    def set_ready(value: str) -> None:
        patch = {"status": {"conditions": [{"type": "Ready", "status": value}]}}
        cluster.kubectl("patch", "pod", flaky_1, "--subresource=status", "-p", json.dumps(patch))

    set_ready("False")
    eventually(
        lambda: routable(cluster.table("flaky"), "decode") == ["flaky-decode-0"],
        timeout=WAIT,
        message="decode-1 out of the table",
    )
    out = cluster.table("flaky")
    assert out is not None and out.generation > generation
    assert [(instance_of(i.name), i.ready) for i in out.decode] == [
        ("flaky-decode-0", True),
        ("flaky-decode-1", False),
    ]
    eventually(
        lambda: cluster.status("flaky")["decode"]["readyInstances"] == 1, timeout=WAIT, message="status"
    )
    assert cluster.condition("flaky", "Ready")["status"] == "False"

    set_ready("True")
    eventually(
        lambda: routable(cluster.table("flaky"), "decode") == ["flaky-decode-0", "flaky-decode-1"],
        timeout=WAIT,
        message="decode-1 back in the table",
    )
    eventually(lambda: ready(cluster, "flaky"), timeout=WAIT, message="Ready again")


def test_deleted_pod_is_recreated(operator: Operator, cluster: Cluster, recorder: Recorder) -> None:
    cluster.apply(pdd_manifest("phoenix", decode_instances=2))
    eventually(lambda: ready(cluster, "phoenix"), timeout=WAIT, message="Ready=True")
    old_uid = cluster.instance("phoenix-decode-0")["metadata"]["uid"]  # type: ignore[index]
    cluster.kubectl("delete", "pod", cluster.instance_name("phoenix-decode-0"), "--wait=false")

    def recreated() -> bool:
        pod = cluster.instance("phoenix-decode-0")
        return bool(pod and pod["metadata"]["uid"] != old_uid and pod_ready(pod))

    eventually(recreated, timeout=WAIT, message="a new phoenix-decode-0, Ready")
    eventually(
        lambda: routable(cluster.table("phoenix"), "decode") == ["phoenix-decode-0", "phoenix-decode-1"],
        timeout=WAIT,
        message="the new pod in the table",
    )
    records = recorder.stop()
    # Between the deletion and the new pod's readiness, some table showed decode-0 not routable.
    assert any(
        "phoenix-decode-0" not in routable(t, "decode") for _, t in tables(records) if routable(t, "decode")
    )


def test_kubectl_scale_changes_decode_instances(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    cluster.apply(pdd_manifest("elastic", decode_instances=2))
    eventually(lambda: ready(cluster, "elastic"), timeout=WAIT, message="Ready=True")

    cluster.kubectl("scale", "pdd", "elastic", "--replicas", "3")
    eventually(
        lambda: routable(cluster.table("elastic"), "decode") == [f"elastic-decode-{i}" for i in range(3)],
        timeout=WAIT,
        message="three decode instances routable",
    )
    eventually(lambda: ready(cluster, "elastic"), timeout=WAIT, message="Ready at 3")
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/pdserve.io/v1alpha1/namespaces/{cluster.ns}/pddeployments/elastic/scale"
        )
    )
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "pdserve.io/deployment=elastic,pdserve.io/role=decode"

    cluster.kubectl("scale", "pdd", "elastic", "--replicas", "1")
    eventually(
        lambda: (
            [
                instance_of(p["metadata"]["name"])
                for p in cluster.pods("elastic")
                if "decode" in p["metadata"]["name"]
            ]
            == ["elastic-decode-0"]
        ),
        timeout=WAIT,
        message="scaled down to one decode pod",
    )
    eventually(lambda: ready(cluster, "elastic"), timeout=WAIT, message="Ready at 1")
    records = recorder.stop()
    # Highest index first, each drained (marked in the table) before its deletion.
    deletions = [
        r
        for r in records
        if r.kind == "pod" and r.type == "MODIFIED" and r.obj["metadata"].get("deletionTimestamp")
    ]
    first: dict[str, int] = {}
    for r in deletions:
        first.setdefault(r.name, r.seq)
    assert [instance_of(n) for n in sorted(first, key=first.__getitem__)] == [
        "elastic-decode-2",
        "elastic-decode-1",
    ]
    for name, seq in first.items():
        table = table_before(records, seq)
        assert table is not None
        entry = {i.name: i for i in table.decode}[name]
        assert entry.draining, f"{name} deleted without being drained first"


def test_template_change_surges_one_instance_at_a_time(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    cluster.apply(pdd_manifest("roll", decode_instances=3))
    eventually(lambda: ready(cluster, "roll"), timeout=WAIT, message="Ready=True")
    prefill_uid = cluster.instance("roll-prefill-0")["metadata"]["uid"]  # type: ignore[index]
    old_hash = cluster.status("roll")["decode"]["templateHash"]
    start = len(recorder.records)

    cluster.apply(pdd_manifest("roll", decode_instances=3, decode_args=["--max-num-seqs", "64"]))

    def rolled() -> bool:
        pods = [p for p in cluster.pods("roll") if p["metadata"]["labels"]["pdserve.io/role"] == "decode"]
        hashes = {p["metadata"]["labels"]["pdserve.io/template-hash"] for p in pods}
        return (
            len(pods) == 3
            and old_hash not in hashes
            and all(pod_ready(p) for p in pods)
            and ready(cluster, "roll")
        )

    eventually(rolled, timeout=90, message="decode rolled to the new template")
    everything = recorder.stop()
    records = everything[start:]

    # Every pod deletion came after a table that marked it draining.
    deleted: dict[str, int] = {}
    for r in records:
        if r.kind == "pod" and r.obj["metadata"].get("deletionTimestamp"):
            deleted.setdefault(r.name, r.seq)
    assert sorted(instance_of(n) for n in deleted) == ["roll-decode-0", "roll-decode-1", "roll-decode-2"]
    for name, seq in deleted.items():
        table = table_before(records, seq)
        assert table is not None and {i.name: i for i in table.decode}[name].draining, name
    # Surge (maxSurge 1): the replacement is Ready before the old pod is drained, so every table
    # routes all three decode instances, each index once; at most 3 + 1 decode pods live at once.
    for _, table in tables(records):
        assert sorted(routable(table, "decode")) == ["roll-decode-0", "roll-decode-1", "roll-decode-2"], table
        assert routable(table, "prefill") == ["roll-prefill-0"]
    live: set[str] = set()
    for r in everything:
        if r.kind != "pod" or "-decode-" not in r.name:
            continue
        if r.type == "DELETED" or r.obj["metadata"].get("deletionTimestamp"):
            live.discard(r.name)
        else:
            live.add(r.name)
        assert len(live) <= 4, live
    # One replacement at a time, highest index first.
    order = [instance_of(n) for n in sorted(deleted, key=deleted.__getitem__)]
    assert order == ["roll-decode-2", "roll-decode-1", "roll-decode-0"]
    # The prefill pod was never touched.
    assert cluster.instance("roll-prefill-0")["metadata"]["uid"] == prefill_uid  # type: ignore[index]
    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=roll", "-o", "json")
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert reasons.count("Draining") >= 3 and reasons.count("Deleted") >= 3


def test_data_parallel_change_advertises_each_pods_own_size(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    """DP2 -> DP4: while old pods serve, the table must say 2 for them (ranks 2-3 would be refused)."""
    cluster.apply(pdd_manifest("regrow", prefill_instances=2, prefill_dp=2))
    eventually(lambda: ready(cluster, "regrow"), timeout=WAIT, message="Ready=True")
    start = len(recorder.records)
    cluster.apply(pdd_manifest("regrow", prefill_instances=2, prefill_dp=4))

    def rolled() -> bool:
        pods = [p for p in cluster.pods("regrow") if p["metadata"]["labels"]["pdserve.io/role"] == "prefill"]
        return (
            len(pods) == 2
            and all(p["metadata"]["annotations"]["pdserve.io/dp-size"] == "4" for p in pods)
            and ready(cluster, "regrow")
        )

    eventually(rolled, timeout=90, message="prefill rolled to DP4")
    records = recorder.stop()

    def created_with(pod: dict[str, Any]) -> int:
        container = pod["spec"]["containers"][0]
        args = container["args"]
        from_args = int(args[args.index("--data-parallel-size") + 1])
        assert pod["metadata"]["annotations"]["pdserve.io/dp-size"] == str(from_args)
        return from_args

    mixed = False  # a table listing an old DP2 pod next to a new DP4 one
    for seq, table in tables(records[start:]):
        routable_sizes = []
        for entry in table.prefill:
            ip = entry.url.removeprefix("http://").rsplit(":", 1)[0]
            versions = [
                r.obj
                for r in records
                if r.kind == "pod"
                and r.seq < seq
                and r.name == entry.name
                and (r.obj.get("status") or {}).get("podIP") == ip
            ]
            assert versions, f"table at {seq} lists {entry.name} at {ip}, a pod never seen"
            assert entry.dp_size == created_with(versions[-1]), (seq, entry)
            if entry.routable:
                routable_sizes.append(entry.dp_size)
        mixed = mixed or {i.dp_size for i in table.prefill} == {2, 4}
        assert routable_sizes, f"no routable prefill instance in the table at {seq}"
    assert mixed, "no table listed an old DP2 and a new DP4 pod side by side"
    status = cluster.status("regrow")
    assert (status["prefill"]["slots"], status["prefill"]["readySlots"]) == (8, 8)


def test_restart_mid_rollout_creates_no_duplicate_and_finishes(
    operator: Operator, cluster: Cluster, recorder: Recorder
) -> None:
    # A router that never answers keeps each drain for its 3 s bound: long enough to restart in.
    cluster.apply(pdd_manifest("phoenix2", decode_instances=3, drain_seconds=3, silent_router=True))
    eventually(lambda: ready(cluster, "phoenix2"), timeout=WAIT, message="Ready=True")
    old_hash = cluster.status("phoenix2")["decode"]["templateHash"]
    start = len(recorder.records)
    cluster.apply(
        pdd_manifest(
            "phoenix2",
            decode_instances=3,
            drain_seconds=3,
            decode_args=["--max-num-seqs", "8"],
            silent_router=True,
        )
    )

    def draining() -> bool:
        return any(
            instance_of(p["metadata"]["name"]) == "phoenix2-decode-2"
            and "pdserve.io/draining-since" in (p["metadata"].get("annotations") or {})
            for p in cluster.pods("phoenix2")
        )

    eventually(draining, timeout=WAIT, message="the first drain")
    assert operator.stop() == 0  # graceful on SIGTERM
    operator.start()

    def rolled() -> bool:
        pods = [p for p in cluster.pods("phoenix2") if p["metadata"]["labels"]["pdserve.io/role"] == "decode"]
        hashes = {p["metadata"]["labels"]["pdserve.io/template-hash"] for p in pods}
        return len(pods) == 3 and old_hash not in hashes and ready(cluster, "phoenix2")

    eventually(rolled, timeout=90, message="the rollout finished after the restart")
    records = recorder.stop()[start:]
    created = [r.name for r in records if r.kind == "pod" and r.type == "ADDED"]
    # Each decode index replaced exactly once: no duplicate create, no second replacement.
    assert sorted(instance_of(n) for n in created) == [
        "phoenix2-decode-0",
        "phoenix2-decode-1",
        "phoenix2-decode-2",
    ]
    for _, table in tables(records):
        assert len(routable(table, "decode")) == 3


def test_deleting_the_pddeployment_removes_everything(operator: Operator, cluster: Cluster) -> None:
    cluster.apply(pdd_manifest("gone"))
    eventually(lambda: ready(cluster, "gone"), timeout=WAIT, message="Ready=True")
    cluster.kubectl("delete", "pdd", "gone", "--wait=false")

    def nothing_left() -> bool:
        out = cluster.kubectl(
            "get",
            "pods,services,deployments,replicasets,configmaps,poddisruptionbudgets",
            "-l",
            "pdserve.io/deployment=gone",
            "-o",
            "name",
        )
        return out.strip() == ""

    eventually(nothing_left, timeout=WAIT, message="garbage collection of every owned object")
    assert cluster.get("pdd", "gone") is None


def test_spec_beyond_any_node_is_degraded_and_renders_nothing(operator: Operator, cluster: Cluster) -> None:
    # 12 ranks on the nodes' 8 GPUs: a group's pods must hold 8 ranks each, 12 does not divide.
    manifest = pdd_manifest("huge", prefill_dp=12)
    cluster.apply(manifest)

    def degraded() -> dict[str, Any]:
        c = cluster.condition("huge", "Degraded")
        return c if c.get("status") == "True" else {}

    condition = degraded() or eventually(degraded, timeout=WAIT, message="Degraded=True")
    assert condition["reason"] == "InvalidSpec"
    message = condition["message"]
    assert "spec.prefill.dataParallel" in message and "gpusPerNode 8" in message, message
    assert cluster.condition("huge", "Ready")["status"] == "False"
    out = cluster.kubectl(
        "get", "pods,services,deployments,configmaps", "-l", "pdserve.io/deployment=huge", "-o", "name"
    )
    assert out.strip() == ""
    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=huge", "-o", "json")
    assert any(
        e["type"] == "Warning" and "spec.prefill.dataParallel" in e["message"]
        for e in json.loads(events)["items"]
    )

    # Fixing the spec renders it.
    cluster.apply(pdd_manifest("huge", prefill_dp=8))
    eventually(lambda: ready(cluster, "huge"), timeout=WAIT, message="Ready once fixed")
    assert cluster.condition("huge", "Degraded")["status"] == "False"
