"""What only the operator can refuse (CEL cannot see it), on the real control plane: the status
says which field and why (Degraded, reason InvalidSpec), a Warning Event says the same, nothing
is rendered, and the message is the one ``pdserve render`` prints (one function words it)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from pdserve.deployment.spec.owned import DIRECTIVE_REASON
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.deployment.validate import problems
from tests.support.kube import eventually
from tests.support.operator import (
    WAIT,
    Cluster,
    Operator,
    pdd_manifest,
    ready,
)

pytestmark = pytest.mark.cluster


def _with(manifest: dict[str, Any], role: str, **fields: Any) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    out["spec"][role].update(fields)
    return out


CASES = [
    pytest.param(
        "prefill",
        {
            "template": {
                "spec": {"containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
            }
        },
        "spec.prefill.template.spec.containers[engine].resources.limits[nvidia.com/gpu]: pdserve requests "
        "dataParallel x tensorParallel = 2 GPUs per instance, got 1; remove it from resources",
        id="template-gpu-count",
    ),
    pytest.param(
        "decode",
        {"template": {"spec": {"volumes": [{"$patch": "delete", "name": "scratch"}]}}},
        f"spec.decode.template.spec.volumes[0].$patch: {DIRECTIVE_REASON}",
        id="template-merge-directive",
    ),
    pytest.param(
        "decode",
        {"args": ["--block-size", "8"]},
        "spec.prefill.args, spec.decode.args: --block-size 16 on prefill and 8 on decode; with NixlConnector "
        "the prefill's block size must be at most the decode's and divide it",
        id="block-size",
    ),
]


@pytest.mark.parametrize(("role", "fields", "message"), CASES)
def test_the_operator_refuses_what_cel_cannot_see_naming_the_field(
    operator: Operator,
    cluster: Cluster,
    role: str,
    fields: dict[str, Any],
    message: str,
) -> None:
    base = pdd_manifest("bad", decode_instances=1)
    # Both roles: the pairing revision hashes --block-size, and the router (which really runs
    # on the test cluster) pairs only prefills and decodes of one revision.
    base["spec"]["prefill"]["args"] = ["--block-size", "16"]
    base["spec"]["decode"]["args"] = ["--block-size", "16"]
    manifest = _with(base, role, **fields)
    assert problems(parse_pddeployment(manifest), None) == [message]  # what `pdserve render` prints
    cluster.apply(manifest)

    def degraded() -> dict[str, Any]:
        c = cluster.condition("bad", "Degraded")
        return c if c.get("status") == "True" else {}

    condition = eventually(degraded, timeout=WAIT, message="Degraded=True")
    assert (condition["reason"], condition["message"]) == ("InvalidSpec", message)
    assert cluster.condition("bad", "Ready")["status"] == "False"
    assert (
        cluster.kubectl("get", "pods,deployments", "-l", "pdserve.io/deployment=bad", "-o", "name").strip()
        == ""
    )

    def warned() -> bool:
        events = json.loads(
            cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=bad", "-o", "json")
        )
        return any(e["type"] == "Warning" and e["message"] == message for e in events["items"])

    eventually(warned, timeout=WAIT, message="a Warning Event with the message")
    described = " ".join(cluster.kubectl("describe", "pdd", "bad").split())
    assert " ".join(message.split()) in described

    cluster.apply(base)  # fixed: it is rendered and serves
    eventually(lambda: ready(cluster, "bad"), timeout=WAIT, message="Ready once fixed")
