"""The one PDDeployment builder of the tests and benches, and the golden-file check
(``PDSERVE_UPDATE_GOLDEN=1`` rewrites instead).

:func:`manifest` makes the object (what ``kubectl apply`` or ``pdserve up`` reads); :func:`pdd_of`
parses it; :func:`sim_manifest` is the simulator deployment the test cluster and local mode run.
A test states only the spec fields it is about."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.deployment.spec.pddeployment import PDDeployment

API_VERSION = "pdserve.io/v1alpha1"
IMAGE = "vllm/vllm-openai:v0.12.0"
NIXL = {"connector": "NixlConnector"}
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"


#: A production engine pod template, as a platform team writes one: labels and annotations, node
#: placement, a priority class, a pull secret, a runtime class, the engine container's env and
#: resources, and a sidecar of its own.
ENGINE_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/owner": "inference"}},
    "spec": {
        "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
        ],
        "priorityClassName": "inference-critical",
        "imagePullSecrets": [{"name": "regcred"}],
        "runtimeClassName": "nvidia",
        "containers": [
            {
                "name": "engine",
                "env": [
                    {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1,mlx5_1:1"},  # overrides pdserve's "all"
                    {"name": "NCCL_DEBUG", "value": "INFO"},
                ],
                "resources": {"requests": {"memory": "400Gi"}, "limits": {"rdma/ib": "8"}},
            },
            {"name": "log-shipper", "image": "fluent/fluent-bit:3.0"},
        ],
    },
}


def manifest(name: str = "r1", *, metadata: Mapping[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """A PDDeployment object named ``name``: ``spec`` on top of model ``m`` and a vLLM image (a
    field given as None is left out, e.g. ``image=None``); ``metadata``: more of its metadata
    (namespace, uid, generation). The values are copied: callers may share their dicts."""
    body = {"model": "m", "image": IMAGE, **copy.deepcopy(spec)}
    return {
        "apiVersion": API_VERSION,
        "kind": "PDDeployment",
        "metadata": {"name": name, **(metadata or {})},
        "spec": {field: value for field, value in body.items() if value is not None},
    }


def pdd_of(name: str = "r1", *, metadata: Mapping[str, Any] | None = None, **spec: Any) -> PDDeployment:
    """:func:`manifest`, parsed."""
    return parse_pddeployment(manifest(name, metadata=metadata, **spec))


def vllm_manifest(name: str, *, metadata: Mapping[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """``engine: vllm`` with NIXL and a released vLLM image: GPU pods, which the test cluster puts
    on kwok's nodes (Ready, nothing runs); ``spec`` on top (give the model)."""
    defaults = {"engine": "vllm", "image": VLLM_IMAGE, "kvTransfer": NIXL}
    return manifest(name, metadata=metadata, **{**defaults, **spec})


def sim_manifest(name: str, *, metadata: Mapping[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """``engine: sim`` (model ``sim-model``, NIXL): simulators for engines, as the test cluster's pod
    runner and ``pdserve up`` run them; ``spec`` on top."""
    defaults = {"model": "sim-model", "engine": "sim", "image": None, "kvTransfer": NIXL}
    return manifest(name, metadata=metadata, **{**defaults, **spec})


def check_golden(golden: Path, text: str) -> None:
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSERVE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} differs; review and regenerate with PDSERVE_UPDATE_GOLDEN=1"
    )
