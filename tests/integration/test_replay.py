"""`pdserve bench replay` against `pdserve up` (simulated engines), as a user runs it: a slice of the
Mooncake trace time-compressed, and a Poisson workload on the chat endpoint. The results are
checked against what the engines and the router counted themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.loadgen.cachemodel import ideal_hit_ratio
from pdserve.loadgen.schedule import schedule
from pdserve.loadgen.trace import read_trace
from tests.support.procs import REPO, ProcessGroup, wait_routable
from tests.support.specs import sim_manifest

SLICE = REPO / "tests" / "fixtures" / "mooncake" / "slice-3600.jsonl"
SIM_TOKENS = 4
MANIFEST = sim_manifest(
    "replay",
    model="Qwen/Qwen2.5-0.5B-Instruct",
    servedModelName="qwen-0.5b",
    # Mooncake prompts run to 191k tokens
    prefill={"instances": 1, "dataParallel": 2, "args": ["--max-model-len", "200000"]},
    decode={"instances": 2, "dataParallel": 1, "args": ["--max-model-len", "200000"]},
)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("up")
    manifest = tmp / "replay.yaml"
    manifest.write_text(yaml.safe_dump(MANIFEST))
    group = ProcessGroup(tmp)
    try:
        flags = ["--sim-ttft-ms", "5", "--sim-itl-ms", "1", "--sim-tokens", str(SIM_TOKENS)]
        proc = group.start("up", ["up", str(manifest), "--no-view", *flags], health="/ready", timeout=60)
        wait_routable(proc.url, proc=proc.popen)
        yield proc.url
    finally:
        group.stop_all()


def _replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "replay", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=240,
    )


def test_trace_slice_replay_writes_results_that_match_the_engines(up: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    limit = 40
    run = _replay(
        str(SLICE), "--url", up, "--speedup", "50", "--limit", str(limit), "--output", str(out),
        "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000", "--metrics-interval", "0.2",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (
        f"{limit}/{limit} | sent {limit} done {limit} failed 0" in run.stderr
    )  # the progress bar's last line
    results = json.loads((out / "results.json").read_text())
    s = results["summary"]
    assert (s["completed"], s["failed"]) == (limit, 0), s["failures"]
    assert results["config"]["model"] == "qwen-0.5b"  # the first model the server lists
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"] <= s[key]["max"], key
    assert s["goodput"]["good"] == limit  # generous SLOs
    assert results["client"]["cpu_ms_per_request"] > 0

    # What the engines and the router counted is what was sent.
    engines = results["engines"]
    assert {r: engines["by_role"][r]["requests"] for r in ("prefill", "decode")} == {
        "prefill": limit,
        "decode": limit,
    }
    assert sorted(engines["slots"]) == [
        "decode/replay-decode-0/0", "decode/replay-decode-1/0", "prefill/replay-prefill-0/0",
        "prefill/replay-prefill-0/1",
    ]  # fmt: skip
    assert sum(engines["router_requests"].values()) == 2 * limit
    assert all(n == limit // 2 for n in engines["router_requests"].values())  # round robin over 2 slots each
    assert len(results["load"]) >= 2 and all("prefill_running" in row for row in results["load"])

    # Every request as the server saw it: the prompt's length under the sim's tokenizer, the tokens it gave.
    arrivals = schedule(read_trace(SLICE), limit=limit)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in records] == [a.request.input_length for a in arrivals]
    assert [r["output_tokens"] for r in records] == [
        min(SIM_TOKENS, a.request.output_length) for a in arrivals
    ]
    assert results["trace"]["ideal_hit_ratio"] == round(ideal_hit_ratio(a.request for a in arrivals), 4)
    # each request carries X-Request-Id <run_id>-<index>: the prefill saw it on its leg
    prefill_url = _get(up + "/debug/routing")["table"]["prefill"][0]["url"]
    seen = {r["request_id"] for r in _get(prefill_url + "/sim/stats")["recent"]}
    assert {f"{results['config']['run_id']}-{i}-p1" for i in range(limit)} <= seen

    md = (out / "results.md").read_text()
    assert "| TTFT |" in md and "## Load per slot" in md and "goodput (TTFT <= 5000 ms" in md
    assert "![latency and load over time](results.png)" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.split("\n")[0] in run.stdout  # the summary is printed too


def test_poisson_chat_replay(up: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _replay(
        "poisson", "--url", up, "--endpoint", "chat", "--rate", "200", "--num-requests", "60", "--input-len",
        "1500", "--output-len", "3", "--prefix-share", "0.5", "--prefix-groups", "2", "--output", str(out),
        "--no-progress",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["completed"] == 60
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    trace = read_trace(out / "trace.jsonl")  # the generated workload, to run again
    assert [r["prompt_tokens"] for r in records] == [t.input_length + 1 for t in trace]  # + the role token
    assert all(r["output_tokens"] == 3 for r in records)
