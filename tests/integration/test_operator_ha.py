"""Two operator replicas against the real API server: one leads through a Lease, the other takes over.

Each test runs two ``pdserve operator`` processes for its namespace, electing through the Lease
``pdserve-operator`` in that namespace (tests/support/operator.py). Leadership is read both ways:
the ``pdserve_operator_leader`` gauge of each process and the Lease's ``holderIdentity``.

* SIGTERM to the leader releases the Lease: the follower leads within a retry period or two.
* SIGKILL to the leader mid-rollout: the follower takes over once the Lease has gone unrenewed
  for its duration and finishes the rollout: every instance on the new template, never two live
  pods for one (role, instance), every pod it deletes drained first (annotated, and marked
  draining in a routing table written before the deletion).
* SIGSTOP past the lease duration: the follower takes over; the stale leader, resumed, writes
  nothing (its fence refuses) and exits 1.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.operator.cluster.kube import Kube, NotLeader
from pdserve.operator.control.leader import ElectionConfig, LeaderElector
from tests.support.kube import KubeCluster, eventually
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    Record,
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

LEASE = "pdserve-operator"
DRAINING = "pdserve.io/draining-since"


@pytest.fixture
def replicas(pdd_crd: KubeCluster, kube_namespace: str, tmp_path: Path) -> Iterator[list[Operator]]:
    """Two operators, not started; whatever still runs at the end is stopped (SIGCONT, SIGKILL)."""
    ops = [
        Operator(pdd_crd.kubeconfig, kube_namespace, tmp_path / f"operator-{n}.log", pod_name=f"op-{n}")
        for n in ("a", "b")
    ]
    try:
        yield ops
    finally:
        for op in ops:
            if op.proc is not None and op.proc.poll() is None:
                op.proc.send_signal(signal.SIGCONT)
                op.proc.kill()
                op.proc.wait(10)


def lease(cluster: Cluster) -> dict[str, Any]:
    obj = cluster.get("lease", LEASE)
    return dict((obj or {}).get("spec") or {})


def leader_gauge(op: Operator) -> tuple[str, float]:
    """(identity, value) of this process's ``pdserve_operator_leader``."""
    ((line, value),) = op.samples("pdserve_operator_leader{").items()
    found = re.search(r'identity="([^"]+)"', line)
    assert found, line
    return found.group(1), value


def leads(op: Operator, cluster: Cluster) -> str | None:
    """The identity of ``op`` if the gauge and the Lease both say it leads."""
    identity, value = leader_gauge(op)
    return identity if value == 1.0 and lease(cluster).get("holderIdentity") == identity else None


def start_pair(ops: list[Operator], cluster: Cluster) -> tuple[Operator, Operator, str]:
    """Start a, wait until it leads, then b (so the roles are known); returns (leader, follower, id)."""
    a, b = ops
    a.start()
    identity = eventually(lambda: leads(a, cluster), timeout=WAIT, message="a leads")
    b.start()
    b.wait_logged("following: the leader lease", "b follows", timeout=WAIT)
    assert leader_gauge(b)[1] == 0.0 and lease(cluster)["holderIdentity"] == identity
    return a, b, identity


def test_one_replica_leads_and_sigterm_hands_over_at_once(replicas: list[Operator], cluster: Cluster) -> None:
    leader, follower, identity = start_pair(replicas, cluster)
    assert identity.startswith("op-a_")
    cluster.apply(pdd_manifest("ha", decode_instances=2))
    eventually(lambda: ready(cluster, "ha"), timeout=WAIT, message="Ready=True")
    assert follower.metric("pdserve_operator_reconciles_total") == 0, "a follower must not reconcile"
    assert leader.metric("pdserve_operator_reconciles_total") > 0
    transitions = int(lease(cluster).get("leaseTransitions") or 0)

    stopped = time.monotonic()
    assert leader.stop() == 0  # graceful: releases the Lease
    new = eventually(lambda: leads(follower, cluster), timeout=WAIT, message="b leads")
    took = time.monotonic() - stopped
    print(f"takeover after SIGTERM: {took:.1f} s")
    assert new.startswith("op-b_")
    # Released, so no wait for expiry: the next acquisition attempt (retry 2 s, jitter up to 4.4 s).
    assert took < 8.0, took
    spec = lease(cluster)
    assert spec["leaseTransitions"] == transitions + 1 and spec["leaseDurationSeconds"] == 15
    assert follower.metric("pdserve_operator_leader_transitions_total") >= 1
    assert "released the leader lease" in leader.log_path.read_text()
    # The new leader reconciles: a change made now is applied.
    cluster.apply(pdd_manifest("ha", decode_instances=3))
    eventually(lambda: len(cluster.pods("ha")) == 4 and ready(cluster, "ha"), timeout=WAIT, message="scaled")


