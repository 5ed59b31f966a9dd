"""Metric families as data (pdserve.wire.prometheus): what the router, the operator and the
simulator declare is what they export, and the HELP/TYPE lines pdserve writes by hand (the
simulator's text, the router's families no worker has sampled yet) are prometheus_client's."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import pdserve.operator.metrics as operator_metrics
from pdserve.proxy.metrics import FAMILIES as ROUTER
from pdserve.proxy.metrics import PREFIX_FAMILIES, PrefixMetrics, ProxyMetrics
from pdserve.sim.engine.metrics import FAMILIES as SIMULATOR
from pdserve.sim.engine.metrics import RankMetrics
from pdserve.wire.prometheus import Family, register

KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
ODD = Family("t_odd", "counter", 'A help with a back\\slash,\na newline and "quotes"', ("a",))


@pytest.mark.parametrize(
    "family",
    [
        ODD,
        Family("t_gauge", "gauge", "A gauge.", combine="livesum"),
        Family("t_seconds", "histogram", "A histogram.", ("role",), buckets=(0.5, 2)),
        *ROUTER.values(),
        *operator_metrics.FAMILIES.values(),
    ],
    ids=lambda f: f.name,
)
def test_the_header_is_prometheus_clients(family: Family) -> None:
    registry = CollectorRegistry()
    register({"m": family}, registry)
    help_line, type_line = family.header()
    text = generate_latest(registry).decode().splitlines()
    assert text[:2] == [help_line, type_line]


def test_register_builds_what_the_family_says() -> None:
    registry = CollectorRegistry()
    families = {
        "count": Family("t_count", "counter", "Counted.", ("role",)),
        "level": Family("t_level", "gauge", "Level.", combine="livemin"),
        "wait": Family("t_wait", "histogram", "Waited.", buckets=(0.5, 2)),
    }
    metrics = register(families, registry)
    assert {key: type(m) for key, m in metrics.items()} == {
        "count": Counter,
        "level": Gauge,
        "wait": Histogram,
    }
    metrics["count"].labels("prefill").inc(3)
    metrics["wait"].observe(1)
    text = generate_latest(registry).decode()
    assert 't_count_total{role="prefill"} 3.0' in text
    assert 't_wait_bucket{le="0.5"} 0.0' in text
    assert 't_wait_bucket{le="2.0"} 1.0' in text
    assert metrics["level"]._multiprocess_mode == "livemin"
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        register({"again": families["count"]}, registry)


def test_every_router_family_is_an_attribute_of_its_kind() -> None:
    metrics = ProxyMetrics()
    prefix = PrefixMetrics(CollectorRegistry())
    for owner, table in ((metrics, ROUTER), (prefix, PREFIX_FAMILIES)):
        for key, family in table.items():
            assert isinstance(getattr(owner, key), KINDS[family.kind]), key
    exported = {family.name for family in metrics.registry.collect()}
    assert exported == {family.name for family in ROUTER.values()}


def test_every_operator_family_is_a_module_constant_annotated_with_its_kind() -> None:
    annotations = operator_metrics.__annotations__
    for key, family in operator_metrics.FAMILIES.items():
        assert isinstance(getattr(operator_metrics, key), KINDS[family.kind]), key
        assert annotations[key] == KINDS[family.kind].__name__, key


def test_the_simulator_counts_every_histogram_family_it_declares() -> None:
    histograms = [f for f in SIMULATOR.values() if f.kind == "histogram"]
    counted = RankMetrics().histograms
    assert list(counted) == [f.name for f in histograms]
    assert all(counted[f.name].bounds == f.buckets and f.buckets for f in histograms)
