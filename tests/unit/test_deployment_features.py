"""Golden renders of one small deployment per production feature (pod templates, model storage,
KV-transfer pod settings, router security, engine defaults).

Regenerate with ``PDSERVE_UPDATE_GOLDEN=1 pytest tests/unit/test_deployment_features.py`` and review
the diff: it is exactly what changes in users' clusters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.cli import to_yaml
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.deployment.validate import problems
from tests.support import specs
from tests.support.specs import ENGINE_TEMPLATE, check_golden

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "render" / "features"

BASE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.3-70B-Instruct",
    "servedModelName": "llama-3.3-70b",
    "image": "vllm/vllm-openai:v0.12.0",
    "prefill": {"instances": 1, "tensorParallel": 4},
    "decode": {"instances": 1, "dataParallel": 2, "tensorParallel": 2},
}

FEATURES: dict[str, dict[str, Any]] = {
    "engine-defaults": {
        "prefill": {**BASE["prefill"], "startupTimeoutSeconds": 7200, "shmSize": "32Gi"},
        "decode": {**BASE["decode"], "resources": {"requests": {"cpu": "16"}, "limits": {"memory": "300Gi"}}},
    },
    "moriio": {
        "kvTransfer": {"connector": "MoRIIOConnector", "transferMode": "WRITE"},
        "gpuResource": "amd.com/gpu",
        "decode": {"instances": 1, "dataParallel": 4},
    },
    "router-security": {
        "router": {"apiKeySecretRef": {"name": "router-key", "key": "api-key"}, "adminPort": 9100},
        "engineApiKeySecretRef": {"name": "engine-key", "key": "api-key"},
    },
    "model-cache-and-token": {
        "modelCache": {"persistentVolumeClaim": {"claimName": "hf-cache"}},
        "hfTokenSecretRef": {"name": "hf-token", "key": "token"},
    },
    "model-from-pvc": {
        "model": "pvc://llama-weights/Llama-3.3-70B-Instruct",
        "modelCache": {"emptyDir": {"sizeLimit": "10Gi"}},
    },
    "pod-template": {
        "prefill": {**BASE["prefill"], "template": ENGINE_TEMPLATE},
        "decode": {**BASE["decode"], "template": ENGINE_TEMPLATE},
        "router": {
            "template": {
                "spec": {
                    "imagePullSecrets": [{"name": "regcred"}],
                    "containers": [{"name": "router", "resources": {"limits": {"memory": "1Gi"}}}],
                }
            }
        },
    },
}


def manifest(extra: dict[str, Any]) -> dict[str, Any]:
    metadata = {"namespace": "serving", "uid": "0d9f6b3c-4c1e-4f5a-9a53-2b7d3c9e8f10"}
    return specs.manifest("llama", metadata=metadata, **{**BASE, **extra})


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_golden_render(feature: str) -> None:
    pdd = parse_pddeployment(manifest(FEATURES[feature]))
    assert problems(pdd, None) == []
    check_golden(GOLDEN / f"{feature}.yaml", to_yaml(render_all(pdd)))