def live_claims(records: list[Record], per_revision: bool) -> None:
    """Replaying the pod watch in etcd order, among pods alive and not terminating: one per
    (role, instance), or with surge one per (role, instance, template hash) and two per instance."""
    live: dict[str, tuple[str, str, str]] = {}  # uid -> (role, instance, template hash)
    for r in sorted((r for r in records if r.kind == "pod"), key=lambda r: r.seq):
        meta = r.obj["metadata"]
        labels = meta.get("labels") or {}
        if "pdserve.io/role" not in labels:
            continue
        if r.type == "DELETED" or meta.get("deletionTimestamp"):
            live.pop(meta["uid"], None)
        else:
            live[meta["uid"]] = (
                labels["pdserve.io/role"],
                labels["pdserve.io/instance"],
                labels["pdserve.io/template-hash"],
            )
        claims = list(live.values())
        instances = [c[:2] for c in claims]
        if per_revision:
            assert len(claims) == len(set(claims)), f"two live pods of one revision at {r.seq}: {claims}"
            assert all(instances.count(i) <= 2 for i in instances), f"more than one surge pod: {claims}"
        else:
            assert len(instances) == len(set(instances)), (
                f"two live pods for one instance at {r.seq}: {claims}"
            )


def deletions_were_drained(records: list[Record]) -> dict[str, int]:
    """Every pod deletion: the pod carried the draining annotation, and a table before it marked it
    draining. Returns pod name -> seq of its deletion."""
    deleted: dict[str, int] = {}
    for r in sorted((r for r in records if r.kind == "pod"), key=lambda r: r.seq):
        if not r.obj["metadata"].get("deletionTimestamp") or r.name in deleted:
            continue
        deleted[r.name] = r.seq
        assert DRAINING in (r.obj["metadata"].get("annotations") or {}), f"{r.name} deleted undrained"
        table = table_before(records, r.seq)
        assert table is not None and {i.name: i for i in table.decode}[r.name].draining, r.name
    return deleted


def decode_pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(name) if p["metadata"]["labels"]["pdserve.io/role"] == "decode"]


def rolled(cluster: Cluster, name: str, instances: int, old_hash: str) -> bool:
    pods = decode_pods(cluster, name)
    hashes = {p["metadata"]["labels"]["pdserve.io/template-hash"] for p in pods}
    return (
        len(pods) == instances
        and old_hash not in hashes
        and all(map(pod_ready, pods))
        and ready(cluster, name)
    )


@pytest.mark.parametrize("surge", [0, 1], ids=["in-place", "surge"])
def test_sigkill_of_the_leader_mid_rollout_the_follower_finishes_it(
    replicas: list[Operator], cluster: Cluster, recorder: Recorder, surge: int
) -> None:
    """The issue's test: no duplicate pods, no lost drain, every instance on the new template."""
    leader, follower, identity = start_pair(replicas, cluster)
    # A router that never answers holds each drain for drainSeconds: the rollout of 4 decode
    # instances takes over 20 s, and the leader dies in the middle of it.
    spec: dict[str, Any] = {
        "decode_instances": 4,
        "drain_seconds": 5,
        "silent_router": True,
        "max_surge": surge,
    }
    cluster.apply(pdd_manifest("phoenix", **spec))
    eventually(lambda: ready(cluster, "phoenix"), timeout=WAIT, message="Ready=True")
    old_hash = cluster.status("phoenix")["decode"]["templateHash"]
    start = len(recorder.records)
    cluster.apply(pdd_manifest("phoenix", decode_args=["--max-num-seqs", "8"], **spec))

    def second_drain() -> bool:
        """Instance 3 replaced (its old pod gone) and instance 2's old pod draining: mid-way."""
        pods = decode_pods(cluster, "phoenix")
        old = {
            instance_of(p["metadata"]["name"]): p
            for p in pods
            if p["metadata"]["labels"]["pdserve.io/template-hash"] == old_hash
        }
        two = old.get("phoenix-decode-2")
        return (
            "phoenix-decode-3" not in old
            and two is not None
            and DRAINING in (two["metadata"].get("annotations") or {})
        )

    eventually(second_drain, timeout=WAIT, interval=0.1, message="the second drain of the rollout")
    assert leader.proc is not None
    leader.proc.kill()
    killed = time.monotonic()
    assert leader.proc.wait(10) == -signal.SIGKILL

    new = eventually(lambda: leads(follower, cluster), timeout=40, interval=0.2, message="b leads")
    took = time.monotonic() - killed
    print(f"takeover after SIGKILL (maxSurge {surge}): {took:.1f} s (lease duration 15 s)")
    # Not before the lease expired on b's clock (15 s after it last saw a renewal, which came
    # at most one retry period before the kill), and within that plus b's jittered retry.
    assert 12.0 <= took <= 15.0 + 2.0 + 4.4 + 2.0, took
    assert new != identity and lease(cluster)["leaseTransitions"] >= 1

    eventually(lambda: rolled(cluster, "phoenix", 4, old_hash), timeout=120, message="the follower finished")
    time.sleep(1.0)  # the last watch events
    records = recorder.stop()[start:]

    live_claims(records, per_revision=bool(surge))
    deleted = deletions_were_drained(records)
    instances = [f"phoenix-decode-{i}" for i in range(4)]
    assert sorted(instance_of(n) for n in deleted) == instances, "each old pod deleted once, drained"
    created = [r.name for r in records if r.kind == "pod" and r.type == "ADDED"]
    assert sorted(instance_of(n) for n in created) == instances, "each instance replaced exactly once"
    for _, table in tables(records):
        assert len(routable(table, "decode")) >= 4 - (0 if surge else 1), table
    assert "became leader" in follower.log_path.read_text()


