"""Simulator benchmark: what `pdserve sim` costs in CPU per request and per streamed chunk, with
and without its step engine, and whether a DP8 simulator keeps up with the router benchmark.

Systems, each one DP8 `pdserve sim` process (role both) measured under the same loads:

  * ``baseline``: the simulator of ``--baseline`` (default: 3b7c1f7, main just before the step
    engine came), exported with ``git archive`` into a temporary directory and run from there: the
    default path before;
  * ``fixed``: this tree's simulator without a profile (the path `make bench` and the tests
    use: fixed --ttft-ms/--itl-ms): it must not be slower than ``baseline``;
  * ``engine``: this tree's simulator with ``--profile h200-llama-3.1-8b`` (about 6 ms steps:
    the largest step rate of the packaged profiles), prefix caching on.

Loads (bench/load_client.py in its own process, as in `make bench`): streaming completions of 8
tokens at concurrency 64 and 256, non-streaming at 64, and 256-token streams at 64. The systems
run in rounds, each round in the reverse order of the previous one. CPU is the simulator
process's CPU time over the load (psutil); per chunk = per request / (tokens + 1) of the
256-token streams (an SSE event per token, and [DONE]).
Results: a table on stdout and bench/results/sim-<timestamp>.json and sim-latest.md. A benchmark,
not a test: it prints figures side by side and asserts nothing. On a shared machine, run it
when no other benchmark does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.servers import Server, free_port, log, run_load, start

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SYSTEMS = ("baseline", "fixed", "engine")
#: (name, streaming, requests, concurrency, tokens)
LOADS = [
    ("stream-c64", True, 3000, 64, 8),
    ("stream-c256", True, 3000, 256, 8),
    ("plain-c64", False, 3000, 64, 8),
    ("long-256tok", True, 375, 64, 256),
]


def export(ref: str, into: Path) -> None:
    """The ``pdserve`` package of ``ref`` (a commit or branch), as files in ``into``."""
    archive = subprocess.run(["git", "archive", ref, "pdserve"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def sim_argv(system: str, port: int, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.cli", "sim", "--dp-size", "8", "--port", str(port)]
    argv += ["--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), "--tokens", "256"]
    if system == "engine":
        argv += ["--profile", "h200-llama-3.1-8b", "--kv-port", str(free_port())]
    return argv


def start_sim(system: str, args: argparse.Namespace, logs: Path, baseline_dir: Path) -> Server:
    port = free_port()
    argv = sim_argv(system, port, args)
    if system != "baseline":
        return start(f"sim-{system}", argv, port, "/health", logs)
    # The baseline's own package first: run from its directory, which Python puts first on the path.
    log_path = logs / "sim-baseline.log"
    env = {**os.environ, "PYTHONPATH": str(baseline_dir)}
    with log_path.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=baseline_dir, env=env)
    server = Server("sim-baseline", port, popen, log_path)
    import urllib.request

    for _ in range(300):
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the baseline simulator did not start: {log_path.read_text()}")


def measure(server: Server, load: tuple[str, bool, int, int, int]) -> dict[str, Any]:
    _, stream, requests, concurrency, tokens = load
    cpu0 = server.cpu_seconds()
    result = run_load(server.url, "stream", requests, concurrency, tokens, 300, stream=stream)
    cpu = server.cpu_seconds() - cpu0
    ok = len(result["latencies_s"])
    lat = sorted(result["latencies_s"]) or [0.0]
    return {
        "ok": ok,
        "failed": sum(result["failures"].values()),
        "req_per_s": ok / result["wall_s"],
        "p50_ms": lat[len(lat) // 2] * 1000,
        "cpu_ms_per_req": cpu * 1000 / max(ok, 1),
        "cpu_us_per_chunk": cpu * 1e6 / max(ok, 1) / (tokens + 1) if stream else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline", default="3b7c1f7", help="git ref of the baseline simulator (default: before the engine)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order (default 2)")
    parser.add_argument(
        "--ttft-ms", type=float, default=2.0, help="fixed systems' ttft (default 2, as make bench)"
    )
    parser.add_argument(
        "--itl-ms", type=float, default=1.0, help="fixed systems' itl (default 1, as make bench)"
    )
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {load[0]: [] for load in LOADS} for s in SYSTEMS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pdserve-sim-bench-") as tmp:
        baseline_dir, logs = Path(tmp) / "baseline", Path(tmp) / "logs"
        baseline_dir.mkdir()
        logs.mkdir()
        export(args.baseline, baseline_dir)
        order = list(SYSTEMS)
        for round_ in range(args.rounds):
            for system in order:
                server = start_sim(system, args, logs, baseline_dir)
                try:
                    for load in LOADS:
                        figures = measure(server, load)
                        runs[system][load[0]].append(figures)
                        log(f"round {round_ + 1} {system:8} {load[0]:12} {_line(figures)}")
                finally:
                    server.stop()
            order.reverse()
    pooled = {s: {name: _pool(rs) for name, rs in loads.items()} for s, loads in runs.items()}
    text = _report(pooled, args, stamp, load_before, os.getloadavg()[0])
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"sim-{stamp}.json").write_text(json.dumps({"runs": runs, "pooled": pooled}, indent=1))
    (RESULTS / "sim-latest.md").write_text(text)
    return 0


def _pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _line(f: dict[str, Any]) -> str:
    chunk = f"{f['cpu_us_per_chunk']:.1f} µs/chunk" if f["cpu_us_per_chunk"] is not None else ""
    return (
        f"{f['req_per_s']:8.1f} req/s p50 {f['p50_ms']:7.2f} ms  CPU {f['cpu_ms_per_req']:.3f} ms/req {chunk}"
    )


def _report(pooled: dict[str, Any], args: argparse.Namespace, stamp: str, before: float, after: float) -> str:
    lines = [
        "# Simulator benchmark: latest run",
        "",
        f"Run {stamp} on {os.cpu_count()} CPU(s), 1-minute load average {before:.2f} before and {after:.2f} "
        "after (other work shares the machine); `python -m bench.sim_bench` (bench/sim_bench.py).",
        f"One DP8 `pdserve sim` per system: baseline = `{args.baseline}`'s simulator, fixed = this tree "
        f"without a profile (ttft {args.ttft_ms} ms, itl {args.itl_ms} ms), engine = this tree with "
        "--profile h200-llama-3.1-8b. Medians of "
        f"{args.rounds} round(s), alternating order. CPU: the simulator process's.",
        "",
        "| system | load | ok | failed | req/s | p50 ms | sim CPU ms/req | sim CPU µs/chunk |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, loads in pooled.items():
        for name, f in loads.items():
            chunk = f"{f['cpu_us_per_chunk']:.1f}" if f["cpu_us_per_chunk"] is not None else "-"
            lines.append(
                f"| {system} | {name} | {f['ok']:.0f} | {f['failed']:.0f} | {f['req_per_s']:.1f} | "
                f"{f['p50_ms']:.2f} | {f['cpu_ms_per_req']:.3f} | {chunk} |"
            )
    lines.append("")
    for other in ("fixed", "engine"):
        parts = []
        for name, _, _, _, _ in LOADS:
            b, o = pooled["baseline"][name], pooled[other][name]
            parts.append(f"{name} CPU/req x{o['cpu_ms_per_req'] / b['cpu_ms_per_req']:.2f}")
        lines.append(f"- {other}/baseline: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
