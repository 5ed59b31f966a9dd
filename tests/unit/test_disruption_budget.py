"""The per-role PodDisruptionBudget: the field's parsing and defaults, and what is rendered from it.

The eviction path itself (kubectl drain, the Eviction API's 429) is tested on the API server in
tests/integration/test_operator_disruption.py.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from pdserve.deployment import cli as render_cli
from pdserve.deployment.render.engine_pod import instance_pod, template_hash
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.names import disruption_budget_name, role_selector
from pdserve.deployment.render.static_objects import disruption_budget
from pdserve.deployment.spec.parse import SpecError, parse_pddeployment
from pdserve.deployment.spec.pddeployment import DisruptionBudgetSpec, PDDeployment
from pdserve.local.plan import SimTimings, plan_local_run
from pdserve.routing import Role
from tests.support import specs

UID = "0b8e7c1e-55a4-4c53-8f4e-3d2b1f0a9c11"


def manifest(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None) -> dict[str, Any]:
    return specs.manifest(
        "m",
        metadata={"namespace": "serving", "uid": UID},
        model="Qwen/Qwen3-0.6B",
        image="vllm/vllm-openai:v0.11.0",
        prefill={"instances": 2, **(prefill or {})},
        decode={"instances": 3, **(decode or {})},
    )


def pdd_of(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None) -> PDDeployment:
    return parse_pddeployment(manifest(prefill, decode))


def budget(value: object, instances: int = 4) -> dict[str, Any]:
    pdd = pdd_of(decode={"instances": instances, "disruptionBudget": {"maxUnavailable": value}})
    return disruption_budget(pdd, Role.DECODE)


def test_default_is_one_unavailable_per_role() -> None:
    pdd = pdd_of()
    assert pdd.spec.prefill.disruption_budget == DisruptionBudgetSpec(1)
    assert pdd.spec.decode.disruption_budget.max_unavailable == 1
    prefill, decode = disruption_budget(pdd, Role.PREFILL), disruption_budget(pdd, Role.DECODE)
    assert prefill["spec"]["minAvailable"] == 1  # 2 instances, 1 may go
    assert decode["spec"]["minAvailable"] == 2  # 3 instances, 1 may go


def test_budget_selects_exactly_its_roles_engine_pods() -> None:
    pdd = pdd_of()
    for role in (Role.PREFILL, Role.DECODE):
        pdb = disruption_budget(pdd, role)
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["kind"] == "PodDisruptionBudget"
        assert pdb["metadata"]["name"] == disruption_budget_name(pdd, role) == f"m-{role.value}"
        assert pdb["metadata"]["namespace"] == "serving"
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == UID  # garbage-collected with the PDDeployment
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector == role_selector(pdd, role)
        own = instance_pod(pdd, role, 0)["metadata"]["labels"]
        other = instance_pod(pdd, Role.DECODE if role is Role.PREFILL else Role.PREFILL, 0)["metadata"][
            "labels"
        ]
        assert all(own[k] == v for k, v in selector.items())
        assert not all(other.get(k) == v for k, v in selector.items())
        # A pod that is running but not Ready serves nothing: it must not block a node drain.
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        # An integer minAvailable: the disruption controller then counts the pods themselves
        # instead of asking the PDDeployment's scale subresource (which is decode's).
        assert "maxUnavailable" not in pdb["spec"]


@pytest.mark.parametrize(
    ("value", "instances", "min_available"),
    [
        (1, 4, 3),
        (2, 4, 2),
        (0, 4, 4),  # blocks every eviction
        (9, 4, 0),  # more than there are: all may go
        ("25%", 4, 3),
        ("30%", 4, 2),  # 1.2 rounds up to 2, as Kubernetes rounds maxUnavailable
        ("50%", 3, 1),
        ("0%", 3, 3),
        ("100%", 3, 0),
        ("1%", 1, 0),
        (1, 1, 0),  # a lone instance is not protected by the default
        (1, 0, 0),  # no instances: a budget over no pods
        ("50%", 0, 0),
    ],
)
def test_max_unavailable_becomes_min_available(value: object, instances: int, min_available: int) -> None:
    assert budget(value, instances)["spec"]["minAvailable"] == min_available


def test_render_shows_both_budgets_and_they_follow_the_instance_count() -> None:
    pdd = pdd_of(decode={"instances": 5, "disruptionBudget": {"maxUnavailable": 2}})
    pdbs = {
        o["metadata"]["name"]: o["spec"]["minAvailable"]
        for o in render_all(pdd)
        if o["kind"] == "PodDisruptionBudget"
    }
    assert pdbs == {"m-prefill": 1, "m-decode": 3}
    scaled = dataclasses.replace(
        pdd, spec=dataclasses.replace(pdd.spec, decode=dataclasses.replace(pdd.spec.decode, instances=2))
    )
    assert disruption_budget(scaled, Role.DECODE)["spec"]["minAvailable"] == 0


def test_render_cli_prints_the_budgets(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(manifest(decode={"disruptionBudget": {"maxUnavailable": "50%"}})))
    assert render_cli.run(argparse.Namespace(file=str(path), output="yaml")) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    pdbs = {
        d["metadata"]["name"]: d["spec"]["minAvailable"] for d in docs if d["kind"] == "PodDisruptionBudget"
    }
    assert pdbs == {"m-prefill": 1, "m-decode": 1}  # 50% of 3 rounds up to 2 unavailable


def test_budget_changes_do_not_roll_pods() -> None:
    """The budget is not part of a pod: changing it must not replace every instance."""
    before, after = pdd_of(), pdd_of(decode={"disruptionBudget": {"maxUnavailable": "100%"}})
    for role in (Role.PREFILL, Role.DECODE):
        assert template_hash(before, role) == template_hash(after, role)
        assert instance_pod(before, role, 0) == instance_pod(after, role, 0)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (-1, "expected an integer >= 0"),
        (1025, "expected an integer <= 1024"),
        (True, "expected an integer >= 0"),
        (1.5, "expected an integer >= 0"),
        ("1", 'expected an integer or a percentage from "0%" to "100%", got "1"'),
        ("101%", "percentage"),
        ("-5%", "percentage"),
        ("05%", "percentage"),
        ("", "percentage"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(value: object, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        pdd_of(prefill={"disruptionBudget": {"maxUnavailable": value}})
    assert info.value.path == "spec.prefill.disruptionBudget.maxUnavailable"
    assert reason in info.value.reason


def test_unknown_budget_fields_are_refused() -> None:
    with pytest.raises(SpecError, match="unknown field"):
        pdd_of(decode={"disruptionBudget": {"minAvailable": 1}})
    with pytest.raises(SpecError) as info:
        pdd_of(decode={"disruptionBudget": None})
    assert info.value.path == "spec.decode.disruptionBudget"


def test_local_mode_ignores_the_budget() -> None:
    """`pdserve up` runs processes, not pods: nothing evicts them, so there is nothing to render."""
    plain = pdd_of(prefill={"instances": 1}, decode={"instances": 1})
    guarded = pdd_of(
        prefill={"instances": 1, "disruptionBudget": {"maxUnavailable": 0}},
        decode={"instances": 1, "disruptionBudget": {"maxUnavailable": "50%"}},
    )

    def plan(pdd: PDDeployment) -> Any:
        return plan_local_run(
            pdd, "sim", [9001, 9002], 8000, "/run/routing.json", SimTimings(), "/usr/bin/python3"
        )

    a, b = plan(guarded), plan(plain)
    assert (a.engines, a.routers, a.notes) == (b.engines, b.routers, b.notes)