def operator_writes(cluster: Cluster, name: str) -> dict[str, str]:
    """resourceVersion of everything the operator writes for ``name``, and its Events."""
    versions = {f"pod/{p['metadata']['name']}": p["metadata"]["resourceVersion"] for p in cluster.pods(name)}
    for kind, obj_name in (("configmap", f"{name}-routing"), ("pdd", name), ("deployment", f"{name}-router")):
        obj = cluster.get(kind, obj_name)
        assert obj is not None
        versions[f"{kind}/{obj_name}"] = obj["metadata"]["resourceVersion"]
    events = json.loads(cluster.kubectl("get", "events", "-o", "json"))["items"]
    versions["events"] = str(len([e for e in events if e.get("reportingComponent") == "pdserve-operator"]))
    return versions


def test_a_stale_leader_resumed_after_takeover_writes_nothing_and_exits(
    replicas: list[Operator], cluster: Cluster
) -> None:
    timings = ["--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1"]
    for op in replicas:
        op.extra_args = timings
    stale, follower, identity = start_pair(replicas, cluster)
    spec: dict[str, Any] = {"decode_instances": 3, "drain_seconds": 3, "silent_router": True}
    cluster.apply(pdd_manifest("stale", **spec))
    eventually(lambda: ready(cluster, "stale"), timeout=WAIT, message="Ready=True")
    old_hash = cluster.status("stale")["decode"]["templateHash"]
    cluster.apply(pdd_manifest("stale", decode_args=["--max-num-seqs", "8"], **spec))

    def draining() -> bool:
        return any(
            DRAINING in (p["metadata"].get("annotations") or {}) for p in decode_pods(cluster, "stale")
        )

    eventually(draining, timeout=WAIT, message="the first drain")
    assert stale.proc is not None
    stale.proc.send_signal(signal.SIGSTOP)  # mid-drain, with a drain deadline and rechecks pending
    eventually(lambda: leads(follower, cluster), timeout=30, interval=0.2, message="b takes over")

    eventually(lambda: rolled(cluster, "stale", 3, old_hash), timeout=90, message="b finished the rollout")
    # Quiet: nothing the operator writes changes any more.
    eventually(
        lambda: (v := operator_writes(cluster, "stale")) == operator_writes(cluster, "stale") and v,
        timeout=WAIT,
        message="a quiet cluster",
    )
    before = operator_writes(cluster, "stale")
    holder = lease(cluster)["holderIdentity"]

    stale.proc.send_signal(signal.SIGCONT)
    code = stale.proc.wait(15)
    assert code == 1, f"a stale leader exits 1, got {code}:\n{stale.log()}"
    time.sleep(2.0)
    assert operator_writes(cluster, "stale") == before, "the stale leader wrote after it resumed"
    assert lease(cluster)["holderIdentity"] == holder != identity
    log = stale.log_path.read_text()
    assert "lost leadership" in log
    refused = [line for line in log.splitlines() if "refused, not the leader" in line]
    print(f"stale leader: {len(refused)} writes refused by the fence after SIGCONT")


class Clock:
    """A monotonic clock the test can jump forward: a pause (SIGSTOP, GC) as the process sees it."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew


def test_the_fence_refuses_a_write_after_a_pause_and_nothing_reaches_the_api_server(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    """In process, against the API server: the elector and a fenced Kube, as the operator wires them."""
    clock = Clock()
    config = ElectionConfig(kube_namespace, "pdserve-fence", "fence-test_1", 6, 4.0, 1.0)
    elector = LeaderElector(config, Kube(str(kube_cluster.kubeconfig), pool_size=2), clock=clock)
    kube = Kube(str(kube_cluster.kubeconfig), fence=elector.refusal)
    started, stopped = threading.Event(), threading.Event()
    reasons: list[str] = []
    with pytest.raises(NotLeader, match="does not hold the leader lease"):
        kube.create(configmap(kube_namespace, "before"))
    elector.start(on_started=started.set, on_stopped=lambda why: (reasons.append(why), stopped.set()))
    try:
        assert started.wait(10), "no leadership on a fresh Lease"
        kube.create(configmap(kube_namespace, "leading"))  # goes through
        clock.skew = 30.0  # the process was paused for 30 s
        with pytest.raises(NotLeader, match="refused, not the leader"):
            kube.create(configmap(kube_namespace, "stale"))
        assert stopped.wait(5), "the elector did not notice the lost lease"
        assert "renew deadline" in reasons[0]
        names = {c["metadata"]["name"] for c in kube.list_objects("ConfigMap", kube_namespace, "test=fence")}
        assert names == {"leading"}, names
    finally:
        elector.release()
        kube.close()


def configmap(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"test": "fence"}},
        "data": {},
    }
