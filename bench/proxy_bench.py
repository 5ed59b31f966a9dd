"""Proxy benchmark (`make bench`): pdserve proxy vs vllm-router vs no proxy, on the same simulators.

One run starts one prefill and one decode `pdserve sim` (DP2 each, NIXL semantics) and measures,
one system after the other on those same backends:

  * ``pdserve``: `pdserve proxy` in its default configuration (uvicorn, ``--workers`` = the
    CPUs available, back-pressure on), which is what the image and the chart run, with a routing
    file naming the two simulators; ``pdserve-1w`` (``--workers 1``), ``pdserve-hypercorn`` and
    ``pdserve-prefix`` (``--prefill-policy prefix-affinity``) on
    request (``--systems``);
  * ``vllm-router``: the PyPI router in P/D mode (--vllm-pd-disaggregation --kv-connector nixl);
  * ``direct``: the client talking to the decode simulator itself, the floor no proxy can beat;
  * ``pdserve-traced`` and ``pdserve-1w-traced`` on request: the same routers tracing every
    request (``--otlp-traces-endpoint``, ``--trace-sampling-ratio 1``) to a minimal OTLP/HTTP
    sink of the bench's own (bench/otlp_sink.py, a process apart), ``pdserve-1w-sampled`` one
    request in a hundred (``--trace-sampling-ratio 0.01``); ratios against the untraced system
    are printed, and the notes say how many spans each run exported;
  * with ``--baseline DIR`` (another checkout, e.g. ``git worktree add ../baseline main``), each
    pdserve system also as ``<system>@baseline``: that checkout's router, same flags, same
    backends and rounds, so a change's cost on the hot path shows as a ratio of one run
    (results in bench/results/baseline-latest.md).

Both proxies log at warning (no line per request). The systems run in rounds, each round in the
reverse order of the previous one (A B C, C B A, ...), so a slow drift of the machine's load
favours none of them; the figures pool all rounds (per-round figures are in the notes).
Loads (LOADS below), each from a separate client process (bench/load_client.py): streaming
completions at concurrency 64 and 256, non-streaming at 64, long streams (256 tokens), bursts of
2048 and 4096 requests on as many new connections started at once, and 1000 streams held open
at once (the decode holds its first byte 4 s) while the proxy's RSS is sampled. Proxy CPU is
the CPU time of the proxy and its worker processes, per request and per streamed chunk (an SSE
event: each token and ``[DONE]``).
Results: a table on stdout, bench/results/<timestamp>.json, <timestamp>.png, latest.md,
latest.png. This is a benchmark, not a test: it prints figures side by side and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import cpulimit
from bench.cpulimit import CpuLimit
from bench.report import Summary, ratios, summarize, table, targets, write_results
from bench.servers import Server, free_port, http_json, http_post_json, log, profile, run_load, start
from pdserve.routing.table import Connector, Instance, RoutingTable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
#: pdserve systems and the flags that make them (none: the default configuration).
#: Where the traced systems send their spans: the bench's OTLP sink (bench/otlp_sink.py).
OTLP_SINK = "{otlp}"
TRACED_FLAGS = ("--otlp-traces-endpoint", OTLP_SINK, "--trace-sampling-ratio", "1")
SAMPLED_FLAGS = ("--otlp-traces-endpoint", OTLP_SINK, "--trace-sampling-ratio", "0.01")
PDSERVE_SYSTEMS: dict[str, tuple[str, ...]] = {
    "pdserve": (),
    "pdserve-1w": ("--workers", "1"),
    "pdserve-hypercorn": ("--http-server", "hypercorn"),
    "pdserve-prefix": ("--prefill-policy", "prefix-affinity"),
    "pdserve-traced": TRACED_FLAGS,
    "pdserve-1w-traced": ("--workers", "1", *TRACED_FLAGS),
    "pdserve-1w-sampled": ("--workers", "1", *SAMPLED_FLAGS),
}
#: A traced system and the same system without tracing: their ratio is what tracing costs.
TRACED = {"pdserve-traced": "pdserve", "pdserve-1w-traced": "pdserve-1w", "pdserve-1w-sampled": "pdserve-1w"}
SYSTEMS = ("direct", *PDSERVE_SYSTEMS, "vllm-router")
DEFAULT_SYSTEMS = ("direct", "pdserve", "pdserve-1w", "vllm-router")
#: ``<pdserve system>@baseline``: the same system run from the ``--baseline`` checkout.
BASELINE = "@baseline"


def pdserve_system(system: str) -> str | None:
    """The pdserve configuration a system runs (``pdserve-1w@baseline``: ``pdserve-1w``), or None."""
    name = system.removesuffix(BASELINE)
    return name if name in PDSERVE_SYSTEMS else None


@dataclass(frozen=True)
class Load:
    name: str
    mode: str  # load_client's: "stream" (a pool of `concurrency`) or "burst" (new connections)
    requests: int
    concurrency: int
    tokens: int
    stream: bool = True
    hold_ms: int = 0  # the decode holds its first byte this long (open streams, RSS sampled)


def loads(args: argparse.Namespace) -> list[Load]:
    n, t = args.requests, args.tokens
    return [
        # First, right after the warm-up: its RSS must not include the bursts' high-water mark.
        Load("open-1000", "stream", 1000, 1000, t, hold_ms=4000),
        Load("stream-c64", "stream", n, 64, t),
        Load("stream-c256", "stream", n, 256, t),
        Load("plain-c64", "stream", n, 64, t, stream=False),
        Load("long-256tok", "stream", max(64, n // 8), 64, 256),
        Load("burst-2048", "burst", 2048, 2048, t),
        Load("burst-4096", "burst", 4096, 4096, t),
    ]


LOG_LEVEL = "warning"  # both proxies: no log line per request


def routing_file(prefill: Server, decode: Server, dp_size: int, path: Path) -> Path:
    table = RoutingTable(
        deployment="bench",
        generation=1,
        connector=Connector("nixl"),
        prefill=(Instance("bench-prefill-0", prefill.url, dp_size=dp_size, ready=True),),
        decode=(Instance("bench-decode-0", decode.url, dp_size=dp_size, ready=True),),
    )
    path.write_text(table.to_json())
    return path


def start_system(
    system: str,
    prefill: Server,
    decode: Server,
    dp_size: int,
    logs: Path,
    limit: CpuLimit | None = None,
    baseline: Path | None = None,
    otlp: str | None = None,
) -> Server | None:
    """The proxy under test (inside ``limit`` if given), or None for ``direct``; ``baseline``:
    the checkout the ``@baseline`` systems run; ``otlp``: the sink the traced systems send to."""
    if system == "direct":
        return None
    port = free_port()
    config = pdserve_system(system)
    if config is not None:
        table = routing_file(prefill, decode, dp_size, logs / "routing.json")
        argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--routing-file", str(table)]
        argv += [otlp or "" if flag == OTLP_SINK else flag for flag in PDSERVE_SYSTEMS[config]]
        argv += ["--log-level", LOG_LEVEL]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        tree = baseline if system.endswith(BASELINE) and baseline is not None else REPO
        return start(system, argv, port, "/ready", logs, limit=limit, tree=tree)
    router = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
    argv = [
        router,
        "--vllm-pd-disaggregation",
        "--prefill", prefill.url,
        "--decode", decode.url,
        "--kv-connector", "nixl",
        "--policy", "round_robin",
        "--log-level", LOG_LEVEL,
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    return start("vllm-router", argv, port, "/health", logs, limit=limit)


@dataclass
class Measured:
    """One load on one system in one round: the load client's raw output and the proxy's CPU."""

    system: str
    load: str
    round: int
    result: dict[str, Any]
    cpu_s: float | None
    spread: str = ""  # legs per DP rank as the simulators counted them
    chunks: int = 0  # SSE events per answer (0: buffered)


def bench_system(
    system: str, round_: int, prefill: Server, decode: Server, args: argparse.Namespace, logs: Path
) -> tuple[list[Measured], list[str]]:
    notes: list[str] = []
    limit = None
    if args.router_cpus is not None and system != "direct":
        limit = cpulimit.create(args.router_cpus, f"pdserve-bench-{os.getpid()}-{system}")
    proxy: Server | None = None
    measured = []
    exported: dict[str, int] | None = None
    try:
        proxy = start_system(system, prefill, decode, args.dp_size, logs, limit, args.baseline, args.otlp)
        exported = http_json(args.otlp_stats) if system in TRACED else None
        url = proxy.url if proxy is not None else decode.url
        warm = run_load(url, "stream", 200, 16, args.tokens, 60)
        if warm["failures"]:
            notes.append(f"{system} round {round_}: warm-up failures {warm['failures']}")
        for load in loads(args):
            if args.loads and load.name not in args.loads:
                continue
            for sim in (prefill, decode):
                http_json(sim.url + "/sim/reset", "POST")
            if load.hold_ms:
                fault = {"kind": "slow-first-byte", "ms": load.hold_ms, "roles": ["decode"]}
                http_post_json(decode.url + "/sim/faults", {"faults": [fault]})
            rss_base = proxy.rss_bytes() if proxy is not None else 0
            cpu_before = proxy.cpu_seconds() if proxy is not None else 0.0
            log(f"round {round_} {system}: {load.name}: {load.requests} requests")
            try:
                result = run_load(
                    url,
                    load.mode,
                    load.requests,
                    load.concurrency,
                    load.tokens,
                    args.timeout,
                    load.stream,
                    sample=proxy if load.hold_ms else None,
                )
            finally:
                if load.hold_ms:
                    http_post_json(decode.url + "/sim/faults", {"faults": []})
            cpu = proxy.cpu_seconds() - cpu_before if proxy is not None else None
            if load.hold_ms and proxy is not None:
                result["rss_base_bytes"] = rss_base
            pstats = http_json(prefill.url + "/sim/stats")
            dstats = http_json(decode.url + "/sim/stats")
            spread = (
                f"prefill legs {pstats['requests']} (by rank {pstats['by_rank']}), "
                f"decode legs {dstats['by_leg']['decode']} (by rank {dstats['by_rank']})"
            )
            chunks = load.tokens + 1 if load.stream else 0
            measured.append(Measured(system, load.name, round_, result, cpu, spread if proxy else "", chunks))
            summary = summarize(system, load.name, result, cpu, chunks)
            profiled = args.profile and not args.no_write and system in PDSERVE_SYSTEMS and round_ == 1
            profiled = profiled and args.router_cpus is None  # the flame graphs are the main layout's
            if load.name == "stream-c64" and proxy is not None and profiled:
                RESULTS.mkdir(parents=True, exist_ok=True)
                notes.append(profile(proxy, args, RESULTS / f"flame-{system}-{args.stamp}.svg"))
                log(notes[-1])
            log(
                f"round {round_} {system}: {load.name}: {summary.ok} ok, {summary.failed} failed, "
                f"{summary.rps:.0f} req/s, p50 {summary.p50_ms:.1f} ms, p99 {summary.p99_ms:.1f} ms, "
                f"proxy CPU {summary.proxy_cpu_ms} ms/req"
                + (f", RSS peak {summary.rss_mb} MB" if summary.rss_mb else "")
            )
    finally:
        if proxy is not None:
            proxy.stop()  # the router exports what it buffered before it exits
        if limit is not None:
            limit.remove()
    if exported is not None:
        now = http_json(args.otlp_stats)
        spans = now["spans"] - exported["spans"]
        requests = sum(m.result["requests"] for m in measured) + 200  # with the warm-up's
        notes.append(
            f"{system} round {round_}: {spans} spans exported for {requests} requests "
            f"({spans / requests:.2f} per request, in {now['requests'] - exported['requests']} batches)"
        )
    return measured, notes


def pooled(runs: Sequence[Measured]) -> Summary:
    """One summary of a system's load over every round: latencies pooled, walls and CPU summed."""
    failures: dict[str, int] = {}
    for run in runs:
        for kind, n in run.result["failures"].items():
            failures[kind] = failures.get(kind, 0) + n
    result = {
        "wall_s": sum(r.result["wall_s"] for r in runs),
        "latencies_s": [x for r in runs for x in r.result["latencies_s"]],
        "failures": failures,
        "requests": sum(r.result["requests"] for r in runs),
    }
    peaks = [r.result["rss_peak_bytes"] for r in runs if "rss_peak_bytes" in r.result]
    if peaks:
        result["rss_peak_bytes"] = max(peaks)
        result["rss_base_bytes"] = max(r.result.get("rss_base_bytes", 0) for r in runs)
    cpus = [r.cpu_s for r in runs]
    cpu = None if any(c is None for c in cpus) else sum(c for c in cpus if c is not None)
    return summarize(runs[0].system, runs[0].load, result, cpu, runs[0].chunks)


