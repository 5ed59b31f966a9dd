"""The operator's reconcile passes as spans, and spec.tracing through the real API server.

`pdserve operator --otlp-traces-endpoint` against the test cluster, its spans read back from the
real collector (tests/support/otelcol.py): a rollout (a template change of the decode role) is
one trace, a ``rollout`` span whose children are the passes that carried it out, each with its
steps. The CRD's schema takes spec.tracing and refuses an endpoint no exporter could use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import KubeCluster, KubeCommandError, eventually
from tests.support.operator import WAIT, Cluster, Operator, pdd_manifest, pod_ready, ready
from tests.support.otelcol import FAST_EXPORT, Collector, ExportedSpan

pytestmark = pytest.mark.cluster


def rollouts(spans: list[ExportedSpan], generation: int) -> list[ExportedSpan]:
    return [s for s in spans if s.name == "rollout" and s.attributes.get("pdserve.generation") == generation]


def test_a_rollout_is_one_trace_of_its_reconcile_passes(
    pdd_crd: KubeCluster,
    kube_namespace: str,
    cluster: Cluster,
    otelcol: Collector,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in FAST_EXPORT.items():
        monkeypatch.setenv(name, value)
    operator = Operator(
        pdd_crd.kubeconfig,
        kube_namespace,
        tmp_path / "operator.log",
        extra_args=["--otlp-traces-endpoint", otelcol.http_endpoint],
    )
    operator.start()
    try:
        cluster.apply(pdd_manifest("traced", decode_instances=2))
        eventually(lambda: ready(cluster, "traced"), timeout=WAIT, message="Ready=True")
        old_hash = cluster.status("traced")["decode"]["templateHash"]
        cluster.apply(pdd_manifest("traced", decode_instances=2, decode_args=["--max-num-seqs", "64"]))

        def rolled() -> bool:
            pods = [
                p for p in cluster.pods("traced") if p["metadata"]["labels"]["pdserve.io/role"] == "decode"
            ]
            hashes = {p["metadata"]["labels"]["pdserve.io/template-hash"] for p in pods}
            return (
                len(pods) == 2
                and old_hash not in hashes
                and all(map(pod_ready, pods))
                and ready(cluster, "traced")
            )

        eventually(rolled, timeout=90, message="decode rolled to the new template")
        spans = otelcol.wait_for(lambda s: bool(rollouts(s, 2)), what="the rollout span of generation 2")
    finally:
        operator.stop()

    creation = rollouts(spans, 1)[0]  # creating the deployment was a rollout too
    rollout = rollouts(spans, 2)[0]
    assert rollout.service == "pdserve-operator" and rollout.parent_id == ""
    assert rollout.attributes["pdserve.rollout.outcome"] == "Complete"
    assert rollout.attributes["pdserve.deployment"] == "traced"
    assert creation.trace_id != rollout.trace_id
    passes = [s for s in spans if s.trace_id == rollout.trace_id and s.name == "reconcile"]
    assert passes and all(p.parent_id == rollout.span_id for p in passes)
    assert all(p.attributes["pdserve.generation"] == 2 for p in passes)
    # The rollout starts at Progressing's lastTransitionTime (whole seconds) and ends with its last pass.
    assert all(rollout.start_ns - 10**9 <= p.start_ns and p.end_ns <= rollout.end_ns for p in passes)
    steps = {s.name for s in spans if s.parent_id in {p.span_id for p in passes}}
    assert {"drain", "routing_table", "create_pods", "delete_pods", "apply_objects", "status"} <= steps
    events = {e for p in passes for e in p.events}
    assert {"Draining", "Deleted"} <= events
    assert any(p.attributes["pdserve.routing_written"] for p in passes)


def test_spec_tracing_through_the_api_server(cluster: Cluster) -> None:
    """The CRD takes spec.tracing with its default ratio and refuses an unusable endpoint."""
    doc: dict[str, Any] = pdd_manifest("withtracing")
    doc["spec"]["tracing"] = {"endpoint": "grpc://collector.observability:4317"}
    cluster.apply(doc)
    stored = json.loads(cluster.kubectl("get", "pdd", "withtracing", "-o", "json"))
    assert stored["spec"]["tracing"] == {
        "endpoint": "grpc://collector.observability:4317",
        "samplingRatio": 1,
    }
    doc["spec"]["tracing"] = {"endpoint": "collector:4317"}
    with pytest.raises(KubeCommandError) as info:
        cluster.apply(doc)
    assert "spec.tracing.endpoint" in str(info.value)
    doc["spec"]["tracing"] = {"endpoint": "http://c:4318", "samplingRatio": 1.5}
    with pytest.raises(KubeCommandError) as info:
        cluster.apply(doc)
    assert "spec.tracing.samplingRatio" in str(info.value)
