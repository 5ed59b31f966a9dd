"""A replay's results as files: JSON (everything), markdown (the headline tables) and a PNG
(latency and load over time). The PNG needs matplotlib (``pip install 'pdserve[plot]'``); without
it the other files are still written and the report says why the plot is missing."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.loadgen.results import PERCENTILES, RequestRecord


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def markdown(results: Mapping[str, Any], title: str = "Replay") -> str:
    s = results["summary"]
    cfg = results["config"]
    lines = [f"# {title}", ""]
    lines.append(
        f"{cfg['workload']} against {cfg['url']} (model `{cfg['model']}`, {cfg['endpoint']}), "
        f"speed-up x{cfg['speedup']:g}, {s['requests']} requests"
        + (f", offered {cfg['offered_rate']:.2f} req/s" if cfg.get("offered_rate") else "")
        + f"; started {cfg['started']}."
    )
    lines.append("")
    failures = ", ".join(f"{k} {n}" for k, n in s["failures"].items())
    lines += [
        f"- completed {s['completed']}, failed {s['failed']}"
        + (f" ({failures})" if failures else "")
        + (f", not sent {s['not_sent']} (interrupted)" if s.get("not_sent") else ""),
        f"- duration {s['duration_s']:.1f} s: {s['request_throughput'] or 0:.2f} req/s, "
        f"{s['output_token_throughput'] or 0:,.0f} output tok/s, "
        f"{s['input_token_throughput'] or 0:,.0f} input tok/s",
    ]
    good = s.get("goodput")
    if good:
        slos = " and ".join(
            f"{name} <= {value:g} ms"
            for name, value in (("TTFT", good["slo_ttft_ms"]), ("mean ITL", good["slo_itl_ms"]))
            if value is not None
        )
        lines.append(
            f"- goodput ({slos}): {good['good']} requests ({_ratio(good['share'])}), "
            f"{good['request_throughput'] or 0:.2f} req/s"
        )
    lines += ["", "| latency (ms) | mean | " + " | ".join(f"p{p}" for p in PERCENTILES) + " | max |"]
    lines.append("|---|" + "---:|" * (len(PERCENTILES) + 2))
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "e2e")):
        d = s.get(key)
        if d:
            cells = [_ms(d["mean"]), *(_ms(d[f"p{p}"]) for p in PERCENTILES), _ms(d["max"])]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += _cache_lines(results)
    lines += _slot_lines(results.get("engines"))
    client = results["client"]
    lag = s.get("send_lag_ms") or {}
    lines += [
        "## The client",
        "",
        f"CPU {client['cpu_s']:.2f} s ({client['cpu_ms_per_request']:.2f} ms per request"
        + (
            f", {client['cpu_us_per_chunk']:.0f} us per streamed chunk"
            if client.get("cpu_us_per_chunk")
            else ""
        )
        + "), "
        f"at most {client['max_in_flight']} requests in flight; sent late by p50 {_ms(lag.get('p50'))} ms, "
        f"p99 {_ms(lag.get('p99'))} ms, max {_ms(lag.get('max'))} ms"
        + (
            " (requests left late: the client was short of CPU, on a busy machine or at its limit; "
            "latencies above include that delay only from the send on)"
            if client.get("saturated")
            else ""
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def _cache_lines(results: Mapping[str, Any]) -> list[str]:
    engines = results.get("engines") or {}
    by_role = engines.get("by_role") or {}
    usage = results["summary"].get("usage_cached_tokens")
    ideal = results.get("trace", {}).get("ideal_hit_ratio")
    lines = ["## Prefix cache", ""]
    rows = [
        f"| {role} | {_ratio(r['prefix_cache_hit_ratio'])} "
        f"| {r['prefix_cache_hits']:,} / {r['prefix_cache_queries']:,} |"
        for role, r in by_role.items()
        if r.get("prefix_cache_queries") is not None
    ]
    if rows:
        lines += ["| engines | hit ratio | hit / queried tokens |", "|---|---:|---:|", *rows, ""]
    else:
        lines.append(
            f"The engines' prefix-cache metrics: {engines.get('note') or 'not exported by these engines'}."
        )
        lines.append("")
    if usage:
        lines.append(
            f"Per request (usage.prompt_tokens_details): {_ratio(usage['hit_ratio'])} of "
            f"{usage['prompt_tokens']:,} prompt tokens cached, over {usage['requests']} requests"
            + (
                " (the decode's count, as vLLM's: the KV it pulled from the prefill counts as cached)."
                if "decode" in by_role
                else "."
            )
        )
    if ideal is not None:
        lines.append(f"The trace's own prefix reuse (one unbounded cache, in order): {_ratio(ideal)}.")
    lines.append("")
    return lines


def _slot_lines(engines: Mapping[str, Any] | None) -> list[str]:
    if not engines or not engines.get("slots"):
        return []
    lines = [
        "## Load per slot",
        "",
        "| slot | requests | prompt tokens | hit ratio | preemptions |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, slot in engines["slots"].items():
        lines.append(
            f"| {key} | {slot['requests']} | {slot['prompt_tokens']:,} "
            f"| {_ratio(slot['prefix_cache_hit_ratio'])} "
            f"| {slot['preemptions'] if slot['preemptions'] is not None else '-'} |"
        )
    imbalance = [
        f"{role} {r['imbalance']:.2f}" for role, r in engines["by_role"].items() if r.get("imbalance")
    ]
    if imbalance:
        lines += ["", f"Max over mean requests per slot: {', '.join(imbalance)} (1.00: even)."]
    if engines.get("unreachable"):
        lines += ["", f"Not read: {', '.join(engines['unreachable'])}."]
    lines.append("")
    return lines


def plot(
    results: Mapping[str, Any], records: Sequence[RequestRecord], path: Path, title: str = "Replay"
) -> str | None:
    """Latency (TTFT and e2e of each request, by send time), ITL, and load over time; None when
    written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install 'pdserve[plot]')"
    fig, (lat, load) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    done = [r for r in records if r.ok and r.sent_s is not None]
    lat.scatter(
        [r.sent_s for r in done], [r.e2e_ms for r in done], s=4, alpha=0.4, label="e2e", color="tab:gray"
    )
    lat.scatter(
        [r.sent_s for r in done], [r.ttft_ms for r in done], s=4, alpha=0.6, label="TTFT", color="tab:blue"
    )
    failed = [r for r in records if not r.ok and r.sent_s is not None]
    if failed:
        lat.scatter(
            [r.sent_s for r in failed], [1.0] * len(failed), s=10, marker="x", color="tab:red", label="failed"
        )
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms), by send time")
    lat.grid(True, which="both", alpha=0.3)
    lat.legend(loc="upper left", fontsize=8)
    bins = results.get("timeline") or []
    width = results["config"].get("bin_s", 1.0)
    t = [b["t_s"] for b in bins] + [bins[-1]["t_s"] + width] if bins else []  # up to the last bin's end

    def steps(key: str, scale: float = 1.0) -> list[float]:
        values = [b[key] / scale for b in bins]
        return values + values[-1:]

    load.step(t, steps("in_flight"), where="post", label="client: in flight", color="black")
    load.step(t, steps("sent", width), where="post", label="client: sent per s", color="tab:green", alpha=0.6)
    series = results.get("load") or []
    for key, color in (
        ("prefill_running", "tab:orange"),
        ("prefill_waiting", "tab:red"),
        ("decode_running", "tab:purple"),
        ("decode_waiting", "tab:pink"),
        ("engine_running", "tab:orange"),
        ("engine_waiting", "tab:red"),
    ):
        points = [(row["t_s"], row[key]) for row in series if key in row]
        if points and any(v for _, v in points):
            load.plot(*zip(*points, strict=True), label=f"engines: {key.replace('_', ' ')}", color=color)
    load.set_xlabel("seconds since the first request")
    load.set_ylabel("requests")
    load.grid(True, alpha=0.3)
    load.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_results(
    directory: Path,
    results: Mapping[str, Any],
    records: Sequence[RequestRecord],
    title: str = "Replay",
    stem: str = "results",
    per_request: bool = True,
) -> list[Path]:
    """``<stem>.json``, ``<stem>.png``, ``<stem>.md`` and ``requests.jsonl`` (one line per request)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = directory / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    written.append(json_path)
    text = markdown(results, title)
    png = directory / f"{stem}.png"
    problem = plot(results, records, png, title)
    if problem is None:
        text += f"\n![latency and load over time]({png.name})\n"
        written.append(png)
    else:
        text += f"\n({problem})\n"
    md = directory / f"{stem}.md"
    md.write_text(text, encoding="utf-8")
    written.append(md)
    if per_request:
        lines = directory / "requests.jsonl"
        lines.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records), encoding="utf-8")
        written.append(lines)
    return written
