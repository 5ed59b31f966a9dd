"""Node faults on the real control plane: what tests/support/nodes.py does to a kwok node, and
what the node lifecycle controller and the API server then do, as the operator will see it.

Each test registers a GPU node of its own (``gpu_pool``) and deletes it afterwards: other tests
run on gpu-node-0..3 at the same time, and must never see those go NotReady. Losing a node
takes the node lifecycle controller's grace period (50 s) plus its monitor period; the figures
are printed (``-s``). Independent of the operator's rollout logic: the operator runs only to
show that its node watch sees the loss.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kube import REPO, KubeCluster, apply_objects, eventually, gpu_pool, router_kubeconfig
from tests.support.nodes import (
    UNREACHABLE_TAINT,
    delete_pod,
    evict,
    get_pod,
    node_lost,
    node_ready,
    node_watch,
    pinned_pod,
    pod_ready,
    taints,
    terminating,
)
from tests.support.operator import Operator
from tests.support.procs import running

pytestmark = pytest.mark.cluster

#: Set to a file name to record the node's watch events as a unit-test fixture
#: (tests/fixtures/nodes/kwok-node-lost.json was recorded so).
RECORD = os.environ.get("PDSERVE_RECORD_NODE_EVENTS")


@pytest.fixture
def crd(kube_cluster: KubeCluster) -> KubeCluster:
    """The PDDeployment CRD, created only when missing: the operator needs it to start, and on a
    cluster shared with other branches' test runs a newer CRD must stay as it is (these tests
    create no PDDeployment)."""
    kube_cluster.kubectl("create", "-f", REPO / "crds", check=False)
    kube_cluster.wait_established("pddeployments.pdserve.io", timeout=60)
    return kube_cluster


@pytest.fixture
def node_operator(crd: KubeCluster, kube_namespace: str, tmp_path: Path) -> Iterator[Operator]:
    """``pdserve operator`` watching the test's namespace (and every node), as admin."""
    with running(Operator(crd.kubeconfig, kube_namespace, tmp_path / "operator.log")) as op:
        yield op


def create_pods(kube: KubeCluster, namespace: str, node: str, *names: str) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": [pinned_pod(n, node) for n in names]}
    kube.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    for name in names:
        eventually(
            lambda name=name: pod_ready(get_pod(kube, namespace, name) or {}) == "True",
            timeout=60,
            message=f"pod {name} Ready on {node}",
        )


def unreachable(kube: KubeCluster, node: str) -> set[str]:
    return {t["effect"] for t in taints(kube, node) if t["key"] == UNREACHABLE_TAINT}


def test_eviction_api_helper(kube_cluster: KubeCluster, kube_namespace: str, kube_api: Any) -> None:
    with gpu_pool(kube_cluster, 1) as (node,):
        eventually(lambda: node_ready(kube_cluster, node) == "True", timeout=60, message=f"{node} Ready")
        create_pods(kube_cluster, kube_namespace, node, "evicted")
        assert evict(kube_api, kube_namespace, "evicted") == (201, "")
        # kwok plays the kubelet's part: the evicted pod is gone.
        eventually(
            lambda: get_pod(kube_cluster, kube_namespace, "evicted") is None, timeout=30, message="gone"
        )
        status, message = evict(kube_api, kube_namespace, "evicted")
        assert status == 404, message


