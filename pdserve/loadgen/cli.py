"""Measure a deployment from the outside, as its users load it.

`pdserve bench replay TRACE` replays a Mooncake JSONL trace (or `poisson`: a generated one) against
an OpenAI-compatible server: every request leaves at its time (open loop, compressed with
--speedup), streams, and is timed; the engines' /metrics give the prefix-cache hit ratio and the
load per slot. Results: a summary on stdout, and with --output DIR results.json, results.md,
results.png and requests.jsonl. See docs/benchmarking.md.

Examples:
  pdserve bench replay trace.jsonl --url http://127.0.0.1:8000 --speedup 10 --limit 500 --output out/
  pdserve bench replay poisson --rate 20 --num-requests 1000 --input-len 2048 --output-len 128 \\
      --prefix-share 0.5 --slo-ttft-ms 500 --slo-itl-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pdserve.argtypes import non_negative_float, positive_float, positive_int

T = TypeVar("T")

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
POISSON = "poisson"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    replay = sub.add_parser(
        "replay",
        help="replay a Mooncake trace (or a Poisson workload) against a server and report latency, "
        "goodput, prefix-cache hits and load per slot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_replay(replay)


def configure_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="a Mooncake JSONL file (timestamp ms, input_length, output_length, hash_ids), or `poisson` "
        "for a generated workload (--rate, --num-requests, ...)",
    )
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server (default: http://127.0.0.1:8000, `pdserve up`'s)",
    )
    p.add_argument(
        "--model", help="the model to ask for (default: the first one the server lists at /v1/models)"
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions (default) or /v1/chat/completions",
    )
    p.add_argument(
        "--api-key",
        help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--speedup",
        type=positive_float,
        default=1.0,
        help="compress the trace's time: 10 sends in 100 s what it spreads over 1000 s (default: 1)",
    )
    p.add_argument("--limit", type=positive_int, help="replay only the first N requests (by timestamp)")
    p.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="write results.json, results.md, results.png and requests.jsonl there",
    )
    p.add_argument(
        "--slo-ttft-ms", type=positive_float, help="goodput: a request's time to first token at most this"
    )
    p.add_argument(
        "--slo-itl-ms",
        type=positive_float,
        help="goodput: a request's mean inter-token latency (TPOT) at most this",
    )
    p.add_argument(
        "--admin-url",
        help="where the pdserve router answers /debug/routing, to find the engines (default: --url; "
        "a router with --admin-port answers there)",
    )
    p.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="an engine API server whose /metrics to read, instead of asking the router (repeat)",
    )
    p.add_argument(
        "--metrics-interval",
        type=non_negative_float,
        default=1.0,
        metavar="S",
        help="read the engines' metrics every S seconds for the load plot; 0: only before and after",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="a request not fully answered after S seconds fails as a timeout (default: 600)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="cap on open connections (default 0: none; a capped client queues requests itself)",
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early; by default ignore_eos asks for exactly output_length tokens",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    poisson = p.add_argument_group("poisson workload (TRACE `poisson`)")
    poisson.add_argument(
        "--rate", type=positive_float, default=10.0, help="requests per second (default: 10)"
    )
    poisson.add_argument("--num-requests", type=positive_int, default=1000, help="default: 1000")
    poisson.add_argument("--input-len", type=positive_int, default=2048, help="prompt tokens (default: 2048)")
    poisson.add_argument("--output-len", type=positive_int, default=128, help="output tokens (default: 128)")
    poisson.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0, fixed)",
    )
    poisson.add_argument(
        "--prefix-share",
        type=float,
        default=0.0,
        help="share of each prompt's 512-token blocks taken from a shared prefix (default: 0)",
    )
    poisson.add_argument(
        "--prefix-groups",
        type=int,
        default=8,
        help="distinct shared prefixes the requests pick from (default: 8)",
    )
    poisson.add_argument("--seed", type=int, default=0, help="default: 0")


def run(args: argparse.Namespace) -> int:
    return replay_command(args)


def replay_command(args: argparse.Namespace) -> int:
    from pdserve.loadgen.replay import ReplayError, ReplayOptions, run_replay
    from pdserve.loadgen.report import markdown, write_results
    from pdserve.loadgen.results import Slo
    from pdserve.loadgen.schedule import schedule
    from pdserve.loadgen.trace import PoissonSpec, TraceError, poisson_trace, read_trace, write_trace

    if args.trace == POISSON:
        spec = PoissonSpec(
            args.rate,
            args.num_requests,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.prefix_share,
            args.prefix_groups,
            args.seed,
        )
        found = spec.problems()
        if found:
            print("pdserve bench replay: " + "; ".join(found), file=sys.stderr)
            return EXIT_BAD_INPUT
        requests = poisson_trace(spec)
        workload = (
            f"Poisson {args.rate:g} req/s, input {args.input_len}, output {args.output_len}, "
            f"prefix share {args.prefix_share:g}"
        )
    else:
        path = Path(args.trace)
        if not path.is_file():
            print(
                f"pdserve bench replay: no trace file {path} (a Mooncake JSONL file, or `poisson`)",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        try:
            requests = read_trace(path)
        except TraceError as exc:
            print(f"pdserve bench replay: {exc}; nothing was sent", file=sys.stderr)
            return EXIT_BAD_INPUT
        workload = f"trace {path.name}"
    arrivals = schedule(requests, args.speedup, args.limit)
    options = ReplayOptions(
        url=args.url.rstrip("/"),
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        speedup=args.speedup,
        workload=workload,
        slo=Slo(args.slo_ttft_ms, args.slo_itl_ms),
        engine_urls=tuple(args.engine_url),
        admin_url=args.admin_url,
        metrics_interval_s=args.metrics_interval,
        timeout_s=args.timeout,
        max_connections=args.max_connections,
        ignore_eos=args.ignore_eos,
        progress=args.progress,
    )
    _raise_open_files_limit()
    try:
        outcome = _run(run_replay(arrivals, options))
    except ReplayError as exc:
        print(f"pdserve bench replay: {exc}", file=sys.stderr)
        return EXIT_FAILED
    title = f"pdserve bench replay: {workload}"
    if args.output:
        if args.trace == POISSON:
            args.output.mkdir(parents=True, exist_ok=True)
            write_trace(requests, args.output / "trace.jsonl")  # to replay the same workload again
        written = write_results(args.output, outcome.results, outcome.records, title)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    print(markdown(outcome.results, title))
    summary = outcome.results["summary"]
    return EXIT_FAILED if summary["sent"] and not summary["completed"] else 0


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def _raise_open_files_limit() -> None:
    """Thousands of requests in flight need as many sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
