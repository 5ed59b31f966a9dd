"""Cache-aware prefill routing on the Mooncake trace (`make bench-prefix`, issue 26): pdserve's
flat interleave, pdserve's prefix-affinity and vllm-router's cache_aware, one after the other on
the same simulated engines, each on freshly started ones (cold caches, counters from zero).

The engines: `pdserve sim` with the H200 performance profile (step engine, prefix caching, 16-token
blocks): one prefill instance of DP8 whose KV pool is cut to ``--prefill-blocks`` blocks per rank
(so the cache matters: the Mooncake prompts' distinct blocks outgrow it), and two decode
instances of DP4 with the profile's pool: the largest shape this 2-core machine serves at
``--speedup`` without the client falling behind (bench/results/replay-latest.md).

The systems (``--systems``, in this order by default):

* ``flat``: ``pdserve proxy`` (2 workers), ``--policy flat-interleaved``;
* ``affinity``: the same with ``--prefill-policy prefix-affinity``;
* ``affinity-2r``: two such routers on the same engines, the trace split between them at random,
  ``--prefix-unmatched rendezvous`` (what the operator renders for several routers);
* ``affinity-2r-apart``: the same with ``--prefix-unmatched flat`` (routers that do not agree);
* ``affinity-1w``: prefix-affinity with one worker process (the 2-worker index against one);
* ``vllm-router``: vllm-router in P/D mode, ``--prefill-policy cache_aware`` (its default and
  thresholds) and ``--decode-policy round_robin``.

vllm-router's ``kv_aware`` needs vLLM's KV events (ZMQ); the simulator does not publish them, so
it is not run. The replay reads the engines' own metrics (prefix-cache hits and queries, requests
and prompt tokens per rank), found through a pdserve router's ``/debug/routing`` on the same
routing table (for vllm-router: an idle flat router started only to be asked).

Writes bench/results/prefix-<label>.md and .png, and prefix-<label>-<run>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.replay_bench import RESULTS, find_trace
from pdserve.loadgen.engines import EngineWatch
from pdserve.loadgen.metrics import engine_summary
from pdserve.loadgen.replay import ReplayOptions, run_replay
from pdserve.loadgen.results import RequestRecord, Slo, summarize
from pdserve.loadgen.schedule import Arrival, schedule
from pdserve.loadgen.trace import read_trace
from pdserve.routing import Connector, Instance, RoutingTable
from tests.support.procs import free_port

PROFILE = "h200-llama-3.1-8b"
MODEL = "qwen-0.5b"
SYSTEMS = ("flat", "affinity", "affinity-2r", "affinity-2r-apart", "affinity-1w", "vllm-router")
DEFAULT_SYSTEMS = ("flat", "affinity", "vllm-router", "affinity-2r", "affinity-2r-apart", "affinity-1w")
AFFINITY = ["--prefill-policy", "prefix-affinity"]
PDSERVE_ARGS: dict[str, tuple[list[str], int, int]] = {  # system: (flags, workers, routers)
    "flat": ([], 2, 1),
    "affinity": (AFFINITY, 2, 1),
    "affinity-2r": ([*AFFINITY, "--prefix-unmatched", "rendezvous"], 2, 2),
    "affinity-2r-apart": (AFFINITY, 2, 2),
    "affinity-1w": (AFFINITY, 1, 1),
}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    url: str


@dataclass
class Engines:
    prefill: Proc
    decode: list[Proc]
    routing: Path


@dataclass
class Outcome:
    system: str
    records: list[RequestRecord]
    engines: dict[str, Any]
    routers: int
    extra: dict[str, Any] = field(default_factory=dict)


def start(name: str, argv: list[str], port: int, health: str, logs: Path, timeout: float = 120) -> Proc:
    with (logs / f"{name}.log").open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if popen.poll() is not None:
            raise SystemExit(f"{name} exited: {(logs / f'{name}.log').read_text(errors='replace')[-3000:]}")
        try:
            import urllib.request

            with urllib.request.urlopen(url + health, timeout=2) as resp:
                if resp.status == 200:
                    return Proc(name, popen, url)
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not answer {health} within {timeout:g} s")
        time.sleep(0.2)


def stop(procs: Sequence[Proc]) -> None:
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.terminate()
    for proc in procs:
        try:
            proc.popen.wait(30)
        except subprocess.TimeoutExpired:
            proc.popen.kill()


def start_engines(args: argparse.Namespace, logs: Path) -> Engines:
    pdserve = [sys.executable, "-m", "pdserve.cli", "sim", "--profile", PROFILE, "--model", MODEL]
    common = ["--max-model-len", "200000", "--block-size", "16", "--host", "127.0.0.1"]
    procs: list[Proc] = []
    specs = [("prefill", "p0", 8, ["--num-gpu-blocks-override", str(args.prefill_blocks)])]
    specs += [("decode", f"d{i}", 4, []) for i in range(2)]
    for role, name, dp, extra in specs:
        port, kv_port = free_port(), free_port()
        argv = [*pdserve, "--role", role, "--dp-size", str(dp), "--instance-name", name]
        argv += [*common, "--port", str(port), "--kv-port", str(kv_port), *extra]
        procs.append(start(name, argv, port, "/health", logs))
    prefill, decode = procs[0], procs[1:]
    table = RoutingTable(
        "bench",
        1,
        Connector("nixl"),
        (Instance("p0", prefill.url, dp_size=8, ready=True),),
        tuple(Instance(p.name, p.url, dp_size=4, ready=True) for p in decode),
    )
    routing = logs / "routing.json"
    routing.write_text(table.to_json())
    return Engines(prefill, decode, routing)


def start_pdserve(name: str, engines: Engines, flags: list[str], workers: int, logs: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--routing-file", str(engines.routing)]
    argv += [*flags, "--workers", str(workers), "--log-level", "warning", "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    return start(name, argv, port, "/ready", logs)


def start_vllm_router(engines: Engines, logs: Path) -> Proc:
    router = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
    port = free_port()
    argv = [router, "--vllm-pd-disaggregation", "--prefill", engines.prefill.url]
    for decode in engines.decode:
        argv += ["--decode", decode.url]
    argv += ["--kv-connector", "nixl", "--prefill-policy", "cache_aware", "--decode-policy", "round_robin"]
    argv += ["--log-level", "warning", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-port", str(free_port())]
    return start("vllm-router", argv, port, "/health", logs)


async def replay_through(
    urls: Sequence[str], observer: str, arrivals: Sequence[Arrival], options: ReplayOptions, seed: int
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """The arrivals through ``urls`` (split at random when several), and what the engines did
    meanwhile (their metrics before and after, found through ``observer``'s /debug/routing)."""
    rng = random.Random(seed)
    shares: list[list[Arrival]] = [[] for _ in urls]
    for arrival in arrivals:
        shares[rng.randrange(len(urls))].append(arrival)
    async with aiohttp.ClientSession() as session:
        watch = EngineWatch(session, {}, observer)
        first = await watch.snapshot(0.0)
        outcomes = await asyncio.gather(
            *(
                run_replay(
                    share,
                    replace(options, url=url, admin_url=observer, progress=k == 0, metrics_interval_s=0),
                )
                for k, (url, share) in enumerate(zip(urls, shares, strict=True))
            )
        )
        last = await watch.snapshot(1.0)
    records = [r for outcome in outcomes for r in outcome.records]
    return records, engine_summary(first, last)


def run_system(system: str, args: argparse.Namespace, arrivals: Sequence[Arrival], logs: Path) -> Outcome:
    options = ReplayOptions(
        url="", model=MODEL, speedup=args.speedup, slo=Slo(args.slo_ttft_ms, args.slo_itl_ms), timeout_s=1800
    )
    with ExitStack() as stack:
        engines = start_engines(args, logs)
        stack.callback(stop, [engines.prefill, *engines.decode])
        if system == "vllm-router":
            router = start_vllm_router(engines, logs)
            observer = start_pdserve("observer", engines, [], 1, logs)
            stack.callback(stop, [router, observer])
            urls, observer_url, routers = [router.url], observer.url, 1
        else:
            flags, workers, routers = PDSERVE_ARGS[system]
            procs = [start_pdserve(f"{system}-{k}", engines, flags, workers, logs) for k in range(routers)]
            stack.callback(stop, procs)
            urls, observer_url = [p.url for p in procs], procs[0].url
        print(
            f"{system}: {len(arrivals)} requests at x{args.speedup:g} through {len(urls)} router(s)",
            flush=True,
        )
        import uvloop

        records, engine = uvloop.run(replay_through(urls, observer_url, arrivals, options, args.seed))
    return Outcome(system, records, engine, routers)


# --- the report ----------------------------------------------------------------------------------


def figures(outcome: Outcome, slo: Slo) -> dict[str, Any]:
    summary = summarize(outcome.records, slo)
    prefill = outcome.engines["by_role"].get("prefill", {})
    slots = [s for s in outcome.engines["slots"].values() if s["role"] == "prefill"]
    computed = [s["prompt_tokens"] - (s["prefix_cache_hits"] or 0) for s in slots]
    mean_computed = sum(computed) / len(computed) if computed else 0
    ttft = summary["ttft_ms"] or {}
    return {
        "completed": summary["completed"],
        "failed": summary["failed"],
        "failures": summary["failures"],
        "hit_ratio": prefill.get("prefix_cache_hit_ratio"),
        "ttft_p50_ms": ttft.get("p50"),
        "ttft_p99_ms": ttft.get("p99"),
        "goodput_share": (summary["goodput"] or {}).get("share"),
        "goodput_rps": (summary["goodput"] or {}).get("request_throughput"),
        "load_requests": prefill.get("imbalance"),
        "load_computed": round(max(computed) / mean_computed, 3) if mean_computed else None,
        "throughput_rps": summary["request_throughput"],
        "requests_per_slot": [s["requests"] for s in slots],
        "send_lag_p99_ms": (summary["send_lag_ms"] or {}).get("p99"),  # the client's own delay
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(rows: dict[str, dict[str, Any]], config: dict[str, Any], png: Path) -> str:
    lines = [
        f"# Prefix-affinity bench ({config['label']})",
        "",
        f"Mooncake {config['trace']} ({config['requests']} requests) at x{config['speedup']:g}; "
        f"engines `pdserve sim --profile {PROFILE}`: prefill 1 x DP8 with {config['prefill_blocks']:,} "
        f"blocks of 16 tokens per rank, decode 2 x DP4; every system on freshly started engines; "
        f"goodput: TTFT <= {config['slo_ttft_ms']:g} ms and mean ITL <= {config['slo_itl_ms']:g} ms. "
        f"Run {config['run']}.",
        "",
        "| system | prefill hit ratio | TTFT p50 (ms) | TTFT p99 (ms) | goodput | req/s | "
        "max/mean prefill requests | max/mean prefill computed tokens | failed | load avg (start, end) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for system, f in rows.items():
        lines.append(
            f"| {system} | {_pct(f['hit_ratio'])} | {_ms(f['ttft_p50_ms'])} | {_ms(f['ttft_p99_ms'])} | "
            f"{_pct(f['goodput_share'])} | {_x(f['throughput_rps'])} | {_x(f['load_requests'])} | "
            f"{_x(f['load_computed'])} | {f['failed']} | {', '.join(str(x) for x in f.get('loadavg', []))} |"
        )
    lines += ["", *targets(rows), "", f"![hit ratio, TTFT and load]({png.name})", ""]
    return "\n".join(lines)


def targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    ours, flat, theirs = rows.get("affinity"), rows.get("flat"), rows.get("vllm-router")
    if ours is None:
        return []
    out = ["Targets of issue 26 (prefix-affinity, 2 workers, one router):", ""]

    def check(name: str, ok: bool | None, detail: str) -> None:
        mark = "n/a" if ok is None else "met" if ok else "MISSED"
        out.append(f"- {name}: {mark} ({detail})")

    hit = ours["hit_ratio"]
    if flat is not None and hit is not None and flat["hit_ratio"] is not None:
        ratio = hit / flat["hit_ratio"] if flat["hit_ratio"] else float("inf")
        check("hit ratio >= 3x flat's", ratio >= 3, f"{_pct(hit)} vs {_pct(flat['hit_ratio'])}: x{ratio:.1f}")
    if theirs is not None and hit is not None and theirs["hit_ratio"] is not None:
        check(
            "hit ratio >= vllm-router's",
            hit >= theirs["hit_ratio"],
            f"{_pct(hit)} vs {_pct(theirs['hit_ratio'])}",
        )
    load = ours["load_requests"]
    check(
        "max/mean prefill load <= 1.3",
        None if load is None else load <= 1.3,
        f"requests {_x(load)}, computed tokens {_x(ours['load_computed'])}",
    )
    others = [
        r["ttft_p99_ms"] for name, r in rows.items() if name in ("flat", "vllm-router") and r["ttft_p99_ms"]
    ]
    if ours["ttft_p99_ms"] is not None and others:
        check(
            "TTFT p99 <= both others'",
            ours["ttft_p99_ms"] <= min(others),
            f"{_ms(ours['ttft_p99_ms'])} ms vs " + ", ".join(f"{_ms(o)} ms" for o in others),
        )
    return out


def plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = [
        ("prefill prefix-cache hit ratio (%)", [100 * (rows[n]["hit_ratio"] or 0) for n in names]),
        ("TTFT p50 / p99 (s)", None),
        ("goodput (% of requests)", [100 * (rows[n]["goodput_share"] or 0) for n in names]),
        ("max/mean prefill requests per slot", [rows[n]["load_requests"] or 0 for n in names]),
    ]
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.set_title(title, fontsize=10)
        if values is None:
            p50 = [(rows[n]["ttft_p50_ms"] or 0) / 1000 for n in names]
            p99 = [(rows[n]["ttft_p99_ms"] or 0) / 1000 for n in names]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
            ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
            ax.legend(fontsize=8)
        else:
            ax.bar(range(len(names)), values)
        if title.startswith("max/mean"):
            ax.axhline(1.3, color="red", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, help="a Mooncake JSONL trace (default: the shared one)")
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--speedup", type=float, default=4.0, help="trace time compression (default: 4)")
    parser.add_argument("--limit", type=int, help="the first N requests only (default: all)")
    parser.add_argument(
        "--prefill-blocks", type=int, default=32000, help="KV blocks per prefill rank (default: 32000)"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=26, help="splits the trace between routers")
    parser.add_argument("--label", default="latest")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    trace = find_trace(args.trace)
    arrivals = schedule(read_trace(trace), args.speedup, args.limit)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    logs = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    rows: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    for system in systems:
        load_before = os.getloadavg()[0]
        outcome = run_system(system, args, arrivals, logs)
        rows[system] = figures(outcome, slo)
        # The machine is shared: its load during each run says how comparable the runs are.
        rows[system]["loadavg"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
        raw[system] = {"figures": rows[system], "engines": outcome.engines}
        print(system, json.dumps(rows[system]), flush=True)
    config = {
        "label": args.label,
        "trace": trace.name,
        "requests": len(arrivals),
        "speedup": args.speedup,
        "prefill_blocks": args.prefill_blocks,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_itl_ms": args.slo_itl_ms,
        "seed": args.seed,
        "run": stamp,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / f"prefix-{args.label}.png"
    plot(rows, png)
    text = report(rows, config, png)
    (RESULTS / f"prefix-{args.label}.md").write_text(text)
    (RESULTS / f"prefix-{args.label}-{stamp}.json").write_text(
        json.dumps({"config": config, "systems": raw}, indent=1)
    )
    failed = [name for name, f in rows.items() if f["failed"]]
    if failed:
        print(f"failures in {', '.join(failed)}: the processes' logs are kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
