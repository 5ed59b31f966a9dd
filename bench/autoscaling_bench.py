"""The autoscaler against fixed sizes and per-role HPA, on the Mooncake trace (issue 27, item 7).

Four deployments serve the same replay (``pdserve bench replay``'s code) of the shared Mooncake
trace through ``pdserve up``, time-compressed (x4 by default), on step-engine simulators of the
``synthetic-autoscaling`` profile (a synthetic engine sized so that the trace's peak needs several
instances per role; pdserve/sim/engine/profiles/):

* ``pdserve``: spec.autoscaling, the objectives TTFT p99 <= 2 s and ITL p99 <= 50 ms, run first;
* ``fixed-peak``: each role at the most instances the autoscaler ran of it;
* ``fixed-mean``: each role at its time-averaged count in that run, rounded up;
* ``hpa``: each role scaled on its own, as an HPA (or KEDA) user sets it up on the engines' load:
  the average of vLLM's ``num_requests_running + num_requests_waiting`` per instance against a
  target per role (:data:`HPA_TARGETS`, what one instance of the profile holds at the objectives),
  HPA's algorithm (``ceil(instances x metric / target)`` outside the tolerance) and HPA's behavior
  (the same stabilisation windows and step policies as the autoscaler's, the same bounds).

Every time figure of the autoscalers (decision period, measurement window, stabilisation windows,
policy periods) is divided by the speed-up, as the trace's time is. For each: the share of
requests within both objectives, instance-seconds per role (the GPU bill: every instance from
its start to its stop, starting and draining included), scale events, and a plot of the instances
per role against the offered load. Beside them, what an ideal autoscaler that follows the
trace's load exactly would bill against fixed-at-peak (bench/autoscaling_bound.py): how much the
trace leaves to save, whatever decides the counts. Results: bench/results/autoscaling-latest.md
and .png, and autoscaling-<timestamp>.json. A benchmark, not a test: it asserts nothing; the
targets of the issue are printed against the figures.

Run with ``make bench-autoscaling`` or ``python -m bench.autoscaling_bench`` (about 20 minutes at
x4); ``--limit N`` replays the first N requests only; ``--swing F --label swing`` replays the
same requests with the first and last third of them at 1/F of the trace's rate (a load that swings,
which the trace's own Poisson arrivals at one rate do not). ``serve`` is the entry the ``hpa`` run
starts ``pdserve up`` through (with its policy in place of the autoscaler's).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench.autoscaling_bound import Bound, bound, swing
from bench.replay_bench import find_trace
from pdserve.deployment.plan.autoscale import (
    ROLES,
    Decision,
    RoleDecision,
    RoleState,
)
from pdserve.deployment.plan.behavior import stabilised, step_limited
from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.loadgen.replay import ReplayOptions, run_replay
from pdserve.loadgen.results import RequestRecord, Slo
from pdserve.loadgen.schedule import Arrival, schedule
from pdserve.loadgen.trace import read_trace
from pdserve.local.scaler import LocalScaler
from pdserve.sim.engine.profile import load as load_profile
from pdserve.wire.load import percentile
from tests.support.procs import free_port
from tests.support.specs import sim_manifest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PROFILE = "synthetic-autoscaling"
TTFT_MS, ITL_MS, PERCENTILE = 2000.0, 50.0, 99.0
BOUNDS = {"prefill": (1, 10), "decode": (1, 8)}
START = {"prefill": 3, "decode": 4}
#: HPA's targets: requests in an engine (running + waiting) per instance. A prefill slot of the
#: profile keeps TTFT p90 near 2 s up to about 2 prompts in it (it shares its steps among them);
#: a decode slot keeps ITL near 50 ms up to about 30 sequences (5 ms + 1.3 ms per 15k-token sequence).
HPA_TARGETS = {"prefill": 2.0, "decode": 30.0}
CONFIGS = ("pdserve", "fixed-peak", "fixed-mean", "hpa")
SAMPLE_S = 0.5


# --- the deployments ------------------------------------------------------------------------------


def manifest(counts: Mapping[str, int], speedup: float, autoscaled: bool) -> dict[str, Any]:
    """The bench's deployment: ``counts`` instances of each role (the start, when autoscaled), with
    the autoscaler's time figures divided by ``speedup``."""
    args = ["--max-model-len", "200000"]
    spec: dict[str, Any] = {
        "prefill": {"instances": counts["prefill"], "args": args},
        "decode": {"instances": counts["decode"], "args": args},
        "rollout": {"drainSeconds": max(2, round(30 / speedup))},
    }
    if autoscaled:
        period = max(1, round(15 / speedup))
        spec["autoscaling"] = {
            "prefill": {"minInstances": BOUNDS["prefill"][0], "maxInstances": BOUNDS["prefill"][1]},
            "decode": {"minInstances": BOUNDS["decode"][0], "maxInstances": BOUNDS["decode"][1]},
            "objectives": {
                "ttftMilliseconds": TTFT_MS,
                "itlMilliseconds": ITL_MS,
                "percentile": PERCENTILE,
                "windowSeconds": max(5, round(60 / speedup)),
            },
            "syncPeriodSeconds": period,
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [
                        {"type": "Percent", "value": 100, "periodSeconds": period},
                        {"type": "Instances", "value": 4, "periodSeconds": period},
                    ],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": round(300 / speedup),
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": period}],
                },
            },
        }
    return sim_manifest("mooncake-scaled", **spec)


