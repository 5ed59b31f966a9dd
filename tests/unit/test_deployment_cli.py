"""`pdserve render FILE`, run as users run it: a subprocess of the console entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.routing import load_routing_table

MANIFEST = """\
apiVersion: pdserve.io/v1alpha1
kind: PDDeployment
metadata:
  name: demo
  namespace: serving
spec:
  model: Qwen/Qwen3-0.6B
  engine: sim
  prefill: {instances: 2, dataParallel: 2}
  decode: {instances: 1}
"""


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "render", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_render_yaml_stream(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(MANIFEST)
    proc = render(str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("---\n")
    docs = list(yaml.safe_load_all(proc.stdout))
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert names == [
        ("Service", "demo-engines"),
        ("Service", "demo"),
        ("ServiceAccount", "demo-router"),
        ("Role", "demo-router"),
        ("RoleBinding", "demo-router"),
        ("Deployment", "demo-router"),
        ("PodDisruptionBudget", "demo-prefill"),
        ("PodDisruptionBudget", "demo-decode"),
        ("ConfigMap", "demo-routing"),
        ("Pod", "demo-prefill-0"),
        ("Pod", "demo-prefill-1"),
        ("Pod", "demo-decode-0"),
    ]
    assert all(d["metadata"]["namespace"] == "serving" for d in docs)
    table = load_routing_table(docs[8]["data"]["routing.json"])
    assert table.deployment == "demo"


def test_render_json_list(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(MANIFEST)
    proc = render(str(path), "-o", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["kind"] == "List"
    assert len(doc["items"]) == 12


def test_bad_field_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MANIFEST.replace("dataParallel: 2", 'dataParallel: "2"'))
    proc = render(str(path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert 'spec.prefill.dataParallel: expected an integer >= 1, got "2" (string)' in proc.stderr


def test_validation_problem_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MANIFEST.replace("decode: {instances: 1}", "decode: {instances: 1, args: [--port, '9']}"))
    proc = render(str(path))
    assert proc.returncode == 2
    assert "spec.decode.args[0]: --port is set by pdserve" in proc.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    proc = render(str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert "nope.yaml: no such file" in proc.stderr


def test_help_is_the_module_docstring() -> None:
    proc = render("--help")
    assert proc.returncode == 0
    assert "without a cluster" in proc.stdout


def test_an_owned_template_field_exits_2_with_the_operators_message(tmp_path: Path) -> None:
    """One function words the refusal for ``pdserve render``, the operator and (as CEL) the API server."""
    from pdserve.deployment.spec.owned import ENGINE_OWNED

    path = tmp_path / "bad.yaml"
    template = "{spec: {containers: [{name: engine, args: [--port, '9']}]}}"
    path.write_text(
        MANIFEST.replace("decode: {instances: 1}", f"decode: {{instances: 1, template: {template}}}")
    )
    proc = render(str(path))
    assert proc.returncode == 2
    assert proc.stderr == f"pdserve render: spec.decode.{ENGINE_OWNED['args'].message}\n"


def _objects(stdout: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(stdout) if d]


def _namespaces(docs: list[dict[str, Any]]) -> set[str | None]:
    """Every namespace the stream names: objects' and RoleBinding subjects'."""
    found = {d["metadata"].get("namespace") for d in docs}
    found |= {s.get("namespace") for d in docs if d["kind"] == "RoleBinding" for s in d["subjects"]}
    return found


def test_no_namespace_unless_asked_so_kubectl_apply_n_places_it(tmp_path: Path) -> None:
    """A file without metadata.namespace renders objects without one (a RoleBinding's
    ServiceAccount subject without a namespace is the binding's own, RBAC's rule), and a
    multi-node worker finds its leader by the short DNS name the pod's search path completes."""
    path = tmp_path / "demo.yaml"
    path.write_text(
        MANIFEST.replace("  namespace: serving\n", "").replace(
            "prefill: {instances: 2, dataParallel: 2}",
            "prefill: {instances: 1, dataParallel: 4}\n  gpusPerNode: 2",
        )
    )
    proc = render(str(path))
    assert proc.returncode == 0, proc.stderr
    docs = _objects(proc.stdout)
    assert _namespaces(docs) == {None}
    assert ".svc" not in proc.stdout and "default" not in proc.stdout
    worker = next(d for d in docs if d["metadata"]["name"].endswith("prefill-0-1"))
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["PDSERVE_LEADER_ADDRESS"] == "prefill-0.demo-engines"


def test_namespace_flag_names_every_object(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(MANIFEST.replace("  namespace: serving\n", ""))
    proc = render(str(path), "--namespace", "staging")
    assert proc.returncode == 0, proc.stderr
    assert _namespaces(_objects(proc.stdout)) == {"staging"}
    # The file's own namespace is used too, and agreeing with it is fine.
    path.write_text(MANIFEST)
    assert _namespaces(_objects(render(str(path), "-n", "serving").stdout)) == {"serving"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--namespace", "staging"], "demo.yaml is in namespace 'serving', --namespace says 'staging'"),
        (["--namespace", "Bad_NS"], "--namespace: expected a namespace name, got 'Bad_NS'"),
    ],
)
def test_namespace_refusals_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(MANIFEST)
    proc = render(str(path), *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr


def test_sidecar_without_any_namespace_renders_none(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(MANIFEST.replace("  namespace: serving\n", ""))
    proc = render("sidecar", str(path), "--part", "rbac")
    assert proc.returncode == 0, proc.stderr
    assert _namespaces(_objects(proc.stdout)) == {None}
    proc = render("sidecar", str(path), "--namespace", "apps")
    assert proc.returncode == 2
    assert "set metadata.namespace in" in proc.stderr
