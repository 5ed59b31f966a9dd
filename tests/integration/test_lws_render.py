"""The LeaderWorkerSets pdserve renders (backend lws) are accepted by the real API server: the
LWS CRD's schema and the LWS controller's admission webhooks (server-side dry run).

Skipped when the cluster has no LeaderWorkerSet API installed (pdserve's chart does not install it).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.deployment.render.groups import instance_lws, render_all
from pdserve.routing import Role
from tests.support.kube import KubeCluster
from tests.support.specs import pdd_of
from tests.unit.test_deployment_groups import DEEPSEEK, SPANNING

pytestmark = pytest.mark.cluster

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"


def lws_pdd(spec: dict[str, Any], namespace: str, api_servers: str) -> Any:
    multi_node = {"backend": "lws", "apiServers": api_servers}
    return pdd_of("mn", metadata={"namespace": namespace}, **spec, multiNode=multi_node)


@pytest.mark.parametrize("api_servers", ["perNode", "leader"])
@pytest.mark.parametrize("shape", ["deepseek", "spanning"])
def test_rendered_leaderworkersets_pass_the_api_server(
    kube_cluster: KubeCluster, kube_namespace: str, shape: str, api_servers: str
) -> None:
    if kube_cluster.kubectl("get", "crd", LWS_CRD, check=False).returncode != 0:
        pytest.skip("no LeaderWorkerSet API on this cluster")
    pdd = lws_pdd(DEEPSEEK if shape == "deepseek" else SPANNING, kube_namespace, api_servers)
    objects = [o for o in render_all(pdd) if o["kind"] == "LeaderWorkerSet"]
    objects.append(instance_lws(pdd, Role.PREFILL, 3, "k8x2p"))  # as the operator names one
    assert objects
    for sent in objects:
        out = kube_cluster.kubectl(
            "create",
            "--dry-run=server",
            "-n",
            kube_namespace,
            "-f",
            "-",
            "-o",
            "json",
            input=json.dumps(sent),
        )
        item = json.loads(out.stdout)
        assert item["metadata"]["name"] == sent["metadata"]["name"]
        template = item["spec"]["leaderWorkerTemplate"]
        assert template["size"] == sent["spec"]["leaderWorkerTemplate"]["size"]
        assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
        sent_worker = sent["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        assert template["workerTemplate"]["spec"]["containers"][0]["args"] == sent_worker["args"]