@dataclass
class HpaScaler(LocalScaler):
    """Per role, on its own: HPA's algorithm on the engines' requests per instance (no objective,
    no ratio, no hold while pods start: what an HPA per role does), with HPA's behavior."""

    targets: Mapping[str, float] = field(default_factory=lambda: dict(HPA_TARGETS))

    @classmethod
    def of(cls, pdd: PDDeployment) -> HpaScaler | None:
        base = LocalScaler.of(pdd)
        return None if base is None else cls(base.spec, base.desired)

    def decide(self, now: float, roles: Mapping[str, RoleState], signals: Signals) -> Decision:
        self.signals = signals
        behavior = self.spec.behavior
        history = self.memory.history.pruned(behavior, now)
        recommended: dict[str, int] = {}
        decided: dict[str, RoleDecision] = {}
        for role in ROLES:
            current = roles[role].desired
            rec, why = current, "no engine answered: holding"
            engines = signals.engines.get(role, 0)
            if signals.known and engines:
                metric = (signals.running[role] + signals.waiting[role]) / engines
                ratio = metric / self.targets[role]
                rules = behavior.scale_up if ratio > 1 else behavior.scale_down
                rec = current if abs(ratio - 1) <= rules.tolerance else math.ceil(current * ratio - 1e-9)
                why = f"{metric:.1f} requests per instance, target {self.targets[role]:g}"
            rec = self.spec.bounds(role).clamp(rec)
            stable, _ = stabilised(behavior, history, role, current, rec, now)
            after, _ = step_limited(behavior, history, role, current, stable, now)
            recommended[role] = rec
            decided[role] = RoleDecision(role, current, after, None, rec, why)
        moves = {role: decided[role].after - decided[role].before for role in ROLES}
        memory = replace(self.memory, history=history.recorded(now, recommended, moves))
        measured = {
            "ttft_ms": _percentile_ms(signals, "ttft"),
            "itl_ms": _percentile_ms(signals, "itl"),
        }
        return Decision(decided["prefill"], decided["decode"], measured, (), memory)


def _percentile_ms(signals: Signals, kind: str) -> float | None:
    value = percentile(signals.latency.get(kind, {}), PERCENTILE)
    return None if value is None else value * 1000


def serve(argv: Sequence[str]) -> int:
    """``pdserve up`` with the HPA-like policy deciding the counts."""
    from pdserve.local.cli import configure, run

    parser = argparse.ArgumentParser(prog="python -m bench.autoscaling_bench serve")
    configure(parser)
    return run(parser.parse_args(argv), scaler_of=HpaScaler.of)


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    records: list[RequestRecord]
    samples: list[tuple[float, dict[str, int]]]  # (seconds since the replay's start, instances per role)
    start: float  # the replay's first send, on the sampler's clock
    end: float
    scale_events: dict[str, int]
    log_tail: str = ""

    def instance_seconds(self) -> dict[str, float]:
        out = dict.fromkeys(ROLES, 0.0)
        for (t0, counts), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            lo, hi = max(t0, 0.0), min(t1, self.end - self.start)
            if hi > lo:
                for role in ROLES:
                    out[role] += counts[role] * (hi - lo)
        return out


