"""Start-up benchmark of `pdserve proxy`: process start to /ready 200, and RSS once ready.

Why: the router must stay quick to start and small (issue 10: watching the table through the API
server must not cost what the Kubernetes client would). One run starts the proxy N times per
*variant* and reports the median, p90 and min of start-to-ready and the RSS at ready.

A variant is a source tree and a table source:

  * ``file``: ``--routing-file`` with a table of two routable instances;
  * ``configmap``: ``--routing-configmap NS/NAME --kubeconfig K`` against the test cluster
    (``make cluster-up`` first), with a ServiceAccount token kubeconfig as a router pod would have.

``--tree LABEL=DIR`` runs the proxy from another checkout (e.g. the commit before a change, made
with ``git archive <commit> | tar -x -C DIR``) with this virtualenv, so before and after are
measured in one run, interleaved (A B A B ...) so the machine's drifting load favours neither.
The backends never need to exist: readiness depends on the table only.

Results: a table on stdout, ``bench/results/proxy-start-<timestamp>.json`` and
``bench/results/proxy-start-latest.md``. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from tests.support.procs import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NAMESPACE = "pdserve-bench-start"
CONFIGMAP = "bench-routing"
READY_TIMEOUT_S = 60.0


def log(message: str) -> None:
    print(f"[start-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def table_json() -> str:
    def inst(name: str, port: int) -> dict[str, Any]:
        return {"name": name, "url": f"http://127.0.0.1:{port}", "dpSize": 2, "ready": True}

    doc = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "RoutingTable",
        "deployment": "bench",
        "generation": 1,
        "connector": {"type": "nixl"},
        "prefill": [inst("bench-prefill-0", 1)],
        "decode": [inst("bench-decode-0", 2)],
    }
    return json.dumps(doc)


@dataclass
class Variant:
    label: str
    tree: Path
    source: str  # "file" | "configmap"
    args: list[str]
    start_ms: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.label}/{self.source}"


def one_start(variant: Variant, log_dir: Path) -> tuple[float, float]:
    """Start the proxy once; (ms from spawn to /ready 200, RSS in MB at that moment)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "proxy", *variant.args]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}/ready"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    with (log_dir / f"{variant.name.replace('/', '-')}.log").open("ab") as out:
        started = time.perf_counter()
        popen = subprocess.Popen(cmd, cwd=variant.tree, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if popen.poll() is not None:
                    raise RuntimeError(
                        f"{variant.name}: proxy exited with {popen.returncode}; see {out.name}"
                    )
                if time.perf_counter() - started > READY_TIMEOUT_S:
                    raise RuntimeError(f"{variant.name}: not ready after {READY_TIMEOUT_S} s; see {out.name}")
                try:
                    with urllib.request.urlopen(url, timeout=1) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
                time.sleep(0.002)
            elapsed_ms = (time.perf_counter() - started) * 1000
            rss_mb = psutil.Process(popen.pid).memory_info().rss / 2**20
        finally:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(20)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
    return elapsed_ms, rss_mb


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p90": p90, "min": ordered[0], "max": ordered[-1]}


# --- the configmap source: a namespace, the ConfigMap, a ServiceAccount token kubeconfig ---------


def configmap_kubeconfig(admin_kubeconfig: Path, directory: Path) -> Path:
    """Create (or refresh) the bench's namespace, ConfigMap and router access; the router's kubeconfig."""
    sys.path.insert(0, str(REPO))
    from tests.support.kube import grant_router_access, kubectl_for, router_kubeconfig

    kubectl = kubectl_for(admin_kubeconfig)
    kubectl("create", "namespace", NAMESPACE, check=False)
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE},
        "data": {"routing.json": table_json()},
    }
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(cm))
    grant_router_access(kubectl, NAMESPACE, "bench-router", CONFIGMAP)
    return router_kubeconfig(kubectl, NAMESPACE, "bench-router", directory)