def round_orders(systems: Sequence[str], rounds: int) -> list[list[str]]:
    """A B C D, then D C B A, then A B C D again ...: drift of the machine's load evens out."""
    return [list(systems) if r % 2 == 0 else list(reversed(systems)) for r in range(rounds)]


def pdserve_proxy_available(tree: Path = REPO) -> bool:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import pdserve, pdserve.proxy.cli, sys; sys.exit(not pdserve.__file__.startswith(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tree)], cwd=tree, env=env, capture_output=True, check=False
    )
    return done.returncode == 0


def describe_tree(tree: Path) -> str:
    """The checkout's last commit, else its directory's name (no path of this machine)."""
    done = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip()[:100] if done.returncode == 0 and done.stdout.strip() else tree.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS), help="systems to measure"
    )
    parser.add_argument("--loads", nargs="+", default=None, help="only these loads (default: all)")
    parser.add_argument(
        "--requests", type=int, default=3000, help="requests per system of the c64/c256 loads (default 3000)"
    )
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer (default 8)")
    parser.add_argument("--dp-size", type=int, default=2, help="DP size of each simulator (default 2)")
    parser.add_argument(
        "--ttft-ms", type=float, default=2.0, help="simulated time to first token (default 2)"
    )
    parser.add_argument("--itl-ms", type=float, default=1.0, help="simulated inter-token latency (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="client timeout per load in s (default 120)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds, each in the reverse order of the last (default 2)"
    )
    parser.add_argument(
        "--router-cpus",
        type=float,
        default=None,
        help="run each router in a cgroup limited to this many CPUs, as a pod's limits.cpu (pdserve's "
        "default --workers and vllm-router's threads follow it; needs root); results go to "
        "bench/results/cpu<N>-latest.md and cpu<N>-<timestamp>.json/.png",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run each pdserve system from this checkout, as <system>@baseline (same flags, backends "
        "and rounds); ratios <system>/<system>@baseline are printed and results go to "
        "bench/results/baseline-latest.md and baseline-<timestamp>.json/.png",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; write nothing to bench/results")
    parser.add_argument(
        "--label",
        default="",
        metavar="NAME",
        help="write the results as bench/results/NAME-latest.md and NAME-<timestamp>.json/.png (e.g. "
        "tracing: the traced systems against the untraced ones and the --baseline checkout)",
    )
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="no py-spy flame graph of pdserve (by default one per pdserve system, in round 1, after its "
        "stream-c64 load, written to bench/results/flame-<system>-<timestamp>.svg)",
    )
    parser.add_argument(
        "--profile-seconds", type=int, default=12, help="py-spy recording length (default 12)"
    )
    args = parser.parse_args(argv)
    args.stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    if args.router_cpus is not None:
        try:  # fail now, not after the simulators have started
            cpulimit.create(args.router_cpus, f"pdserve-bench-{os.getpid()}-check").remove()
        except cpulimit.CpuLimitUnavailable as exc:
            parser.error(str(exc))

    # Children inherit the limit: a burst needs a socket per connection in every process.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    systems = list(args.systems)
    notes: list[str] = []
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not pdserve_proxy_available(args.baseline):
            parser.error(f"--baseline {args.baseline}: no pdserve checkout whose router imports there")
        with_baseline = [[s, s + BASELINE] if pdserve_system(s) and s not in TRACED else [s] for s in systems]
        systems = [s for pair in with_baseline for s in pair]
        notes.append(f"baseline: {describe_tree(args.baseline)}; this tree: {describe_tree(REPO)}")
    if any(pdserve_system(s) for s in systems) and not pdserve_proxy_available():
        systems = [s for s in systems if not pdserve_system(s)]
        notes.append("pdserve proxy not available (pdserve.proxy.cli does not import): not measured")
        log(notes[-1])

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    summaries: list[Summary] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        logs = Path(tmp)
        sim_args = [
            "--dp-size",
            str(args.dp_size),
            "--ttft-ms",
            str(args.ttft_ms),
            "--itl-ms",
            str(args.itl_ms),
        ]
        # Answers are as long as each request's max_tokens, up to the longest load's 256 tokens.
        most = str(max(args.tokens, *(load.tokens for load in loads(args))))
        sim = [sys.executable, "-m", "pdserve.cli", "sim", *sim_args, "--tokens", most]
        pport, dport = free_port(), free_port()
        log(f"starting simulators: prefill :{pport}, decode :{dport} (DP{args.dp_size} each)")
        prefill = start(
            "sim-prefill",
            [*sim, "--role", "prefill", "--instance-name", "bench-prefill-0", "--port", str(pport)],
            pport, "/health", logs,
        )  # fmt: skip
        decode = start(
            "sim-decode",
            [*sim, "--role", "decode", "--instance-name", "bench-decode-0", "--port", str(dport)],
            dport, "/health", logs,
        )  # fmt: skip
        measured: list[Measured] = []
        sink = None
        args.otlp = args.otlp_stats = None
        if any(s in TRACED for s in systems):
            sport = free_port()
            sink_argv = [sys.executable, "-m", "bench.otlp_sink", "--port", str(sport)]
            sink = start("otlp-sink", sink_argv, sport, "/health", logs)
            args.otlp, args.otlp_stats = (
                f"http://127.0.0.1:{sport}/v1/traces",
                f"http://127.0.0.1:{sport}/stats",
            )
            log(f"OTLP sink of the traced systems: {args.otlp}")
        try:
            for round_, order in enumerate(round_orders(systems, args.rounds), start=1):
                log(f"round {round_}: {' '.join(order)}")
                for system in order:
                    try:
                        got, system_notes = bench_system(system, round_, prefill, decode, args, logs)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        notes.append(f"{system} round {round_}: not measured: {str(exc).splitlines()[0]}")
                        log(notes[-1])
                        continue
                    measured += got
                    notes += system_notes
        finally:
            prefill.stop()
            decode.stop()
            if sink is not None:
                sink.stop()
    load_names = [load.name for load in loads(args)]
    for system in systems:
        for load in load_names:
            runs = [m for m in measured if m.system == system and m.load == load]
            if not runs:
                continue
            summaries.append(pooled(runs))
            per_round = [summarize(system, load, r.result, r.cpu_s, r.chunks) for r in runs]
            cpu = ", ".join("-" if p.proxy_cpu_ms is None else f"{p.proxy_cpu_ms:.2f}" for p in per_round)
            notes.append(
                f"{system} {load} per round: req/s {', '.join(f'{p.rps:.0f}' for p in per_round)}; "
                f"p99 ms {', '.join(f'{p.p99_ms:.0f}' for p in per_round)}; proxy CPU ms/req {cpu}"
            )
            notes += [f"{system} {load} round {r.round}: {r.spread}" for r in runs if r.spread]

    print()
    print(table(summaries))
    print()
    ratio_pairs = {
        (system, "vllm-router"): ratios(summaries, system, "vllm-router")
        for system in PDSERVE_SYSTEMS
        if system in systems and "vllm-router" in systems
    }
    ratio_pairs |= {
        (system, system + BASELINE): ratios(summaries, system, system + BASELINE)
        for system in PDSERVE_SYSTEMS
        if system in systems and system + BASELINE in systems
    }
    ratio_pairs |= {
        (traced, plain): ratios(summaries, traced, plain)
        for traced, plain in TRACED.items()
        if traced in systems and plain in systems
    }
    for (num, den), per_load in ratio_pairs.items():
        for load, r in per_load.items():
            print(
                f"{num}/{den} {load}: req/s x{r['rps']}  p50 x{r['p50']}  p99 x{r['p99']}  "
                f"proxy CPU x{r['cpu']}"
            )
    for note in notes:
        print(f"note: {note}")
    log(f"done in {time.monotonic() - started:.0f}s")
    if args.no_write or not summaries:
        return 0

    meta = {
        "timestamp": args.stamp,
        "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "layout": (
            "both routers share the machine's CPUs with the simulators and the load client"
            if args.router_cpus is None
            else f"each router runs in a cgroup limited to {args.router_cpus:g} CPU(s), as a pod's "
            "limits.cpu: pdserve's default --workers and vllm-router's worker threads follow the limit; "
            "the simulators and the load client are not limited"
        ),
        "backends": (
            f"1 prefill + 1 decode `pdserve sim`, DP{args.dp_size} each, ttft {args.ttft_ms} ms, "
            f"itl {args.itl_ms} ms, {args.tokens} tokens per answer"
        ),
        "loads": (
            "; ".join(
                f"{load.name}: {load.requests} {'streaming' if load.stream else 'non-streaming'} "
                f"requests of {load.tokens} tokens, "
                + (
                    "all at once on new connections"
                    if load.mode == "burst"
                    else f"{load.concurrency} at a time"
                )
                + (f", the decode holding its first byte {load.hold_ms} ms" if load.hold_ms else "")
                for load in loads(args)
                if not args.loads or load.name in args.loads
            )
            + f"; {args.rounds} round(s), alternating order, pooled; both proxies at --log-level {LOG_LEVEL}"
        ),
        "targets": targets(summaries),
        "ratios": ratio_pairs,
        "notes": notes,
    }
    prefix = "" if args.router_cpus is None else f"cpu{args.router_cpus:g}-"
    if args.baseline is not None:
        prefix = "baseline-" + prefix
        meta["baseline"] = describe_tree(args.baseline)
    if args.label:
        prefix = f"{args.label}-" + prefix.removeprefix("baseline-")
    # The checkout by its commit, never by a path of this machine; the sink's URLs left out.
    recorded = {**vars(args), "baseline": meta.get("baseline")}
    recorded = {k: v for k, v in recorded.items() if k not in ("otlp", "otlp_stats")}
    written = write_results(RESULTS, prefix, summaries, meta, recorded)
    log(f"wrote {', '.join(f'bench/results/{name}' for name in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
