"""spec.router.placement: decode-sidecar renders the router into every decode pod.

Golden files: tests/golden/render/sidecar-*.yaml (regenerate with PDSERVE_UPDATE_GOLDEN=1); the
default placement keeps its goldens in test_deployment_objects.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.cli import to_yaml
from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.render.engine_pod import template_hash
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.router import router_pod_selector
from pdserve.deployment.render.routing_table import build_routing_table
from pdserve.deployment.render.static_objects import desired_static_objects
from pdserve.deployment.spec.parse import SpecError, parse_pddeployment
from pdserve.deployment.validate import problems
from pdserve.routing import Role
from tests.unit.test_deployment_objects import GOLDEN, UPDATE, all_ready, shape_manifest

SIDECAR = {"replicas": 2, "placement": "decode-sidecar"}


@pytest.mark.parametrize(
    ("shape", "connector"), [("2P_DP8EP-3D_DP8EP", "nixl"), ("2P_TP8-1D_DP8EP", "moriio")]
)
def test_golden_render_sidecar(shape: str, connector: str) -> None:
    pdd = parse_pddeployment(shape_manifest(shape, connector, router=SIDECAR))
    text = to_yaml(render_all(pdd, build_routing_table(pdd, all_ready(pdd), None)))
    golden = GOLDEN / f"sidecar-{shape}-{connector}.yaml"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSERVE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} differs; review and regenerate with PDSERVE_UPDATE_GOLDEN=1"
    )


def render(**router: Any) -> list[dict[str, Any]]:
    pdd = parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", router={**SIDECAR, **router}))
    return render_all(pdd)


def test_decode_pods_carry_the_router_and_nothing_else_changes() -> None:
    objects = render()
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert ("Deployment", "r1-router") not in kinds
    assert ("Role", "r1-router") in kinds and ("RoleBinding", "r1-router") in kinds
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "r1")
    assert service["spec"]["selector"] == {"pdserve.io/deployment": "r1", "pdserve.io/role": "decode"}
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "proxy", "protocol": "TCP"}
    ]
    pods = [o for o in objects if o["kind"] == "Pod"]
    for pod in pods:
        spec = pod["spec"]
        names = [c["name"] for c in spec["containers"]]
        assert spec["automountServiceAccountToken"] is False
        if pod["metadata"]["labels"]["pdserve.io/role"] == "prefill":
            assert names == ["engine"] and "serviceAccountName" not in spec
            continue
        assert names == ["engine", "router"]
        assert spec["serviceAccountName"] == "r1-router"
        engine, router = spec["containers"]
        assert all(m["name"] != "router-token" for m in engine["volumeMounts"])  # no API token for model code
        assert {
            "name": "router-token",
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True,
        } in router["volumeMounts"]
        args = router["args"]
        assert args[args.index("--local-decode") + 1] == "http://$(POD_IP):8000"
        assert args[args.index("--local-dp-size") + 1] == "8"
        assert args[args.index("--port") + 1] == "8200" and args[args.index("--admin-port") + 1] == "9000"
        env = {e["name"]: e for e in router["env"]}
        assert (
            env["PDSERVE_INSTANCE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['pdserve.io/instance']"
        )
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "proxy"}
        assert spec["terminationGracePeriodSeconds"] >= 130


def test_placement_is_part_of_the_decode_template_hash_only() -> None:
    default = parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl"))
    sidecar = parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", router=SIDECAR))
    assert template_hash(default, Role.DECODE) != template_hash(sidecar, Role.DECODE)
    assert template_hash(default, Role.PREFILL) == template_hash(sidecar, Role.PREFILL)
    # the sidecar pairs with prefills of its engine's revision, which the placement does not change
    assert pairing_revision(default, Role.DECODE) == pairing_revision(sidecar, Role.DECODE)
    decode = next(o for o in render_all(sidecar) if o["kind"] == "Pod" and "decode" in o["metadata"]["name"])
    args = decode["spec"]["containers"][1]["args"]
    assert args[args.index("--local-revision") + 1] == pairing_revision(sidecar, Role.DECODE)


def test_router_pods_are_the_decode_pods() -> None:
    default = parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl"))
    sidecar = parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", router=SIDECAR))
    assert router_pod_selector(default) == "pdserve.io/deployment=r1,app.kubernetes.io/component=router"
    assert router_pod_selector(sidecar) == "pdserve.io/deployment=r1,pdserve.io/role=decode"
    assert [o["kind"] for o in desired_static_objects(sidecar)].count("Deployment") == 0


def test_router_template_tunes_the_sidecar_container() -> None:
    template = {"spec": {"containers": [{"name": "router", "resources": {"requests": {"cpu": "2"}}}]}}
    pods = [o for o in render(template=template) if o["kind"] == "Pod" and "decode" in o["metadata"]["name"]]
    assert pods[0]["spec"]["containers"][1]["resources"] == {"requests": {"cpu": "2", "memory": "128Mi"}}


def test_pod_settings_in_the_router_template_are_refused_with_the_sidecar() -> None:
    template = {"metadata": {"labels": {"team": "a"}}, "spec": {"nodeSelector": {"pool": "cpu"}}}
    pdd = parse_pddeployment(
        shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", router={**SIDECAR, "template": template})
    )
    found = problems(pdd, None)
    assert any(p.startswith("spec.router.template.metadata: with placement decode-sidecar") for p in found)
    assert any(
        p.startswith("spec.router.template.spec.nodeSelector: with placement decode-sidecar") for p in found
    )
    decode_template = {"spec": {"containers": [{"name": "router", "args": ["x"]}]}}
    manifest = shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", router=SIDECAR)
    manifest["spec"]["decode"]["template"] = decode_template
    assert "spec.decode.template.spec.containers[router].args: set by pdserve" in " ".join(
        problems(parse_pddeployment(manifest), None)
    )


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(SpecError, match=r"spec.router.placement: expected one of .*decode-sidecar"):
        parse_pddeployment(shape_manifest("2P_DP8EP-3D_DP8EP", "nixl", router={"placement": "sidecar"}))
