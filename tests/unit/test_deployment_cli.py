"""`pdserve render FILE`, run as users run it: a subprocess of the console entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