def _table_counts(url: str) -> dict[str, int] | None:
    """Instances per role the router's table holds (starting, ready and draining alike: each is a
    running engine, the GPUs it would hold)."""
    try:
        with urllib.request.urlopen(url + "/debug/routing", timeout=2) as resp:
            table = json.loads(resp.read()).get("table") or {}
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return {role: len(table.get(role, [])) for role in ROLES}


def _all_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/debug/routing", timeout=2) as resp:
            table = json.loads(resp.read()).get("table") or {}
    except (urllib.error.URLError, OSError, ValueError):
        return False
    instances = [*table.get("prefill", []), *table.get("decode", [])]
    return bool(instances) and all(i.get("ready") and not i.get("draining") for i in instances)


def run_one(name: str, doc: dict[str, Any], arrivals: Sequence[Arrival], speedup: float, work: Path) -> Run:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    port = free_port()
    # --sim-tokens: the sims answer as many tokens as each request asks (max_tokens, the trace's
    # output length), not their default of 16
    flags = [str(path), "--port", str(port), "--no-view", "--sim-profile", PROFILE, "--sim-tokens", "1000"]
    argv = (
        [sys.executable, "-m", "bench.autoscaling_bench", "serve", *flags]
        if name == "hpa"
        else [sys.executable, "-m", "pdserve.cli", "up", *flags]
    )
    log = work / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(SAMPLE_S):
            counts = _table_counts(url)
            if counts is not None:
                samples.append((time.monotonic() - t0, counts))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        deadline = time.monotonic() + 180
        while not _all_ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"{name}: pdserve up did not serve:\n{log.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.3)
        sampler.start()
        options = ReplayOptions(
            url=url,
            speedup=speedup,
            workload="Mooncake",
            slo=Slo(TTFT_MS, ITL_MS),
            metrics_interval_s=10.0,
            progress=False,
        )
        begin = time.monotonic() - t0
        outcome = _replay(arrivals, options)
        finish = time.monotonic() - t0
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text(errors="replace")
    shifted = [(t - begin, c) for t, c in samples]
    return Run(name, list(outcome.records), shifted, begin, finish, scale_events(text), text[-4000:])


def _replay(arrivals: Sequence[Arrival], options: ReplayOptions) -> Any:
    import uvloop

    return uvloop.run(run_replay(arrivals, options))


_MOVE = re.compile(r"\b(prefill|decode) (\d+) -> (\d+)")


def scale_events(log: str) -> dict[str, int]:
    """Count changes per role, from the ``autoscaler:`` lines of ``pdserve up``."""
    out = dict.fromkeys(ROLES, 0)
    for line in log.splitlines():
        if "autoscaler:" in line:
            for role, _, _ in _MOVE.findall(line):
                out[role] += 1
    return out


# --- the report -----------------------------------------------------------------------------------


def attainment(records: Sequence[RequestRecord]) -> float:
    slo = Slo(TTFT_MS, ITL_MS)
    return sum(1 for r in records if r.ok and slo.met(r)) / max(len(records), 1)


def summary(runs: Mapping[str, Run]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, run in runs.items():
        seconds = run.instance_seconds()
        ttfts = sorted(r.ttft_ms for r in run.records if r.ttft_ms is not None)
        tpots = sorted(t for t in (r.tpot_ms() for r in run.records) if t is not None)
        out[name] = {
            "requests": len(run.records),
            "failed": sum(1 for r in run.records if not r.ok),
            "attainment": attainment(run.records),
            "instance_seconds": seconds,
            "instance_seconds_total": sum(seconds.values()),
            "scale_events": run.scale_events,
            "scale_events_total": sum(run.scale_events.values()),
            "ttft_p90_ms": _pct(ttfts, 90),
            "tpot_p90_ms": _pct(tpots, 90),
            "duration_s": run.end - run.start,
            "max_instances": {r: max((c[r] for _, c in run.samples), default=0) for r in ROLES},
        }
    return out


def _pct(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))]


