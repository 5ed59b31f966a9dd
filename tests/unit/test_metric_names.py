"""Every metric the dashboard queries and the docs name is one that something really exports.

A PromQL query copied from docs/operations.md, or a dashboard panel, that names a series nobody
exports returns nothing and says nothing. The exported names come from the components
themselves: the router's registry (pdserve.proxy.metrics), the operator's
(pdserve.operator.metrics), the simulator's /metrics text (pdserve.sim.payloads), and real
vLLM 0.32's /metrics as recorded in tests/fixtures (which the simulator is held to in
test_vllm_fixtures.py). A counter is exported as ``<name>_total``, a histogram as ``_bucket``,
``_sum`` and ``_count``: a doc may name a histogram by its family name, never a counter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client import registry as default_registry
from prometheus_client.parser import text_string_to_metric_families

import pdserve.operator.metrics  # noqa: F401 - registers the operator's metrics
from pdserve.proxy.metrics import PrefixMetrics, ProxyMetrics
from pdserve.sim import payloads
from tests.support import vllm_fixtures

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "pdserve" / "files" / "dashboards" / "pdserve.json"
NOTES = REPO / "charts" / "pdserve" / "templates" / "NOTES.txt"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), NOTES]
NAME = re.compile(r"\b(?:pdserve_(?:proxy|operator)_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def _samples(registry: CollectorRegistry, prefix: str) -> tuple[set[str], set[str]]:
    """(sample names, histogram family names) of the registry's families starting with prefix."""
    samples: set[str] = set()
    histograms: set[str] = set()
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        if family.type == "counter":
            samples |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            samples |= {f"{family.name}{s}" for s in ("_bucket", "_sum", "_count", "_created")}
            histograms.add(family.name)
        else:
            samples.add(family.name)
    return samples, histograms


def _router() -> tuple[set[str], set[str]]:
    """The router's metrics, with the prefix-affinity policy's (registered when it routes)."""
    metrics = ProxyMetrics()
    PrefixMetrics(metrics.registry)
    return _samples(metrics.registry, "pdserve_proxy_")


def _operator() -> tuple[set[str], set[str]]:
    return _samples(default_registry.REGISTRY, "pdserve_operator_")


def _simulator() -> set[str]:
    text = payloads.metrics_text("m", [1, 0], [{"stop": 1}, {}], [5, 0], [3, 0], [5, 0])
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _real_vllm() -> tuple[set[str], set[str]]:
    samples: set[str] = set()
    histograms: set[str] = set()
    for name in ("metrics-prefill", "metrics-decode"):
        for family, info in vllm_fixtures.load(name)["families"].items():
            samples |= set(info["samples"])
            if info["type"] == "histogram":
                histograms.add(family)
    return samples, histograms


def _dashboard_names() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in board["templating"]["list"] if isinstance(v.get("query"), str)]
    return {m for e in exprs for m in NAME.findall(e)}


def test_the_sources_are_read() -> None:
    assert "pdserve_proxy_requests_total" in _router()[0]
    assert "pdserve_operator_reconciles_total" in _operator()[0]
    assert "vllm:num_requests_waiting" in _simulator() & _real_vllm()[0]


def test_dashboard_queries_name_exported_series() -> None:
    router, _ = _router()
    operator, _ = _operator()
    vllm, _ = _real_vllm()
    names = _dashboard_names()
    assert names, "no metric found in the dashboard"
    unknown = sorted(n for n in names if n not in router | operator | vllm)
    assert not unknown, f"the dashboard queries series nothing exports: {unknown}"
    # Engine panels fill on the simulator too (make demo, the test cluster), not only on GPUs.
    missing = sorted(n for n in names if n.startswith("vllm:") and n not in _simulator())
    assert not missing, f"the simulator does not export {missing}"


def test_docs_name_exported_series() -> None:
    router, router_histograms = _router()
    operator, operator_histograms = _operator()
    vllm, vllm_histograms = _real_vllm()
    known = router | operator | vllm | router_histograms | operator_histograms | vllm_histograms
    wrong = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            wrong += [f"{path.relative_to(REPO)}:{number}: {n}" for n in NAME.findall(line) if n not in known]
    assert not wrong, "docs name series nothing exports:\n" + "\n".join(wrong)
