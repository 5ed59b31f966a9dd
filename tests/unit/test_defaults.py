"""Engine pod defaults: requests (overridable), no API token, non-root where the image allows,
probe timeouts, a startup window long enough for a 70B load; the router runs unprivileged."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.render.router import router_deployment
from pdserve.deployment.spec.parse import SpecError
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.routing import Role
from tests.support.specs import pdd_of


def pod(pdd: PDDeployment, role: Role = Role.DECODE) -> dict[str, Any]:
    spec: dict[str, Any] = instance_pod(pdd, role, 0)["spec"]
    return spec


def test_requests_scale_with_the_gpus_of_an_instance() -> None:
    engine = pod(pdd_of(decode={"tensorParallel": 8}))["containers"][0]
    assert engine["resources"]["requests"] == {"nvidia.com/gpu": "8", "cpu": "32", "memory": "256Gi"}
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    sim = pod(pdd_of(engine="sim", image=""))["containers"][0]
    assert sim["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}


def test_requests_are_overridable_by_the_role_and_the_template() -> None:
    role = pod(pdd_of(decode={"resources": {"requests": {"cpu": "10"}}}))["containers"][0]
    assert role["resources"]["requests"] == {"cpu": "10", "nvidia.com/gpu": "1", "memory": "32Gi"}
    template = {"spec": {"containers": [{"name": "engine", "resources": {"requests": {"memory": "500Gi"}}}]}}
    tmpl = pod(pdd_of(decode={"template": template}))["containers"][0]
    assert tmpl["resources"]["requests"]["memory"] == "500Gi"
    # A limit alone turns the default request off (Kubernetes requests the limit), never request > limit.
    limited = {"spec": {"containers": [{"name": "engine", "resources": {"limits": {"memory": "16Gi"}}}]}}
    resources = pod(pdd_of(decode={"template": limited}))["containers"][0]["resources"]
    assert "memory" not in resources["requests"] and resources["limits"]["memory"] == "16Gi"


def test_engines_get_no_api_token_and_run_unprivileged() -> None:
    vllm = pod(pdd_of())
    assert vllm["automountServiceAccountToken"] is False
    assert vllm["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"add": ["IPC_LOCK"]},
    }
    assert "securityContext" not in vllm  # the vLLM image runs as root
    sim = pod(pdd_of(engine="sim", image=""))
    assert sim["securityContext"] == {"runAsNonRoot": True} and sim["automountServiceAccountToken"] is False
    opt_in = pod(pdd_of(decode={"template": {"spec": {"automountServiceAccountToken": True}}}))
    assert opt_in["automountServiceAccountToken"] is True


def test_probes_have_timeouts_and_the_startup_window_follows_the_field() -> None:
    engine = pod(pdd_of())["containers"][0]
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == 3600
    assert all(engine[p]["timeoutSeconds"] == 5 for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    slow = pod(pdd_of(prefill={"startupTimeoutSeconds": 7205}), Role.PREFILL)["containers"][0]
    assert slow["startupProbe"]["failureThreshold"] == 721  # rounded up: never shorter than asked


@pytest.mark.parametrize("value", [5, 100000, "3600"])
def test_the_startup_window_is_bounded(value: Any) -> None:
    with pytest.raises(SpecError) as info:
        pdd_of(decode={"startupTimeoutSeconds": value})
    assert info.value.path == "spec.decode.startupTimeoutSeconds"


def test_the_router_runs_unprivileged() -> None:
    spec = router_deployment(pdd_of())["spec"]["template"]["spec"]
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
