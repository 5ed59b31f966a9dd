"""The load view a router reports (pdserve.wire.load, pdserve.proxy.state.load) and how the
autoscaler reads it and the engines' metrics (pdserve.deployment.plan.signals)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.deployment.plan.signals import (
    EngineLoad,
    RouterLoad,
    combine,
    parse_engine_metrics,
    parse_load,
)
from pdserve.proxy.state.load import LoadWindow
from pdserve.wire.load import (
    FACTOR,
    HISTORY_SECONDS,
    add_series,
    bucket_of,
    bucket_value,
    counts_from_json,
    counts_to_json,
    mean,
    merge_views,
    percentile,
)


@given(st.floats(min_value=1e-4, max_value=500.0))
def test_a_bucket_stands_for_its_values_within_five_percent(seconds: float) -> None:
    value = bucket_value(bucket_of(seconds))
    assert abs(value / seconds - 1) <= math.sqrt(FACTOR) - 1 + 1e-9


@given(st.lists(st.floats(min_value=0.001, max_value=100.0), min_size=1, max_size=300), st.floats(50, 99.9))
def test_percentile_of_a_histogram_is_the_nearest_rank_within_the_bucket_error(
    samples: list[float], p: float
) -> None:
    counts: dict[int, int] = {}
    for s in samples:
        counts[bucket_of(s)] = counts.get(bucket_of(s), 0) + 1
    exact = sorted(samples)[max(1, math.ceil(p / 100 * len(samples))) - 1]
    got = percentile(counts, p)
    assert got is not None
    assert abs(got / exact - 1) <= math.sqrt(FACTOR) - 1 + 1e-9


def test_empty_histograms_have_no_percentile_or_mean() -> None:
    assert percentile({}, 90) is None and mean({}) is None


def test_counts_round_trip_and_bad_ones_are_named() -> None:
    counts = {3: 2, 40: 7}
    assert counts_from_json(counts_to_json(counts)) == counts
    with pytest.raises(ValueError, match="bucket 'x' is not an integer"):
        counts_from_json({"x": 1})
    with pytest.raises(ValueError, match="count -1"):
        counts_from_json({"3": -1})
    with pytest.raises(ValueError, match="outside"):
        counts_from_json({"9999": 1})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_counts_only_its_last_seconds() -> None:
    clock = Clock()
    window = LoadWindow(clock)
    window.observe("ttft", 0.5)
    window.ended(True)
    clock.now += 30
    window.observe("ttft", 2.0)
    window.observe("itl", 0.02)
    window.ended(False)
    view = window.view(10)
    assert view["requests"] == {"ok": 0, "failed": 1}
    assert view["latency"]["ttft"] == {str(bucket_of(2.0)): 1}
    assert view["covered_seconds"] == 10
    whole = window.view(60)
    assert whole["requests"] == {"ok": 1, "failed": 1}
    assert whole["covered_seconds"] == 30  # up for 30 s only
    clock.now += HISTORY_SECONDS + 1
    assert window.view(HISTORY_SECONDS)["requests"] == {"ok": 0, "failed": 0}


def test_arrivals_are_counted_second_by_second_the_latest_last() -> None:
    clock = Clock()
    clock.now = 100.2
    window = LoadWindow(clock)
    window.started()
    clock.now += 2
    window.started()
    window.started()
    assert window.view(5)["started"] == [0, 0, 1, 0, 2]
    clock.now += 3  # nothing since: the window moves on
    assert window.view(5)["started"] == [0, 2, 0, 0, 0]
    assert len(window.view(60)["started"]) == 60


def test_arrivals_of_routers_add_up_second_by_second_from_the_latest() -> None:
    assert add_series([1, 2, 3], [10, 20]) == [1, 12, 23]
    assert add_series([], [4]) == [4]
    merged = merge_views([{"started": [1, 2, 3]}, {"started": [5, 5, 5, 5]}])
    assert merged["started"] == [5, 6, 7, 8]


def test_views_of_workers_add_up() -> None:
    a = {
        "deployment": "d",
        "window_seconds": 60,
        "covered_seconds": 60,
        "requests": {"ok": 3, "failed": 1},
        "latency": {"ttft": {"10": 2}},
        "in_flight": {"prefill": 1, "decode": 4},
        "queued": 2,
    }
    b = {**a, "covered_seconds": 20, "latency": {"ttft": {"10": 1, "12": 5}}, "queued": 0}
    merged = merge_views([a, b])
    assert merged["requests"] == {"ok": 6, "failed": 2}
    assert merged["latency"]["ttft"] == {"10": 3, "12": 5}
    assert merged["in_flight"] == {"prefill": 2, "decode": 8}
    assert merged["queued"] == 2 and merged["covered_seconds"] == 20


def test_a_router_load_is_parsed_and_bad_answers_say_why() -> None:
    doc = merge_views([{"deployment": "d", "window_seconds": 60, "covered_seconds": 60}])
    doc["requests"] = {"ok": 5, "failed": 0}
    report = parse_load("r1", doc, "d")
    assert report.error is None and report.ok == 5
    assert parse_load("r1", {**doc, "deployment": "other"}, "d").error == "serves deployment 'other', not 'd'"
    assert "unreadable /load" in str(parse_load("r1", {**doc, "queued": -1}, "d").error)
    assert "unreadable /load" in str(parse_load("r1", {**doc, "latency": {"ttft": {"a": 1}}}, "d").error)
    assert parse_load("r1", {**doc, "started": [1, 0, 2]}, "d").started == (1, 0, 2)
    assert "started: count -1" in str(parse_load("r1", {**doc, "started": [1, -1]}, "d").error)
    assert "started must be a list" in str(parse_load("r1", {**doc, "started": 3}, "d").error)
    assert parse_load("r1", [], "d").error == "/load did not answer a JSON object"


METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3
"""


