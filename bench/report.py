"""Summaries, the printed table, latest.md and the PNG chart of the proxy benchmark."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Summary:
    system: str
    load: str  # "stream" | "burst"
    requests: int
    ok: int
    failed: int
    failures: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    #: CPU time of the proxy process(es) per successful request; None for ``direct``. Steadier than
    #: req/s on a machine shared with other work.
    proxy_cpu_ms: float | None = None
    #: Proxy CPU per streamed chunk (an SSE event) in microseconds; None for buffered answers.
    proxy_cpu_us_per_chunk: float | None = None
    #: Peak resident memory of the proxy (all its processes) during the load, and before it.
    rss_mb: float | None = None
    rss_base_mb: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(
    system: str, load: str, result: Mapping[str, Any], proxy_cpu_s: float | None = None, chunks: int = 0
) -> Summary:
    latencies = list(result["latencies_s"])
    per_chunk = None
    if proxy_cpu_s is not None and chunks and latencies:
        per_chunk = round(proxy_cpu_s * 1e6 / (len(latencies) * chunks), 1)
    rss = result.get("rss_peak_bytes")
    base = result.get("rss_base_bytes")
    failures = dict(result["failures"])
    wall = float(result["wall_s"])
    return Summary(
        system=system,
        load=load,
        requests=int(result["requests"]),
        ok=len(latencies),
        failed=sum(failures.values()),
        failures=failures,
        wall_s=round(wall, 3),
        rps=round(len(latencies) / wall, 1) if wall > 0 else 0.0,
        p50_ms=round(percentile(latencies, 50) * 1000, 2),
        p99_ms=round(percentile(latencies, 99) * 1000, 2),
        proxy_cpu_ms=None if proxy_cpu_s is None else round(proxy_cpu_s * 1000 / max(1, len(latencies)), 2),
        proxy_cpu_us_per_chunk=per_chunk,
        rss_mb=round(rss / 2**20, 1) if rss else None,
        rss_base_mb=round(base / 2**20, 1) if base else None,
    )


def ratios(summaries: Sequence[Summary], numerator: str, denominator: str) -> dict[str, dict[str, float]]:
    """Per load: numerator/denominator of requests/s, p50 and p99.

    rps above 1 and latencies below 1 favour the numerator.
    """
    out: dict[str, dict[str, float]] = {}
    by_key = {(s.system, s.load): s for s in summaries}
    for load in sorted({s.load for s in summaries}):
        a, b = by_key.get((numerator, load)), by_key.get((denominator, load))
        if a is None or b is None:
            continue
        out[load] = {
            "rps": round(a.rps / b.rps, 2) if b.rps else 0.0,
            "p50": round(a.p50_ms / b.p50_ms, 2) if b.p50_ms else 0.0,
            "p99": round(a.p99_ms / b.p99_ms, 2) if b.p99_ms else 0.0,
            "cpu": round(a.proxy_cpu_ms / b.proxy_cpu_ms, 2) if a.proxy_cpu_ms and b.proxy_cpu_ms else 0.0,
        }
    return out


COLUMNS = (
    ("system", 15),
    ("load", 11),
    ("ok", 5),
    ("failed", 6),
    ("req/s", 8),
    ("p50 ms", 8),
    ("p99 ms", 8),
    ("proxy CPU ms/req", 16),
    ("CPU µs/chunk", 12),
    ("RSS MB (before)", 15),
)


def table(summaries: Sequence[Summary]) -> str:
    def row(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))
            )
            + " |"
        )

    lines = [row([title for title, _ in COLUMNS]), "|" + "|".join("-" * (w + 2) for _, w in COLUMNS) + "|"]
    for s in summaries:
        cells = [
            s.system,
            s.load,
            str(s.ok),
            str(s.failed),
            f"{s.rps:.1f}",
            f"{s.p50_ms:.2f}",
            f"{s.p99_ms:.2f}",
            "-" if s.proxy_cpu_ms is None else f"{s.proxy_cpu_ms:.2f}",
            "-" if s.proxy_cpu_us_per_chunk is None else f"{s.proxy_cpu_us_per_chunk:.1f}",
            "-" if s.rss_mb is None else f"{s.rss_mb:.0f} ({s.rss_base_mb or 0:.0f})",
        ]
        lines.append(row(cells))
    return "\n".join(lines)


def markdown(summaries: Sequence[Summary], meta: Mapping[str, Any], chart_name: str) -> str:
    lines = [
        "# Proxy benchmark: latest run",
        "",
        f"Run {meta['timestamp']} on {meta['cpus']} CPU(s), 1-minute load average {meta['load_average'][0]} "
        f"before and {meta['load_average'][1]} after (other work shares the machine; req/s move with it, "
        "proxy CPU per request much less); `make bench` (`python -m bench.proxy_bench`).",
        *([f"Layout: {meta['layout']}."] if meta.get("layout") else []),
        f"Backends: {meta['backends']}.",
        f"Loads: {meta['loads']}.",
        "`direct` is the floor: clients talking to the decode simulator without any proxy.",
        "",
        table(summaries),
        "",
    ]
    for (num, den), per_load in meta.get("ratios", {}).items():
        for load, r in per_load.items():
            lines.append(
                f"- {num}/{den}, {load}: req/s x{r['rps']}, p50 x{r['p50']}, p99 x{r['p99']}, "
                f"proxy CPU per request x{r['cpu']}"
            )
    if meta.get("targets"):
        lines += [
            "",
            "Targets of issue 13 (pdserve's default configuration against vllm-router, this run):",
            "",
        ]
        lines += [f"- {target}" for target in meta["targets"]]
        lines.append("")
    failures = [s for s in summaries if s.failed]
    for s in failures:
        lines.append(f"- failures of {s.system} ({s.load}): {s.failures}")
    if meta.get("notes"):
        lines += ["", *[f"- {note}" for note in meta["notes"]]]
    lines += ["", f"![requests/s and latency per system]({chart_name})", ""]
    return "\n".join(lines)


#: Loads where pdserve must match vllm-router's req/s and p99; bursts: 0 failed and p50.
THROUGHPUT_LOADS = ("stream-c64", "stream-c256", "plain-c64", "long-256tok")
BURST_LOADS = ("burst-2048", "burst-4096")
CPU_TARGET_MS = 1.5


def targets(summaries: Sequence[Summary], ours: str = "pdserve", theirs: str = "vllm-router") -> list[str]:
    """Each target of the issue, met or not, with the figures that decide it."""
    by_key = {(s.system, s.load): s for s in summaries}
    out = []
    for load in THROUGHPUT_LOADS:
        a, b = by_key.get((ours, load)), by_key.get((theirs, load))
        if a is None or b is None:
            continue
        rps, p99 = a.rps / b.rps if b.rps else 0.0, a.p99_ms / b.p99_ms if b.p99_ms else 0.0
        verdict = "met" if rps >= 1.0 and p99 <= 1.0 else "NOT met"
        out.append(f"{load}: req/s x{rps:.2f} (>= 1.0), p99 x{p99:.2f} (<= 1.0): {verdict}")
    for load in BURST_LOADS:
        a, b = by_key.get((ours, load)), by_key.get((theirs, load))
        if a is None or b is None:
            continue
        p50 = a.p50_ms / b.p50_ms if b.p50_ms else 0.0
        verdict = "met" if a.failed == 0 and p50 <= 1.0 else "NOT met"
        out.append(f"{load}: {a.failed} failed (0), p50 x{p50:.2f} (<= 1.0): {verdict}")
    a = by_key.get((ours, "stream-c64"))
    if a is not None and a.proxy_cpu_ms is not None:
        verdict = "met" if a.proxy_cpu_ms <= CPU_TARGET_MS else "NOT met"
        out.append(
            f"proxy CPU per request (stream-c64): {a.proxy_cpu_ms:.2f} ms (<= {CPU_TARGET_MS}): {verdict}; "
            f"per streamed chunk (long-256tok): "
            + (
                f"{by_key[(ours, 'long-256tok')].proxy_cpu_us_per_chunk} µs"
                if (ours, "long-256tok") in by_key
                else "not measured"
            )
        )
    a = by_key.get((ours, "open-1000"))
    if a is not None and a.rss_mb is not None:
        b = by_key.get((theirs, "open-1000"))
        theirs_rss = f", vllm-router {b.rss_mb:.0f} MB" if b is not None and b.rss_mb else ""
        out.append(f"RSS at 1000 open streams: {a.rss_mb:.0f} MB (reported){theirs_rss}")
    return out


def chart(summaries: Sequence[Summary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({s.load for s in summaries}, reverse=True)
    systems = list(dict.fromkeys(s.system for s in summaries))
    by_key = {(s.system, s.load): s for s in summaries}
    fig, axes = plt.subplots(len(loads), 2, figsize=(10, 3.6 * len(loads)), squeeze=False)
    width = 0.8 / max(1, len(systems))
    for row, load in enumerate(loads):
        rps_ax, lat_ax = axes[row]
        for i, system in enumerate(systems):
            s = by_key.get((system, load))
            if s is None:
                continue
            rps_ax.bar(i, s.rps, color=f"C{i}", label=system)
            lat_ax.bar(
                [0 + i * width, 1 + i * width], [s.p50_ms, s.p99_ms], width, color=f"C{i}", label=system
            )
        rps_ax.set_xticks(range(len(systems)), systems)
        rps_ax.set_title(f"{load}: requests/s (higher is better)")
        centre = (len(systems) - 1) * width / 2
        lat_ax.set_xticks([centre, 1 + centre], ["p50", "p99"])
        lat_ax.set_title(f"{load}: latency ms (lower is better)")
        lat_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(
    results: Path, prefix: str, summaries: Sequence[Summary], meta: Mapping[str, Any], args: Mapping[str, Any]
) -> list[str]:
    """``<prefix><timestamp>.json`` and ``.png``, ``<prefix>latest.md`` and ``.png``; their names."""
    results.mkdir(parents=True, exist_ok=True)
    stamp = f"{prefix}{meta['timestamp']}"
    chart(summaries, results / f"{stamp}.png")
    shutil.copyfile(results / f"{stamp}.png", results / f"{prefix}latest.png")
    document = {
        **{k: v for k, v in meta.items() if k != "ratios"},
        "ratios": {f"{n}/{d}": r for (n, d), r in meta["ratios"].items()},
        "args": dict(args),
        "results": [s.to_dict() for s in summaries],
    }
    (results / f"{stamp}.json").write_text(json.dumps(document, indent=2) + "\n")
    (results / f"{prefix}latest.md").write_text(markdown(summaries, meta, f"{prefix}latest.png"))
    return [f"{stamp}.json", f"{stamp}.png", f"{prefix}latest.md", f"{prefix}latest.png"]
