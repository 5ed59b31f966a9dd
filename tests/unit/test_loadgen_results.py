"""Results computed from synthetic request records: percentiles, ITL/TPOT, goodput under SLOs,
throughput, the timeline, and the engines' counters (prefix-cache hit ratio, load per slot)."""

from __future__ import annotations

import pytest

from pdserve.loadgen.client import read_chunk
from pdserve.loadgen.engines import DiscoveryError, targets_from_debug
from pdserve.loadgen.metrics import (
    HITS,
    QUERIES,
    RUNNING,
    SUCCESS,
    Slot,
    Snapshot,
    engine_summary,
    load_series,
    parse_metrics,
)
from pdserve.loadgen.results import RequestRecord, Slo, distribution, percentile, summarize, timeline


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert distribution(list(map(float, range(1, 101)))) == {
        "mean": 50.5,
        "p50": 50.5,
        "p90": 90.1,
        "p99": 99.01,
        "max": 100.0,
    }
    assert distribution([]) is None


def _record(
    i: int, sent: float, ttft_ms: float, itl_ms: float, tokens: int, error: str | None = None
) -> RequestRecord:
    r = RequestRecord(i, scheduled_s=sent, input_length=100, output_length=tokens, sent_s=sent)
    if error:
        r.error, r.end_s = error, sent + 0.001
        return r
    r.first_token_s = sent + ttft_ms / 1000
    r.chunk_s = [r.first_token_s + k * itl_ms / 1000 for k in range(1, tokens)]
    r.chunks = tokens
    r.output_tokens = tokens
    r.end_s = (r.chunk_s or [r.first_token_s])[-1]
    return r


def test_ttft_itl_tpot_and_e2e() -> None:
    r = _record(0, 1.0, ttft_ms=100, itl_ms=20, tokens=6)
    assert r.ttft_ms == pytest.approx(100)
    assert r.itls_ms() == pytest.approx([20] * 5)
    assert r.tpot_ms() == pytest.approx(20)
    assert r.e2e_ms == pytest.approx(200)
    one = _record(1, 0.0, ttft_ms=50, itl_ms=0, tokens=1)
    assert one.itls_ms() == [] and one.tpot_ms() is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        _record(0, 0.0, ttft_ms=100, itl_ms=10, tokens=11),  # good
        _record(1, 0.5, ttft_ms=300, itl_ms=10, tokens=11),  # TTFT too slow
        _record(2, 1.0, ttft_ms=100, itl_ms=40, tokens=11),  # ITL too slow
        _record(3, 1.5, ttft_ms=150, itl_ms=0, tokens=1),  # no ITL: meets it
        _record(4, 1.8, ttft_ms=1, itl_ms=1, tokens=5, error="http-503: overloaded"),
    ]
    s = summarize(records, Slo(ttft_ms=200, itl_ms=20))
    assert (s["completed"], s["failed"], s["failures"]) == (4, 1, {"http-503": 1})
    good = s["goodput"]
    assert good["good"] == 2 and good["share"] == 0.4
    duration = 1.801  # first send to the last end (the failed request, at 1.8 s + 1 ms)
    assert s["duration_s"] == pytest.approx(duration, abs=1e-3)
    assert good["request_throughput"] == pytest.approx(2 / duration, rel=1e-3)
    assert s["request_throughput"] == pytest.approx(4 / duration, rel=1e-3)
    assert s["output_token_throughput"] == pytest.approx(34 / duration, rel=1e-3)
    assert s["ttft_ms"]["p50"] == pytest.approx(125)
    assert s["ttft_ms"]["max"] == pytest.approx(300)
    assert len([x for r in records[:4] for x in r.itls_ms()]) == 30
    assert summarize(records)["goodput"] is None
    assert summarize(records, Slo(ttft_ms=120))["goodput"]["good"] == 2


def test_send_lag_and_cached_tokens_from_usage() -> None:
    records = [_record(i, 0.1 * i, 10, 1, 2) for i in range(4)]
    records[1].sent_s = records[1].scheduled_s + 0.005  # 5 ms late
    records[0].prompt_tokens, records[0].cached_tokens = 100, 64
    records[2].prompt_tokens, records[2].cached_tokens = 100, 0
    s = summarize(records)
    assert s["send_lag_ms"]["max"] == pytest.approx(5)
    assert s["usage_cached_tokens"] == {
        "requests": 2,
        "cached_tokens": 64,
        "prompt_tokens": 200,
        "hit_ratio": 0.32,
    }


def test_unsent_requests_are_not_failures() -> None:
    records = [_record(0, 0.0, 10, 1, 2), RequestRecord(1, 5.0, 10, 1)]
    s = summarize(records)
    assert (s["completed"], s["failed"], s["not_sent"]) == (1, 0, 1)


def test_timeline_counts_sends_ends_and_requests_in_flight_per_bin() -> None:
    records = [
        _record(0, 0.2, ttft_ms=100, itl_ms=100, tokens=20),  # 0.2 .. 2.2
        _record(1, 0.5, ttft_ms=100, itl_ms=0, tokens=1),  # 0.5 .. 0.6
        _record(2, 1.5, ttft_ms=10, itl_ms=1, tokens=3, error="timeout: x"),  # ends in bin 1
    ]
    bins = timeline(records, 1.0)
    assert [(b["sent"], b["completed"], b["failed"], b["in_flight"]) for b in bins] == [
        (2, 1, 0, 1),
        (1, 0, 1, 1),
        (0, 1, 0, 0),
    ]
    assert bins[0]["ttft_ms_p50"] == pytest.approx(100) and bins[1]["ttft_ms_p50"] is None