def test_an_engines_metrics_sum_over_its_ranks() -> None:
    load = parse_engine_metrics("d-decode-0", "decode", METRICS)
    assert (load.waiting, load.running) == (4, 12)
    assert load.kv_usage == pytest.approx(0.4)
    assert parse_engine_metrics("x", "decode", "not { prometheus").error is not None


def test_combine_adds_routers_and_engines_and_lists_what_did_not_answer() -> None:
    r1 = RouterLoad("r1", 60, 60, ok=10, latency={"ttft": {5: 10}}, in_flight={"prefill": 1, "decode": 2})
    r2 = RouterLoad("r2", 60, 40, ok=5, failed=1, latency={"ttft": {5: 5}}, in_flight={"decode": 1}, queued=3)
    bad = RouterLoad("r3", error="unreachable")
    engines = [
        EngineLoad("p0", "prefill", waiting=2, running=1),
        EngineLoad("d0", "decode", running=8, kv_usage=0.5),
        EngineLoad("d1", "decode", running=4, kv_usage=0.25),
        EngineLoad("d2", "decode", error="timeout"),
    ]
    s = combine(60, [r1, r2, bad], engines)
    assert s.known and s.routers == 2
    assert (s.ok, s.failed, s.requests) == (15, 1, 16)
    assert s.covered_seconds == 40 and s.rate == pytest.approx(16 / 40)
    assert s.latency["ttft"] == {5: 15}
    assert s.in_flight == {"prefill": 1, "decode": 3} and s.queued == 3
    assert s.waiting == {"prefill": 2, "decode": 0} and s.running == {"prefill": 1, "decode": 12}
    assert s.kv_usage["decode"] == pytest.approx(0.375) and s.engines == {"prefill": 1, "decode": 2}
    assert s.problems == ("router r3: unreachable", "engine d2: timeout")
    assert not combine(60, [bad], []).known


def test_read_signals_asks_every_router_and_engine_and_names_who_did_not_answer() -> None:
    import asyncio
    import json

    from pdserve.deployment.plan.fetch import GetError
    from pdserve.deployment.plan.signals import read_signals

    view = merge_views([{"deployment": "d", "window_seconds": 30, "covered_seconds": 30}])
    view["requests"] = {"ok": 7, "failed": 0}
    answers = {
        "http://r1/load?window=30": (200, json.dumps(view)),
        "http://r2/load?window=30": (503, "busy"),
        "http://p0/metrics": (200, METRICS),
    }

    async def get(url: str) -> tuple[int, str]:
        if url not in answers:
            raise GetError("ConnectionRefusedError")
        return answers[url]

    routers = [("r1", "http://r1"), ("r2", "http://r2")]
    engines = [("p0", "prefill", "http://p0"), ("d0", "decode", "http://d0")]
    s = asyncio.run(read_signals(get, "d", routers, engines, 30))
    assert s.routers == 1 and s.ok == 7 and s.waiting["prefill"] == 4
    assert s.problems == (
        "router r2: http://r2/load?window=30 answered 503",
        "engine d0: http://d0/metrics unreachable: ConnectionRefusedError",
    )
