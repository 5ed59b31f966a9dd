"""The chart's monitors scrape what the operator really renders, where it serves metrics.

The PodMonitors select pods by labels and ports by name: they are checked against the pods
pdserve renders (the operator's own builders) for both router placements, and the dashboard's
selectors against the labels the monitors attach (helm from the test cluster's build).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from pdserve.deployment.render.groups import render_all
from tests.support import specs
from tests.unit.test_chart import CASES, CHART, by_kind, helm, objects, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py


def _pods(placement: str) -> list[dict[str, Any]]:
    """Every pod template pdserve renders for an engine: sim deployment (router pods included)."""
    pdd = specs.pdd_of(
        "chat", metadata={"namespace": "serving"}, engine="sim", image=None, router={"placement": placement}
    )
    pods = []
    for obj in render_all(pdd):
        if obj["kind"] == "Pod":
            pods.append({"labels": obj["metadata"]["labels"], "spec": obj["spec"]})
        elif obj["kind"] == "Deployment":
            template = obj["spec"]["template"]
            pods.append({"labels": template["metadata"]["labels"], "spec": template["spec"]})
    return pods


def _scraped(monitor: dict[str, Any], pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(role label or component, container port) of every target the monitor finds."""
    wanted = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    found = []
    for pod in pods:
        if wanted.items() <= pod["labels"].items():
            for container in pod["spec"]["containers"]:
                for port in container.get("ports", []):
                    if port["name"] in ports:
                        found.append(
                            (
                                pod["labels"]["app.kubernetes.io/component"],
                                f"{container['name']}:{port['name']}",
                            )
                        )
    return sorted(found)


@pytest.fixture(scope="module")
def monitors(helm: str) -> dict[str, dict[str, Any]]:
    docs = objects(render(helm, CASES["production"]))
    return {d["metadata"]["name"].rsplit("-", 1)[1]: d for d in by_kind(docs, "PodMonitor")}


def test_production_values_scrape_operator_routers_and_engines(helm: str, monitors: dict[str, Any]) -> None:
    docs = objects(render(helm, CASES["production"]))
    assert by_kind(docs, "ServiceMonitor"), "the operator's ServiceMonitor is on in production"
    assert sorted(monitors) == ["engines", "routers"]
    assert not by_kind(objects(render(helm)), "PodMonitor"), "PodMonitors are opt-in"


def test_router_pods_are_scraped_on_their_admin_port(monitors: dict[str, Any]) -> None:
    assert _scraped(monitors["routers"], _pods("deployment")) == [("router", "router:admin")]
    assert _scraped(monitors["engines"], _pods("deployment")) == [
        ("decode", "engine:http"),
        ("prefill", "engine:http"),
    ]


def test_sidecar_routers_are_scraped_in_the_decode_pods(monitors: dict[str, Any]) -> None:
    assert _scraped(monitors["routers"], _pods("decode-sidecar")) == []
    assert _scraped(monitors["engines"], _pods("decode-sidecar")) == [
        ("decode", "engine:http"),
        ("decode", "router:admin"),
        ("prefill", "engine:http"),
    ]


def test_the_dashboard_selects_by_the_labels_the_monitors_attach(monitors: dict[str, Any]) -> None:
    attached = {"namespace", "pod", "container", "job", "instance"}
    for monitor in monitors.values():
        # Prometheus turns a pod label into a target label with [^a-zA-Z0-9_] replaced by _.
        attached |= {re.sub(r"[^a-zA-Z0-9_]", "_", label) for label in monitor["spec"]["podTargetLabels"]}
    dashboard = json.loads((CHART / "files" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {m for e in exprs for m in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!=|!~|=)\s*\"", e)}
    used |= {m for e in exprs for m in re.findall(r"label_values\([^,]*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", e)}
    assert "pdserve_io_deployment" in used
    assert used <= attached | {"outcome", "role", "slot"}, used - attached