def targets(figures: Mapping[str, Mapping[str, Any]], ideal: Bound | None = None) -> list[str]:
    """The issue's targets, each with the figures it is judged on and whether they are met."""
    p, peak, mean, hpa = (figures[n] for n in CONFIGS)
    lines = []
    gap = (peak["attainment"] - p["attainment"]) * 100
    share = p["instance_seconds_total"] / max(peak["instance_seconds_total"], 1e-9) * 100
    lines.append(
        f"- within 2 points of fixed-at-peak's attainment: {p['attainment']:.1%} vs {peak['attainment']:.1%} "
        f"({gap:+.1f} points behind): {'met' if gap <= 2 else 'NOT met'}"
    )
    lines.append(
        f"- at most 60 % of fixed-at-peak's instance-seconds: {share:.0f} %: "
        f"{'met' if share <= 60 else 'NOT met'}"
        + (
            ""
            if ideal is None
            else f" (following the load exactly: {ideal.stabilised:.0%} with the scale-down window, "
            f"{ideal.whole:.0%} without; below)"
        )
    )
    better = p["attainment"] > mean["attainment"]
    lines.append(
        f"- better attainment than fixed-at-mean: {p['attainment']:.1%} vs {mean['attainment']:.1%}: "
        f"{'met' if better else 'NOT met'}"
    )
    equal = abs(p["attainment"] - hpa["attainment"]) * 100
    fewer = p["scale_events_total"] < hpa["scale_events_total"]
    lines.append(
        f"- fewer scale events than per-role HPA at equal attainment: {p['scale_events_total']} vs "
        f"{hpa['scale_events_total']} (attainment {p['attainment']:.1%} vs {hpa['attainment']:.1%}, "
        f"{equal:.1f} points apart): {'met' if fewer else 'NOT met'}"
        + ("" if equal <= 2 else "; the attainments are not equal, so this compares unlike runs")
    )
    return lines


