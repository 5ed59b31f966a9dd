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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pdserve.argtypes import add_flags, flag_values, non_negative_float, positive_float, positive_int, setting

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


@dataclass(frozen=True)
class ReplayFlags:
    """What to replay, against which server, and what counts (the fields ReplayOptions shares
    with it are its own)."""

    trace: str = setting(
        None,
        "trace",
        metavar="TRACE",
        help="a Mooncake JSONL file (timestamp ms, input_length, output_length, hash_ids), or `poisson` "
        "for a generated workload (--rate, --num-requests, ...)",
    )
    url: str = setting(
        "http://127.0.0.1:8000", "--url", help="the server (default: http://127.0.0.1:8000, `pdserve up`'s)"
    )
    model: str | None = setting(
        None, "--model", help="the model to ask for (default: the first one the server lists at /v1/models)"
    )
    endpoint: str = setting(
        "completions",
        "--endpoint",
        choices=("completions", "chat"),
        help="/v1/completions (default) or /v1/chat/completions",
    )
    api_key: str | None = setting(
        None, "--api-key", help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)"
    )
    speedup: float = setting(
        1.0,
        "--speedup",
        type=positive_float,
        help="compress the trace's time: 10 sends in 100 s what it spreads over 1000 s (default: 1)",
    )
    limit: int | None = setting(
        None, "--limit", type=positive_int, help="replay only the first N requests (by timestamp)"
    )
    output: Path | None = setting(  # noqa: RUF009 (a Path is immutable)
        None,
        "--output",
        type=Path,
        metavar="DIR",
        help="write results.json, results.md, results.png and requests.jsonl there",
    )
    slo_ttft_ms: float | None = setting(
        None,
        "--slo-ttft-ms",
        type=positive_float,
        help="goodput: a request's time to first token at most this",
    )
    slo_itl_ms: float | None = setting(
        None,
        "--slo-itl-ms",
        type=positive_float,
        help="goodput: a request's mean inter-token latency (TPOT) at most this",
    )
    admin_url: str | None = setting(
        None,
        "--admin-url",
        help="where the pdserve router answers /debug/routing, to find the engines (default: --url; "
        "a router with --admin-port answers there)",
    )
    engine_url: tuple[str, ...] = setting(
        (),
        "--engine-url",
        action="append",
        metavar="URL",
        help="an engine API server whose /metrics to read, instead of asking the router (repeat)",
    )
    metrics_interval_s: float = setting(
        1.0,
        "--metrics-interval",
        type=non_negative_float,
        metavar="S",
        help="read the engines' metrics every S seconds for the load plot; 0: only before and after",
    )
    timeout_s: float = setting(
        600.0,
        "--timeout",
        type=positive_float,
        metavar="S",
        help="a request not fully answered after S seconds fails as a timeout (default: 600)",
    )
    max_connections: int = setting(
        0,
        "--max-connections",
        help="cap on open connections (default 0: none; a capped client queues requests itself)",
    )
    ignore_eos: bool = setting(
        True,
        "--no-ignore-eos",
        action="store_false",
        help="let the model stop early; by default ignore_eos asks for exactly output_length tokens",
    )
    progress: bool = setting(True, "--no-progress", action="store_false", help="no progress bar on stderr")


@dataclass(frozen=True)
class PoissonFlags:
    """A generated workload (TRACE ``poisson``): PoissonSpec's fields."""

    rate: float = setting(10.0, "--rate", type=positive_float, help="requests per second (default: 10)")
    num_requests: int = setting(1000, "--num-requests", type=positive_int, help="default: 1000")
    input_length: int = setting(2048, "--input-len", type=positive_int, help="prompt tokens (default: 2048)")
    output_length: int = setting(128, "--output-len", type=positive_int, help="output tokens (default: 128)")
    range_ratio: float = setting(
        0.0, "--range-ratio", help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0, fixed)"
    )
    prefix_share: float = setting(
        0.0,
        "--prefix-share",
        help="share of each prompt's 512-token blocks taken from a shared prefix (default: 0)",
    )
    prefix_groups: int = setting(
        8, "--prefix-groups", help="distinct shared prefixes the requests pick from (default: 8)"
    )
    seed: int = setting(0, "--seed", help="default: 0")


def configure_replay(p: argparse.ArgumentParser) -> None:
    add_flags(p, ReplayFlags)
    add_flags(p, PoissonFlags, p.add_argument_group("poisson workload (TRACE `poisson`)"))


def run(args: argparse.Namespace) -> int:
    return replay_command(args)


def replay_command(args: argparse.Namespace) -> int:
    from pdserve.loadgen.replay import ReplayError, ReplayOptions, run_replay
    from pdserve.loadgen.report import markdown, write_results
    from pdserve.loadgen.results import Slo
    from pdserve.loadgen.schedule import schedule
    from pdserve.loadgen.trace import PoissonSpec, TraceError, poisson_trace, read_trace, write_trace

    if args.trace == POISSON:
        spec = PoissonSpec(**flag_values(args, PoissonFlags))
        found = spec.problems()
        if found:
            print("pdserve bench replay: " + "; ".join(found), file=sys.stderr)
            return EXIT_BAD_INPUT
        requests = poisson_trace(spec)
        workload = (
            f"Poisson {spec.rate:g} req/s, input {spec.input_length}, output {spec.output_length}, "
            f"prefix share {spec.prefix_share:g}"
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
    given = flag_values(args, ReplayFlags, into=ReplayOptions)
    given.update(url=args.url.rstrip("/"), api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None)
    options = ReplayOptions(
        **given,
        workload=workload,
        slo=Slo(args.slo_ttft_ms, args.slo_itl_ms),
        engine_urls=tuple(args.engine_url),
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