def _no_paths(arg: str) -> str:
    """Command-line words without this machine's paths (results are committed)."""
    head, sep, tail = arg.rpartition("=")
    if os.path.isabs(tail):
        return f"{head}{sep}<dir>"
    return arg


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Proxy start-up: process start to /ready 200, RSS at ready",
        "",
        f"Run {result['timestamp']} on {result['cpus']} CPU(s), 1-minute load average "
        f"{result['load_before']:.2f} before and {result['load_after']:.2f} after (other work shares "
        f"the machine); `python -m bench.proxy_start_bench {' '.join(result['argv'])}`.",
        f"{result['runs']} starts per variant, interleaved. `file` = `--routing-file`; `configmap` = "
        "`--routing-configmap` through the test cluster's API server with a ServiceAccount token.",
        "",
        "| variant | start→ready median ms | p90 ms | min ms | RSS median MB | RSS max MB |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        s, r = v["start_ms"], v["rss_mb"]
        lines.append(
            f"| {name} | {s['median']:.0f} | {s['p90']:.0f} | {s['min']:.0f} | "
            f"{r['median']:.1f} | {r['max']:.1f} |"
        )
    lines.append("")
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7, help="starts per variant (default %(default)s)")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="another source tree to measure (repeatable); this checkout is always measured as 'this'",
    )
    parser.add_argument(
        "--source",
        action="append",
        choices=["file", "configmap"],
        default=[],
        help="table sources to measure (repeatable; default file). Trees older than the ConfigMap "
        "watch are measured with the file source only",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=Path(os.environ.get("PDSERVE_TEST_KUBECONFIG") or REPO / ".cluster" / "kubeconfig"),
        help="admin kubeconfig of the test cluster, for the configmap source (default %(default)s)",
    )
    parser.add_argument("--note", action="append", default=[], help="a line for the markdown")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: timestamped)")
    args = parser.parse_args(argv)
    sources = args.source or ["file"]
    trees = [("this", REPO)]
    for spec in args.tree:
        label, _, directory = spec.partition("=")
        trees.append((label, Path(directory).resolve()))

    with tempfile.TemporaryDirectory(prefix="pdserve-start-bench-") as tmp:
        work = Path(tmp)
        routing = work / "routing.json"
        routing.write_text(table_json())
        router_kubeconfig: Path | None = None
        if "configmap" in sources:
            log(f"preparing ConfigMap {NAMESPACE}/{CONFIGMAP} and a router token through {args.kubeconfig}")
            router_kubeconfig = configmap_kubeconfig(args.kubeconfig, work)
        variants: list[Variant] = []
        for label, tree in trees:
            proxy = tree / "pdserve" / "proxy"
            watch_capable = (proxy / "table" / "configmap.py").exists() or (proxy / "kubewatch.py").exists()
            for source in sources:
                if source == "file":
                    variants.append(Variant(label, tree, source, ["--routing-file", str(routing)]))
                elif watch_capable and router_kubeconfig is not None:
                    cm_args = ["--routing-configmap", f"{NAMESPACE}/{CONFIGMAP}"]
                    variants.append(
                        Variant(label, tree, source, [*cm_args, "--kubeconfig", str(router_kubeconfig)])
                    )
        load_before = os.getloadavg()[0]
        for variant in variants:  # one warm-up each: page cache, .pyc files
            one_start(variant, work)
        for i in range(args.runs):
            for variant in variants if i % 2 == 0 else reversed(variants):
                ms, mb = one_start(variant, work)
                variant.start_ms.append(ms)
                variant.rss_mb.append(mb)
            log(
                f"round {i + 1}/{args.runs}: "
                + ", ".join(f"{v.name} {v.start_ms[-1]:.0f} ms" for v in variants)
            )
        load_after = os.getloadavg()[0]
        if router_kubeconfig is not None:
            from tests.support.kube import kubectl_for

            kubectl_for(args.kubeconfig)("delete", "namespace", NAMESPACE, "--wait=false", check=False)

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result: dict[str, Any] = {
        "timestamp": stamp,
        "argv": [_no_paths(a) for a in (argv if argv is not None else sys.argv[1:])],
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "runs": args.runs,
        "trees": {label: str(tree.relative_to(REPO)) if tree == REPO else label for label, tree in trees},
        "notes": args.note,
        "variants": {
            v.name: {
                "start_ms": summary(v.start_ms),
                "rss_mb": summary(v.rss_mb),
                "samples": {"start_ms": v.start_ms, "rss_mb": v.rss_mb},
            }
            for v in variants
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / f"proxy-start-{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (RESULTS / "proxy-start-latest.md").write_text(text)
    print(text)
    log(f"wrote {out} and {RESULTS / 'proxy-start-latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
