"""The prefix-cache hit ratio a replay measures is the cache model's: a slice of the Mooncake trace,
time-compressed, through `pdserve up` with step-engine sims (prefix caching on, a KV pool small
enough that eviction matters), against an offline LRU over the trace's blocks per rank
(pdserve.loadgen.cachemodel), given which rank served each request (the prefill's own records of
the requests' X-Request-Id). Within 2 points, while the pool's size moves the offline figure by
far more than that."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pdserve.loadgen.cachemodel import hit_counts
from pdserve.loadgen.schedule import schedule
from pdserve.loadgen.trace import read_trace
from tests.support.procs import REPO, ProcessGroup, wait_routable
from tests.support.specs import sim_manifest

SLICE = REPO / "tests" / "fixtures" / "mooncake" / "slice-3600.jsonl"
BLOCK_SIZE = 16
POOL = 20_000  # blocks per prefill rank: 320k tokens, a few dozen of the slice's prompts
# A fast engine: a 20k-token prompt prefills in 20 ms, so at x5 (the 45 s slice in 9 s) requests
# seldom overlap on a rank (the offline model serves them one after another; at x10 the overlap
# already moved one rank's ratio by 2 points).
PROFILE = {
    "name": "fast-test",
    "description": "a fast engine for the replay cache test",
    "source": "tests/integration/test_replay_cache.py",
    "step": {"step_ms": 1.0, "prefill_token_ms": 0.001, "decode_seq_ms": 0.05, "context_ktoken_ms": 0.0},
    "request": {"frontend_ms": 0.0},
    "kv_transfer": {"bytes_per_token": 1024, "bandwidth_gb_per_s": 20.0, "latency_ms": 0.5},
    "engine": {
        "block_size": 16,
        "num_gpu_blocks": 40_000,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    },
}
ENGINE_ARGS = ["--max-model-len", "200000", "--block-size", str(BLOCK_SIZE)]
MANIFEST = sim_manifest(
    "cache",
    model="Qwen/Qwen2.5-0.5B-Instruct",
    servedModelName="qwen-0.5b",
    prefill={
        "instances": 1,
        "dataParallel": 2,
        # the pool counts vLLM's null block: POOL usable blocks
        "args": [*ENGINE_ARGS, "--enable-prefix-caching", "--num-gpu-blocks-override", str(POOL + 1)],
    },
    decode={"instances": 1, "dataParallel": 2, "args": ENGINE_ARGS},
)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_measured_hit_ratio_matches_the_offline_cache_model(procs: ProcessGroup, tmp_path: Path) -> None:
    profile, manifest = tmp_path / "profile.yaml", tmp_path / "cache.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    manifest.write_text(yaml.safe_dump(MANIFEST))
    up = procs.start(
        "up", ["up", str(manifest), "--no-view", "--sim-profile", str(profile)], health="/ready", timeout=60
    )
    wait_routable(up.url, proc=up.popen)

    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "replay", str(SLICE), "--url", up.url,
         "--speedup", "5", "--output", str(out), "--no-progress"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["failed"] == 0, results["summary"]["failures"]
    measured = results["engines"]["by_role"]["prefill"]

    # Which rank served each request, in the order the prefill took them.
    arrivals = {a.index: a.request for a in schedule(read_trace(SLICE))}
    run_id = results["config"]["run_id"]
    table = _get(up.url + "/debug/routing")["table"]
    order: list[tuple[int, int]] = []  # (trace index, rank)
    for record in _get(table["prefill"][0]["url"] + "/sim/stats")["recent"]:
        base, _, leg = str(record["request_id"]).rpartition("-")
        if base.startswith(run_id + "-") and leg == "p1":
            order.append((int(base.rpartition("-")[2]), int(record["rank"])))
    assert sorted(i for i, _ in order) == sorted(arrivals), "every request's prefill leg, once"

    requests = [arrivals[i] for i, _ in order]
    ranks = [rank for _, rank in order]
    offline = hit_counts(requests, ranks, BLOCK_SIZE, capacity=POOL)
    unbounded = hit_counts(requests, ranks, BLOCK_SIZE)
    hits, queries = sum(c.hits for c in offline.values()), sum(c.queries for c in offline.values())
    assert measured["prefix_cache_queries"] == queries  # every prompt token looked up once
    expected = hits / queries
    ideal = sum(c.hits for c in unbounded.values()) / queries
    assert ideal - expected > 0.10, "the pool is small enough for eviction to matter"
    assert abs(measured["prefix_cache_hit_ratio"] - expected) <= 0.02, (measured, expected, ideal)
    for rank, counts in offline.items():
        slot = results["engines"]["slots"][f"prefill/{table['prefill'][0]['name']}/{rank}"]
        assert abs(slot["prefix_cache_hit_ratio"] - counts.hit_ratio) <= 0.03, (rank, slot, counts)
