"""With the routers in the decode pods, the operator asks the decode pods, and a draining one
until it is unready and idle (pdserve.operator.dataplane.routers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pdserve.deployment.plan.drain import RouterReport, drain_verdict
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.operator.dataplane import routers as routers_module
from pdserve.operator.dataplane.routers import Routers
from tests.unit.test_deployment_objects import shape_manifest


def pod(name: str, ip: str, ready: bool) -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name}, "status": {"podIP": ip, "conditions": [condition]}}


class FakeKube:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.selectors: list[str] = []

    def list_objects(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.selectors.append(selector)
        return self.pods


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> dict[str, RouterReport]:
    """What each pod's /routing/served says (by pod name)."""
    table: dict[str, RouterReport] = {}

    async def fetch(
        targets: Sequence[tuple[str, str]], port: int, deployment: str, timeout: float
    ) -> list[RouterReport]:
        return [table[name] for name, _ in targets]

    monkeypatch.setattr(routers_module, "fetch_reports", fetch)
    return table


def test_a_draining_decode_is_asked_until_unready_and_idle(answers: dict[str, RouterReport]) -> None:
    pdd = parse_pddeployment(shape_manifest("2P_TP8-2D_TP8", "nixl", router={"placement": "decode-sidecar"}))
    d0, d1 = "r1-decode-0-aaaaa", "r1-decode-1-bbbbb"
    kube = FakeKube([pod(d0, "10.0.0.1", True), pod(d1, "10.0.0.2", True)])
    routers = Routers(kube)  # type: ignore[arg-type]
    answers[d0] = RouterReport(d0, 5, "r1", {d0: 0})
    answers[d1] = RouterReport(d1, 5, "r1", {d1: 0})
    reports = routers.ask(pdd, {d1})
    assert kube.selectors == ["pdserve.io/deployment=r1,pdserve.io/role=decode"]
    # still Ready: the Service may still send it requests
    assert drain_verdict(d1, 5, 0.0, 1.0, 30, reports).waiting_for == (f"{d1}: still routes to {d1}",)
    kube.pods[1] = pod(d1, "10.0.0.2", False)  # its sidecar turned unready
    answers[d1] = RouterReport(d1, 5, "r1", {d1: 2})
    reports = routers.ask(pdd, {d1})
    assert [r.pod for r in reports] == [d0, d1]  # asked although unready
    assert drain_verdict(d1, 5, 0.0, 1.0, 30, reports).waiting_for == (f"{d1}: 2 in flight to {d1}",)
    answers[d1] = RouterReport(d1, 5, "r1", {d1: 0})
    assert drain_verdict(d1, 5, 0.0, 1.0, 30, routers.ask(pdd, {d1})).done


def test_default_placement_asks_only_ready_router_pods(answers: dict[str, RouterReport]) -> None:
    pdd = parse_pddeployment(shape_manifest("2P_TP8-2D_TP8", "nixl"))
    kube = FakeKube([pod("r1-router-x", "10.0.0.3", True), pod("r1-router-y", "10.0.0.4", False)])
    answers["r1-router-x"] = RouterReport("r1-router-x", 5, "r1", {})
    reports = Routers(kube).ask(pdd, {"r1-router-y"})  # type: ignore[arg-type]
    assert kube.selectors == ["pdserve.io/deployment=r1,app.kubernetes.io/component=router"]
    assert [r.pod for r in reports] == ["r1-router-x"]
