"""`pdserve render sidecar FILE`: the router next to a client application.

Golden file: tests/golden/render/client-sidecar-2P_DP8EP-3D_DP8EP-nixl.yaml (regenerate with
PDSERVE_UPDATE_GOLDEN=1). The container is the router Deployment's, moved onto localhost.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.deployment import cli as render_cli
from pdserve.deployment.cli import to_yaml
from pdserve.deployment.render.client_sidecar import client_pod_patch, client_rbac, client_router_container
from pdserve.deployment.render.router import router_deployment, router_rbac
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.proxy.cli import configure as configure_proxy
from tests.unit.test_deployment_objects import GOLDEN, UPDATE, shape_manifest

KEYS = {
    "router": {"replicas": 2, "apiKeySecretRef": {"name": "router-key", "key": "api-key"}},
    "engineApiKeySecretRef": {"name": "engine-key", "key": "api-key"},
}


def pdd_of(**extra: Any) -> Any:
    return parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", **extra))


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_golden_client_sidecar() -> None:
    pdd = pdd_of(**KEYS)
    text = to_yaml([client_pod_patch(pdd, "chat-app"), *client_rbac(pdd, "chat-app")])
    golden = GOLDEN / "client-sidecar-2P_DP8EP-3D_DP8EP-nixl.yaml"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSERVE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} differs; review and regenerate with PDSERVE_UPDATE_GOLDEN=1"
    )


def test_the_container_is_the_router_deployments_on_localhost_with_probes_on_the_admin_port() -> None:
    pdd = pdd_of(**KEYS)
    router = router_deployment(pdd)["spec"]["template"]["spec"]["containers"][0]
    client = client_router_container(pdd, port=8300)
    args = client["args"]
    assert _flag(args, "--routing-configmap") == "$(POD_NAMESPACE)/r1-routing"
    assert (_flag(args, "--host"), _flag(args, "--port")) == ("127.0.0.1", "8300")
    assert (_flag(args, "--admin-port"), _flag(args, "--admin-host")) == ("9000", "0.0.0.0")
    # Everything else is the router Deployment's: policy, backlog, grace, image, keys, resources.
    for flag in ("--policy", "--backlog", "--shutdown-grace-seconds"):
        assert _flag(args, flag) == _flag(router["args"], flag)
    for key in ("image", "command", "env", "resources", "lifecycle"):
        assert client[key] == router[key], key
    assert {e["name"] for e in client["env"]} >= {"PDSERVE_PROXY_API_KEY", "PDSERVE_BACKEND_API_KEY"}
    assert client["ports"] == [{"name": "admin", "containerPort": 9000, "protocol": "TCP"}]
    assert client["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin"}
    assert client["livenessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
    # The args are ones `pdserve proxy` accepts (the table from the ConfigMap through the API server).
    parser = argparse.ArgumentParser()
    configure_proxy(parser)
    parsed = parser.parse_args(args[1:])
    assert (parsed.host, parsed.port, parsed.admin_port, parsed.admin_host) == (
        "127.0.0.1",
        8300,
        9000,
        "0.0.0.0",
    )


def test_router_template_tunes_the_client_container_too() -> None:
    template = {"spec": {"containers": [{"name": "router", "resources": {"limits": {"memory": "1Gi"}}}]}}
    pdd = pdd_of(router={"replicas": 2, "template": template})
    assert client_router_container(pdd)["resources"]["limits"] == {"memory": "1Gi"}


def test_token_goes_to_the_router_container_only() -> None:
    pod = client_pod_patch(pdd_of(), "chat-app")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-app"
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    (volume,) = pod["volumes"]
    assert container["volumeMounts"] == [
        {
            "name": volume["name"],
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True,
        }
    ]
    assert [next(iter(s)) for s in volume["projected"]["sources"]] == [
        "serviceAccountToken",
        "configMap",
        "downwardAPI",
    ]


def test_rbac_reads_the_one_configmap_for_the_given_account() -> None:
    pdd = pdd_of()
    account, role, binding = client_rbac(pdd)
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == "r1-client"
    assert role["rules"] == router_rbac(pdd)[1]["rules"]  # the router's own
    assert role["rules"][0]["resourceNames"] == ["r1-routing"]
    assert role["rules"][0]["verbs"] == ["get", "list", "watch"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == "r1-routing-reader"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "r1-client", "namespace": "serving"}]
    # Not the operator's objects: it neither owns nor prunes them.
    for doc in (account, role, binding):
        assert "app.kubernetes.io/managed-by" not in doc["metadata"]["labels"]
        assert "ownerReferences" not in doc["metadata"]


def test_an_application_in_another_namespace_names_the_configmaps_namespace() -> None:
    pdd = pdd_of()
    args = client_router_container(pdd, namespace="apps")["args"]
    assert _flag(args, "--routing-configmap") == "serving/r1-routing"
    account, role, binding = client_rbac(pdd, "chat", namespace="apps")
    assert account["metadata"]["namespace"] == "apps"
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "serving"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat", "namespace": "apps"}]


def _render(tmp_path: Path, *argv: str) -> int:
    manifest = tmp_path / "pdd.yaml"
    manifest.write_text(yaml.safe_dump(shape_manifest("2P_TP8-1D_DP8EP", "nixl")))
    parser = argparse.ArgumentParser()
    render_cli.configure(parser)
    args = parser.parse_args([a if a != "FILE" else str(manifest) for a in argv])
    return render_cli.run(args)


def test_render_sidecar_command_prints_the_patch_and_the_rbac(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _render(tmp_path, "sidecar", "FILE", "--service-account", "chat")
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert code == 0
    assert [d.get("kind", "patch") for d in docs] == ["patch", "ServiceAccount", "Role", "RoleBinding"]
    code = _render(tmp_path, "sidecar", "FILE", "--part", "rbac")
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ]
    code = _render(tmp_path, "FILE")  # without `sidecar`: every object of the deployment
    assert code == 0 and "Deployment" in {d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)}
    code = _render(tmp_path, "sidecar", "FILE", "--port", "9000")
    assert code == 2 and "--port must differ" in capsys.readouterr().err
