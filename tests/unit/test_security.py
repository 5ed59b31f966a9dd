"""Router and engine keys from Secrets, and the router's admin port, as rendered."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.router import router_deployment, router_service
from pdserve.deployment.spec.parse import SpecError
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.validate import problems
from pdserve.routing import Role
from tests.support.specs import pdd_of

CLIENT = {"name": "router-key", "key": "api-key"}
ENGINE = {"name": "engine-key", "key": "api-key"}


def router_of(pdd: PDDeployment) -> dict[str, Any]:
    container: dict[str, Any] = router_deployment(pdd)["spec"]["template"]["spec"]["containers"][0]
    return container


def secret_env(container: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_the_router_takes_both_keys_from_their_secrets() -> None:
    pdd = pdd_of(router={"apiKeySecretRef": CLIENT}, engineApiKeySecretRef=ENGINE)
    assert secret_env(router_of(pdd)) == {"PDSERVE_PROXY_API_KEY": CLIENT, "PDSERVE_BACKEND_API_KEY": ENGINE}
    for role in Role:
        assert secret_env(instance_pod(pdd, role, 0)["spec"]["containers"][0]) == {"VLLM_API_KEY": ENGINE}


def test_the_simulator_checks_the_engine_key_too() -> None:
    pdd = pdd_of(engine="sim", image="", engineApiKeySecretRef=ENGINE)
    assert secret_env(instance_pod(pdd, Role.DECODE, 0)["spec"]["containers"][0]) == {"VLLM_API_KEY": ENGINE}


def test_without_refs_no_key_is_rendered() -> None:
    pdd = pdd_of()
    assert secret_env(router_of(pdd)) == {}
    assert "KEY" not in json.dumps(render_all(pdd)).replace("template-hash", "")


def test_no_key_is_ever_an_argument() -> None:
    pdd = pdd_of(router={"apiKeySecretRef": CLIENT}, engineApiKeySecretRef=ENGINE)
    for obj in render_all(pdd):
        for container in obj.get("spec", {}).get("containers", []) + obj.get("spec", {}).get(
            "template", {}
        ).get("spec", {}).get("containers", []):
            assert not any("key" in a.lower() for a in container.get("args", [])), container["args"]


def test_the_admin_port_is_a_named_container_port_the_service_does_not_expose() -> None:
    pdd = pdd_of(router={"port": 8080, "adminPort": 9901})
    container = router_of(pdd)
    assert container["args"][-2:] == ["--admin-port", "9901"]
    assert [p["name"] for p in container["ports"]] == ["http", "admin"]
    assert [p["targetPort"] for p in router_service(pdd)["spec"]["ports"]] == ["http"]
    # Probes stay on the client port (kubelet), where /health and /ready still answer.
    assert container["readinessProbe"]["httpGet"]["port"] == "http"


def test_the_admin_port_must_differ_from_the_client_port() -> None:
    with pytest.raises(SpecError) as info:
        pdd_of(router={"port": 9000})
    assert info.value.path == "spec.router.adminPort"
    assert "must differ from port (9000)" in info.value.reason


def test_the_keys_variables_are_pdserves_once_set() -> None:
    engine = {"spec": {"containers": [{"name": "engine", "env": [{"name": "VLLM_API_KEY", "value": "x"}]}]}}
    router = {
        "spec": {"containers": [{"name": "router", "env": [{"name": "PDSERVE_PROXY_API_KEY", "value": "x"}]}]}
    }
    assert problems(pdd_of(decode={"template": engine}, router={"template": router}), None) == []
    found = problems(
        pdd_of(
            decode={"template": engine},
            router={"template": router, "apiKeySecretRef": CLIENT},
            engineApiKeySecretRef=ENGINE,
        ),
        None,
    )
    assert found == [
        "spec.decode.template.spec.containers[engine].env[0]: VLLM_API_KEY is set by pdserve from "
        "spec.engineApiKeySecretRef",
        "spec.router.template.spec.containers[router].env[0]: PDSERVE_PROXY_API_KEY is set by pdserve from "
        "spec.router.apiKeySecretRef",
    ]


def test_an_api_key_flag_is_refused() -> None:
    found = problems(pdd_of(prefill={"args": ["--api-key=abc"]}), None)
    assert found == [
        "spec.prefill.args[0]: --api-key is set by pdserve (use spec.engineApiKeySecretRef: a command "
        "line is visible in the pod spec and to ps); remove it from args"
    ]


def test_the_router_namespace_variable_is_pdserves() -> None:
    """The router reads its ConfigMap in $(POD_NAMESPACE): a template may not point it elsewhere."""
    from pdserve.deployment.validate import problems
    from tests.unit.test_podtemplate import pdd_of as template_pdd

    env = [{"name": "POD_NAMESPACE", "value": "x"}]
    template = {"spec": {"containers": [{"name": "router", "env": env}]}}
    assert problems(template_pdd(router={"template": template}), None) == [
        "spec.router.template.spec.containers[router].env[0]: POD_NAMESPACE is set by pdserve "
        "(the namespace of the routing ConfigMap the router watches)"
    ]