def test_a_lost_node_goes_unknown_its_pods_not_ready_and_a_deleted_pod_stays_terminating(
    kube_cluster: KubeCluster, kube_namespace: str, kube_api: Any, node_operator: Operator
) -> None:
    kube = kube_cluster
    with gpu_pool(kube, 1) as (node,):
        eventually(lambda: node_ready(kube, node) == "True", timeout=60, message=f"{node} Ready")
        create_pods(kube, kube_namespace, node, "stays", "deleted")
        # DefaultTolerationSeconds: each pod tolerates an unreachable node for 300 s, then the
        # taint-eviction controller deletes it (the default the operator's grace follows).
        tolerations = (get_pod(kube, kube_namespace, "stays") or {})["spec"]["tolerations"]
        assert {
            "key": UNREACHABLE_TAINT,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        } in (tolerations)
        with node_watch(kube_api, node) as watched:
            assert watched.cache.ready_known()
            assert watched.cache.not_ready_since(node) is None
            started = time.time()
            with node_lost(kube, node) as lost:
                seen_unknown = time.time()
                print(
                    f"\n{node}: last heartbeat {started - lost.last_heartbeat:.1f} s before the takeover; "
                    f"Ready=Unknown {lost.unknown_since - lost.last_heartbeat:.1f} s after it "
                    f"(seen {seen_unknown - started:.1f} s after the takeover)"
                )
                # The node lifecycle controller's view, everything at once or nearly.
                eventually(
                    lambda: unreachable(kube, node) == {"NoSchedule", "NoExecute"},
                    timeout=30,
                    message="the unreachable taints",
                )
                eventually(
                    lambda: pod_ready(get_pod(kube, kube_namespace, "stays") or {}) == "False",
                    timeout=30,
                    message="the pod's Ready condition False",
                )
                print(f"{node}: taints and pods NotReady {time.time() - seen_unknown:.1f} s after Unknown")
                # The operator's view: the real watch, and the operator process's own.
                eventually(
                    lambda: watched.cache.not_ready_since(node) == lost.unknown_since,
                    timeout=10,
                    message="NodeCache: lost since the condition's transition",
                )
                node_operator.wait_logged(
                    f"node {node} is not Ready", "the operator's node watch reporting the loss"
                )
                # Nobody confirms the deleted pod's containers stopped: it stays Terminating (or
                # kwok finished it at once: see delete_pod).
                stuck = delete_pod(kube, kube_namespace, "deleted") is not None
                time.sleep(5)
                after = get_pod(kube, kube_namespace, "deleted")
                assert terminating(after) if stuck else after is None
                fate = "stays Terminating" if stuck else "was finished by kwok at once"
                print(f"{node}: the deleted pod {fate}")
            restored = time.time()
            print(f"{node}: Ready again {restored - seen_unknown:.1f} s after Unknown (restore included)")
            eventually(
                lambda: get_pod(kube, kube_namespace, "deleted") is None,
                timeout=30,
                message="the Terminating pod finished by kwok",
            )
            eventually(
                lambda: not unreachable(kube, node), timeout=30, message="the unreachable taints removed"
            )
            eventually(
                lambda: watched.cache.not_ready_since(node) is None,
                timeout=10,
                message="NodeCache: Ready again",
            )
            node_operator.wait_logged(
                f"node {node} is Ready", "the operator's node watch reporting the node Ready"
            )
            # kwok only readies Pending pods: the pod the lifecycle controller marked NotReady
            # stays so (a real kubelet would report it Ready again).
            stays = get_pod(kube, kube_namespace, "stays") or {}
            print(f"{node}: the surviving pod's Ready after the restore: {pod_ready(stays)}")
            # kwok manages the node again, not only its status: a new pod there becomes Ready.
            create_pods(kube, kube_namespace, node, "after")

            # A deleted node is lost from its deletion on.
            deleted_at = time.time()
            kube.kubectl("delete", "node", node, "--wait=false")
            eventually(lambda: watched.cache.not_ready_since(node) is not None, timeout=10, message="deleted")
            assert abs((watched.cache.not_ready_since(node) or 0) - deleted_at) < 5
            node_operator.wait_logged(
                f"node {node} is deleted", "the operator's node watch reporting the deletion"
            )
        if RECORD:
            Path(RECORD).write_text(
                json.dumps({"listed": watched.listed[0], "events": watched.events}, indent=1) + "\n"
            )


def test_without_node_rbac_the_operator_warns_once_and_never_watches_nodes(
    crd: KubeCluster, kube_namespace: str, tmp_path: Path
) -> None:
    """The namespaced RBAC without its nodes ClusterRole: one warning, no forbidden watch retried."""
    kube, ns = crd, kube_namespace
    rbac = [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac" / "namespaced.yaml").read_text()) if d]
    roles = {d["metadata"]["name"]: d for d in rbac if d["kind"] == "Role"}
    role = roles.pop("pdserve-operator")
    # The test operator elects its leader through a Lease in this namespace: the election's rules too.
    for election in roles.values():
        role = {
            **role,
            "rules": role["rules"]
            + [{k: v for k, v in r.items() if k != "resourceNames"} for r in election["rules"]],
        }
    account = "operator-without-nodes"
    meta = {"name": account, "namespace": ns}
    apply_objects(
        kube.kubectl,
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
            {**role, "metadata": meta},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": meta,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
            },
        ],
    )
    kubeconfig = router_kubeconfig(kube.kubectl, ns, account, tmp_path)
    operator = Operator(kubeconfig, ns, tmp_path / "operator.log")
    operator.start()
    try:
        warning = "cannot list and watch nodes (RBAC)"
        eventually(lambda: warning in operator.log(), timeout=30, message="the warning")
        time.sleep(5)  # a forbidden watch would have logged its retries by now
        text = operator.log_path.read_text(errors="replace")
        assert text.count(warning) == 1
        refused = [line for line in text.splitlines() if _refused(line)]
        assert not refused, refused
    finally:
        operator.stop()


def _refused(line: str) -> bool:
    """A log line telling of a request the API server refused (403 Forbidden). Only the message and
    the error are read: a timestamp's digits or the health server's response sizes may hold "403"."""
    try:
        record = json.loads(line)
    except ValueError:
        said = line
    else:
        if not isinstance(record, dict) or "first_request_line" in record:  # the operator's own access log
            return False
        said = f"{record.get('message', '')} {record.get('exc_info', '')}"  # python-json-logger's keys
    return re.search(r"forbidden|\b403\b", said, re.IGNORECASE) is not None