def offered(arrivals: Sequence[Arrival], bin_s: float) -> tuple[list[float], list[float], list[float]]:
    """Per bin of the replay's time: its start, prompt tokens and output tokens offered per second."""
    end = max((a.at_s for a in arrivals), default=0.0)
    n = int(end // bin_s) + 1
    prompt, output = [0.0] * n, [0.0] * n
    for a in arrivals:
        i = int(a.at_s // bin_s)
        prompt[i] += a.request.input_length / bin_s
        output[i] += a.request.output_length / bin_s
    return [i * bin_s for i in range(n)], prompt, output


def plot(
    runs: Mapping[str, Run],
    arrivals: Sequence[Arrival],
    path: Path,
    speedup: float,
    ideal: Bound | None = None,
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(10, 2.4 * (len(runs) + 1)), sharex=True)
    times, prompt, output = offered(arrivals, 10.0)
    ax = axes[0]
    ax.plot(
        times, [x / 1000 for x in prompt], color="tab:blue", drawstyle="steps-post", label="prompt ktok/s"
    )
    ax.set_ylabel("prompt ktok/s", color="tab:blue")
    twin = ax.twinx()
    twin.plot(times, output, color="tab:orange", drawstyle="steps-post", label="output tok/s")
    twin.set_ylabel("output tok/s", color="tab:orange")
    ax.set_title(f"offered load (Mooncake trace at x{speedup:g}, 10 s bins)")
    for ax, (name, run) in zip(axes[1:], runs.items(), strict=True):
        ts = [t for t, _ in run.samples if 0 <= t <= run.end - run.start]
        for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
            counts = [c[role] for t, c in run.samples if 0 <= t <= run.end - run.start]
            ax.plot(ts, counts, color=color, drawstyle="steps-post", label=role)
            if name == "pdserve" and ideal is not None:
                kept = ideal.counts[role]
                ax.plot(
                    [i * ideal.bin_s for i in range(len(kept) + 1)],
                    [*kept, kept[-1]],
                    color=color,
                    linestyle=":",
                    drawstyle="steps-post",
                    label=f"{role}, ideal",
                )
        ax.set_ylabel("instances")
        ax.set_title(f"{name}: attainment {attainment(run.records):.1%}")
        ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("seconds into the replay")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def markdown(
    figures: Mapping[str, Mapping[str, Any]],
    config: Mapping[str, Any],
    png: str | None,
    ideal: Bound | None = None,
) -> str:
    lines = [
        "# Autoscaling: one autoscaler for the pair against fixed sizes and per-role HPA "
        f"(x{config['speedup']:g})",
        "",
        f"Mooncake {config['trace']}: {config['requests']} requests replayed at x{config['speedup']:g}"
        + _swung(config.get("swing", 1.0))
        + f" through `pdserve up` with step-engine sims (profile `{PROFILE}`), run {config['run']}. "
        "Objectives: "
        f"TTFT p{PERCENTILE:g} <= {TTFT_MS:g} ms and ITL p{PERCENTILE:g} <= {ITL_MS:g} ms; attainment is "
        "the share of requests within both (TTFT and mean ITL per request; a failed request misses). The "
        "autoscalers' time figures are divided by the speed-up (decision every "
        f"{config['period_s']} s, window {config['window_s']} s, scale-down stabilisation "
        f"{config['down_window_s']} s). Fixed-at-peak and fixed-at-mean take the pdserve run's most and "
        "time-averaged (rounded up) instances per role; HPA scales each role on vLLM's running + waiting "
        f"requests per instance (targets prefill {HPA_TARGETS['prefill']:g}, "
        f"decode {HPA_TARGETS['decode']:g}).",
        "",
        "| deployment | attainment | failed | prefill inst-s | decode inst-s | total inst-s | "
        "vs fixed-peak | scale events (P/D) | most instances (P/D) | TTFT p90 ms | TPOT p90 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    peak_total = figures["fixed-peak"]["instance_seconds_total"]
    for name in CONFIGS:
        f = figures[name]
        s = f["instance_seconds"]
        ev = f["scale_events"]
        most = f["max_instances"]
        lines.append(
            f"| {name} | {f['attainment']:.1%} | {f['failed']} | {s['prefill']:.0f} | {s['decode']:.0f} | "
            f"{f['instance_seconds_total']:.0f} | "
            f"{f['instance_seconds_total'] / max(peak_total, 1e-9):.0%} | "
            f"{ev['prefill']}/{ev['decode']} | {most['prefill']}/{most['decode']} | "
            f"{_num(f['ttft_p90_ms'])} | {_num(f['tpot_p90_ms'])} |"
        )
    lines += ["", "## The issue's targets", "", *targets(figures, ideal), ""]
    if ideal is not None:
        lines += ideal_section(ideal, config)
    if png is not None:
        lines += [f"![instances per role against the offered load]({png})", ""]
    lines += [
        "Instance-seconds count every running engine from the replay's first request to its last answer, "
        "starting and draining ones included. The simulators are Ready in a second or two; real vLLM "
        "loads its model for minutes (tens of seconds at this speed-up), which this bench does not "
        "charge either autoscaler for.",
        "",
    ]
    return "\n".join(lines)


def ideal_section(ideal: Bound, config: Mapping[str, Any]) -> list[str]:
    """What following the trace's load exactly would bill (bench/autoscaling_bound.py), in words."""
    peak = config["fixed_peak"]
    m = ideal.mean_over_peak
    return [
        "## What following the load exactly would bill",
        "",
        f"An ideal autoscaler that knows each {ideal.bin_s:.0f} s window's load in advance (the autoscalers' "
        "measurement window) and runs, per role, a count in proportion to it, the busiest window at "
        f"fixed-at-peak's {peak['prefill']}/{peak['decode']} (the queue model's need at the objective is in "
        "proportion to the traffic) would bill, against fixed-at-peak's instance-seconds:",
        "",
        f"- {ideal.fractional:.0%} with fractions of instances;",
        f"- {ideal.whole:.0%} with whole instances (at least minInstances);",
        f"- {ideal.stabilised:.0%} with whole instances and a scale-down that waits its "
        f"{ideal.down_window_s:g} s stabilisation window, as pdserve's and HPA's do.",
        "",
        f"What the trace leaves to save: over {ideal.bin_s:.0f} s windows its mean prompt load is "
        f"{m['prefill']:.0%} of its peak and its mean decode work {m['decode']:.0%} of its peak; the replay "
        f"lasts {config['replay_s']:.0f} s, {config['replay_s'] / max(ideal.down_window_s, 1e-9):.1f} "
        "scale-down stabilisation windows, so a count that falls waits out much of what is left. "
        "The dotted lines in pdserve's panel are the ideal's counts with the window.",
        "",
    ]


def _swung(factor: float) -> str:
    if factor == 1:
        return ""
    return (
        f", swung (the first and last third of the requests at 1/{factor:g} of the trace's rate, the "
        "middle third at its rate: `--swing`; the trace's own arrivals are Poisson at one rate)"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, help="a Mooncake JSONL trace (default: the shared one)")
    parser.add_argument("--speedup", type=float, default=4.0, help="trace time compression (default: 4)")
    parser.add_argument("--limit", type=int, help="the first N requests only")
    parser.add_argument("--label", default="latest", help="names the results: autoscaling-<label>.md")
    parser.add_argument(
        "--swing",
        type=float,
        metavar="F",
        default=1.0,
        help="the first and last third of the requests at 1/F of the trace's rate (default: 1, the trace)",
    )
    args = parser.parse_args(argv)

    trace = find_trace(args.trace)
    arrivals = swing(schedule(read_trace(trace), args.speedup, args.limit), args.swing)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    work = Path(tempfile.mkdtemp(prefix="autoscaling-bench-"))
    runs: dict[str, Run] = {}
    shape = "" if args.swing == 1 else f", swung x{args.swing:g}"
    print(f"{len(arrivals)} requests of {trace.name} at x{args.speedup:g}{shape}; logs in {work}", flush=True)

    def one(name: str, counts: Mapping[str, int], autoscaled: bool) -> None:
        runs[name] = run_one(name, manifest(counts, args.speedup, autoscaled), arrivals, args.speedup, work)
        f = summary({name: runs[name]})[name]
        print(
            f"{name}: attainment {f['attainment']:.1%}, instance-seconds {f['instance_seconds']}", flush=True
        )

    one("pdserve", START, True)
    measured = summary(runs)["pdserve"]
    peak = measured["max_instances"]
    seconds, duration = measured["instance_seconds"], max(measured["duration_s"], 1e-9)
    mean = {r: max(1, math.ceil(seconds[r] / duration)) for r in ROLES}
    print(f"fixed-peak {peak}, fixed-mean {mean}", flush=True)
    one("fixed-peak", peak, False)
    one("fixed-mean", mean, False)
    one("hpa", START, True)
    figures = summary(runs)

    RESULTS.mkdir(parents=True, exist_ok=True)
    config = {
        "trace": trace.name,
        "requests": len(arrivals),
        "speedup": args.speedup,
        "swing": args.swing,
        "run": stamp,
        "period_s": max(1, round(15 / args.speedup)),
        "window_s": max(5, round(60 / args.speedup)),
        "down_window_s": round(300 / args.speedup),
        "fixed_peak": peak,
        "replay_s": max((a.at_s for a in arrivals), default=0.0),
        "fixed_mean": mean,
    }
    bounds = {r: BOUNDS[r][0] for r in ROLES}
    ideal = bound(arrivals, load_profile(PROFILE), peak, bounds, config["window_s"], config["down_window_s"])
    config["ideal"] = {
        "fractional": ideal.fractional,
        "whole": ideal.whole,
        "stabilised": ideal.stabilised,
        "mean_over_peak": dict(ideal.mean_over_peak),
    }
    png = RESULTS / f"autoscaling-{args.label}.png"
    has_png = plot(runs, arrivals, png, args.speedup, ideal)
    text = markdown(figures, config, png.name if has_png else None, ideal)
    (RESULTS / f"autoscaling-{args.label}.md").write_text(text)
    timelines = {n: [(round(t, 2), c) for t, c in r.samples] for n, r in runs.items()}
    archive = RESULTS / f"autoscaling-{stamp}.json"
    archive.write_text(json.dumps({"config": config, "figures": figures, "timelines": timelines}, indent=1))
    print(text)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
