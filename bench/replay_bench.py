"""The Mooncake trace through a local deployment: latency, goodput, prefix-cache hits, load per slot.

Starts ``pdserve up MANIFEST --sim-profile PROFILE`` (default examples/sim/mooncake.yaml with the
step engine of h200-llama-3.1-8b, prefix caching on), replays the shared Mooncake trace
time-compressed (x4 by default) with ``pdserve bench replay``'s own code, stops the
deployment, and writes ``bench/results/replay-<label>-<timestamp>.json`` plus
``replay-<label>.md`` and ``.png`` (label ``latest`` by default: ``replay-latest.md``). A benchmark,
not a test: it asserts nothing. Run with ``make bench-replay`` or ``python -m bench.replay_bench``.

Built to be the base of other benches: ``--manifest`` picks the deployment (another router policy,
P:D ratio, engine profile), ``--up-arg`` passes flags to ``pdserve up``, ``--url`` replays against
a deployment already running (then nothing is started), and ``--label`` keeps each variant's
results apart (``--label cache-aware`` writes replay-cache-aware.md), so variants are compared
run after run from their JSON.

The trace: ``--trace FILE``, else ``$PDSERVE_MOONCAKE_TRACE``, else
``shared/data/mooncake/synthetic_trace.jsonl`` in the nearest folder above the repository that has
one (this machine's layout; CI's copy of shared/ sits beside the clone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.loadgen.replay import ReplayOptions, run_replay
from pdserve.loadgen.report import write_results
from pdserve.loadgen.results import Slo
from pdserve.loadgen.schedule import schedule
from pdserve.loadgen.trace import read_trace
from tests.support.procs import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_MANIFEST = REPO / "examples" / "sim" / "mooncake.yaml"
DEFAULT_PROFILE = "h200-llama-3.1-8b"
TRACE_IN_SHARED = Path("shared") / "data" / "mooncake" / "synthetic_trace.jsonl"


def find_trace(given: Path | None) -> Path:
    if given is not None:
        return given
    if os.environ.get("PDSERVE_MOONCAKE_TRACE"):
        return Path(os.environ["PDSERVE_MOONCAKE_TRACE"])
    for parent in REPO.parents:
        if (parent / TRACE_IN_SHARED).is_file():
            return parent / TRACE_IN_SHARED
    raise SystemExit(
        "no Mooncake trace found: pass --trace FILE or set PDSERVE_MOONCAKE_TRACE "
        "(synthetic_trace.jsonl of the Mooncake FAST'25 release)"
    )


def _slots_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/debug/routing", timeout=2) as resp:
            debug = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    table = debug.get("table") or {}
    instances = [*table.get("prefill", []), *table.get("decode", [])]
    return bool(instances) and all(i.get("ready") and not i.get("draining") for i in instances)


@contextmanager
def deployment(manifest: Path, up_args: list[str], log: Path) -> Iterator[str]:
    """``pdserve up`` on a free port until every instance is routable; stopped (SIGTERM) after."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        str(manifest),
        "--port",
        str(port),
        "--no-view",
        *up_args,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _slots_ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve up did not serve {manifest}:\n{log.read_text(errors='replace')}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _portable(path: Path) -> str:
    """A path without this machine's folders (results are committed)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, help="a Mooncake JSONL trace (default: see above)")
    parser.add_argument(
        "--manifest", type=Path, default=DEFAULT_MANIFEST, help="the deployment `pdserve up` runs"
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"the sims' performance profile (`pdserve up --sim-profile`; default: {DEFAULT_PROFILE}); "
        "`none`: today's fixed-time sims",
    )
    parser.add_argument("--up-arg", action="append", default=[], help="a flag for `pdserve up` (repeat)")
    parser.add_argument("--url", help="replay against this running deployment instead of starting one")
    parser.add_argument(
        "--label", default="latest", help="names the results: replay-<label>.md (default: latest)"
    )
    parser.add_argument("--speedup", type=float, default=4.0, help="trace time compression (default: 4)")
    parser.add_argument("--limit", type=int, help="the first N requests only")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO (default: 2000)")
    parser.add_argument("--slo-itl-ms", type=float, default=100.0, help="goodput SLO (default: 100)")
    args = parser.parse_args(argv)

    trace = find_trace(args.trace)
    up_args = [*(["--sim-profile", args.profile] if args.profile != "none" else []), *args.up_arg]
    arrivals = schedule(read_trace(trace), args.speedup, args.limit)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    manifest = "(running deployment)" if args.url else _portable(args.manifest)
    options = ReplayOptions(
        url="",
        speedup=args.speedup,
        workload=f"Mooncake {trace.name}" + (f" (first {args.limit})" if args.limit else ""),
        slo=Slo(args.slo_ttft_ms, args.slo_itl_ms),
        extra={"bench": {"label": args.label, "manifest": manifest, "up_args": up_args, "run": stamp}},
    )
    print(
        f"replaying {len(arrivals)} requests of {trace.name} at x{args.speedup:g} through {manifest}",
        flush=True,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="replay-bench-"))
    serving = _given(args.url) if args.url else deployment(args.manifest, up_args, log_dir / "up.log")
    with serving as url:
        outcome = _run(arrivals, options, url)
    shutil.rmtree(log_dir, ignore_errors=True)

    results: dict[str, Any] = outcome.results
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"replay-{args.label}"
    profile = f", profile {args.profile}" if args.profile != "none" and not args.url else ""
    title = f"Mooncake replay ({args.label}): {manifest}{profile}, x{args.speedup:g}"
    written = write_results(RESULTS, results, outcome.records, title, stem=stem, per_request=False)
    archive = RESULTS / f"replay-{args.label}-{stamp}.json"
    (RESULTS / f"{stem}.json").rename(archive)
    print((RESULTS / f"{stem}.md").read_text())
    print("wrote", ", ".join(_portable(p) for p in [archive, *written[1:]]))
    return 0


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


def _run(arrivals: Any, options: ReplayOptions, url: str) -> Any:
    import dataclasses

    import uvloop

    return uvloop.run(run_replay(arrivals, dataclasses.replace(options, url=url)))


if __name__ == "__main__":
    sys.exit(main())
