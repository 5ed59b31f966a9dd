"""PDDeployments given in the chart's values are checked with the CRD's own schema.

values.schema.json's ``$defs.PDDeploymentSpec`` is generated from the CRD by
hack/gen-values-schema (hack/values_schema.py); these tests fail when the committed file is
stale, and show through Helm itself that a typo in a deployment's spec stops ``helm template``
and ``helm lint`` (helm from the test cluster's build, as in test_chart.py).
"""

from __future__ import annotations

import json

import pytest

from hack import values_schema
from tests.unit.test_chart import CHART, NAMESPACE, PRODUCTION_VALUES, RELEASE, helm, run_helm

__all__ = ["helm"]  # the fixture, shared with test_chart.py

DEPLOYMENT = ["--set", "deployments[0].name=chat", "--set", "deployments[0].spec.model=Qwen/Qwen3-8B"]


def test_values_schema_is_generated_from_the_crd() -> None:
    assert values_schema.SCHEMA.read_text() == values_schema.render(), "run hack/gen-values-schema"


def test_the_generated_spec_refuses_unknown_fields_where_the_crd_prunes_them() -> None:
    spec = json.loads(values_schema.SCHEMA.read_text())["$defs"]["PDDeploymentSpec"]
    assert spec["additionalProperties"] is False and spec["required"] == ["model"]
    prefill = spec["properties"]["prefill"]
    assert prefill["additionalProperties"] is False
    assert prefill["properties"]["instances"]["type"] == "integer"
    # A pod template's spec keeps unknown fields (x-kubernetes-preserve-unknown-fields): any
    # PodSpec fragment; the template itself has only metadata and spec.
    template = prefill["properties"]["template"]
    assert template["additionalProperties"] is False
    assert "additionalProperties" not in template["properties"]["spec"]
    # int-or-string (a budget of 1 or "25%") takes both.
    budget = prefill["properties"]["disruptionBudget"]["properties"]["maxUnavailable"]
    assert budget["type"] == ["integer", "string"]
    assert "x-kubernetes" not in json.dumps(spec)


def test_conversion_rules() -> None:
    node = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.a > 0"}],
        "properties": {
            "a": {"type": "integer", "format": "int32"},
            "m": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {}},
            "n": {"type": "string", "nullable": True},
        },
    }
    assert values_schema.convert(node) == {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "m": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "properties": {}},
            "n": {"type": ["string", "null"]},
        },
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("values", "field"),
    [
        (["--set", "deployments[0].spec.prefil.instances=1"], "prefil"),
        (["--set", "deployments[0].spec.prefill.instances=two"], "instances"),
        (["--set", "deployments[0].spec.engine=tgi"], "engine"),
        (["--set", "deployments[0].spec.router.replicass=2"], "replicass"),
    ],
    ids=["typo", "type", "enum", "nested-typo"],
)
def test_helm_template_refuses_a_bad_deployment_spec(helm: str, values: list[str], field: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *DEPLOYMENT, *values)
    assert result.returncode != 0, f"accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert "deployments/0/spec" in result.stderr and field in result.stderr, result.stderr


def test_helm_lint_refuses_a_typo_and_passes_the_production_values(helm: str) -> None:
    bad = run_helm(
        helm, "lint", "--strict", str(CHART), *DEPLOYMENT, "--set", "deployments[0].spec.prefil.instances=1"
    )
    assert bad.returncode != 0 and "prefil" in bad.stdout + bad.stderr
    good = run_helm(helm, "lint", "--strict", str(CHART), "--values", str(PRODUCTION_VALUES))
    assert good.returncode == 0, good.stdout + good.stderr