def test_stream_chunks_give_token_times_and_usage() -> None:
    r = RequestRecord(0, 0.0, 10, 3, sent_s=0.0)
    read_chunk(r, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.05)  # chat opening
    read_chunk(r, {"choices": [{"text": " a"}]}, 0.1)
    read_chunk(r, {"choices": [{"delta": {"content": " b"}}]}, 0.12)
    read_chunk(r, {"choices": [{"text": "", "finish_reason": "length"}]}, 0.13)
    usage = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
    read_chunk(r, {"choices": [], "usage": usage}, 0.14)
    assert (r.first_token_s, r.chunk_s, r.chunks) == (0.1, [0.12], 2)
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (10, 2, 8)
    read_chunk(r, {"error": {"message": "engine died"}}, 0.2)
    assert r.error == "stream-error: engine died"


METRICS = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="m a"} 4.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:request_prompt_tokens_bucket{engine="0",le="1.0",model_name="m"} 1.0
"""


def test_parse_metrics_sums_other_labels_per_engine_and_skips_the_rest() -> None:
    assert parse_metrics(METRICS) == {
        "0": {HITS: 640.0, QUERIES: 1000.0, SUCCESS: 5.0, RUNNING: 2.0},
        "1": {HITS: 0.0, QUERIES: 500.0, SUCCESS: 4.0},
    }


def _snap(t: float, **slots: dict[str, float]) -> Snapshot:
    out = Snapshot(t)
    for key, values in slots.items():
        role, instance, engine = key.split("__")
        out.slots[Slot(role, instance, engine)] = values
    return out


def test_engine_summary_takes_the_difference_per_slot_and_role() -> None:
    before = _snap(
        0,
        prefill__p0__0={HITS: 100, QUERIES: 1000, SUCCESS: 1},
        prefill__p0__1={HITS: 0, QUERIES: 0, SUCCESS: 0},
        decode__d0__0={SUCCESS: 1},
    )
    after = _snap(
        5,
        prefill__p0__0={HITS: 700, QUERIES: 2000, SUCCESS: 4},
        prefill__p0__1={HITS: 200, QUERIES: 1000, SUCCESS: 2},
        decode__d0__0={SUCCESS: 7},
        decode__d1__0={SUCCESS: 3},  # restarted: its counters went down
    )
    before.slots[Slot("decode", "d1", "0")] = {SUCCESS: 9}
    summary = engine_summary(before, after)
    prefill = summary["by_role"]["prefill"]
    assert (prefill["prefix_cache_hits"], prefill["prefix_cache_queries"]) == (800, 2000)
    assert prefill["prefix_cache_hit_ratio"] == 0.4
    assert prefill["requests"] == 5 and prefill["imbalance"] == pytest.approx(1.2)
    assert summary["slots"]["prefill/p0/0"]["prefix_cache_hit_ratio"] == 0.6
    assert summary["slots"]["decode/d0/0"]["requests"] == 6
    assert summary["slots"]["decode/d0/0"]["prefix_cache_hit_ratio"] is None
    assert summary["restarted"] == ["decode/d1/0"]


def test_load_series_sums_running_per_role() -> None:
    snaps = [_snap(1, prefill__p__0={RUNNING: 2}, prefill__p__1={RUNNING: 3}, decode__d__0={RUNNING: 1})]
    assert load_series(snaps) == [
        {
            "t_s": 1,
            "decode_running": 1,
            "decode_waiting": 0,
            "decode_kv_usage": None,
            "prefill_running": 5,
            "prefill_waiting": 0,
            "prefill_kv_usage": None,
        }
    ]


def test_engines_and_router_counts_from_the_routers_debug_view() -> None:
    table = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "RoutingTable",
        "deployment": "d",
        "generation": 3,
        "connector": {"type": "nixl"},
        "prefill": [{"name": "p0", "url": "http://127.0.0.1:9001", "dpSize": 2, "ready": True}],
        "decode": [
            {
                "name": "d0",
                "url": "http://127.0.0.1:9002",
                "dpSize": 4,
                "ready": True,
                "endpoints": [
                    {"url": "http://127.0.0.1:9002", "firstRank": 0, "ranks": 2},
                    {"url": "http://127.0.0.1:9003", "firstRank": 2, "ranks": 2},
                ],
            },
        ],
    }
    slots = {"prefill": [{"slot": "p0/0", "requests": 5}, {"slot": "p0/1", "requests": 4}], "decode": []}
    targets, counts = targets_from_debug({"table": table, "slots": slots})
    assert [(t.role, t.instance, t.url) for t in targets] == [
        ("prefill", "p0", "http://127.0.0.1:9001"),
        ("decode", "d0", "http://127.0.0.1:9002"),
        ("decode", "d0", "http://127.0.0.1:9003"),
    ]
    assert counts == {"prefill/p0/0": 5, "prefill/p0/1": 4}
    with pytest.raises(DiscoveryError, match="no routing table"):
        targets_from_debug({"table": None})
    with pytest.raises(DiscoveryError, match="does not parse"):
        targets_from_debug({"table": {**table, "kind": "Other"}})
