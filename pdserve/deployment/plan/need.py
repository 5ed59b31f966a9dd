"""What each role's traffic needs at its objective (pure): the autoscaler's first step
(pdserve.deployment.plan.autoscale makes the decision from it).

**The role's objective ratio** ``q``: its percentile over its objective, of the requests that
ended in the window. Prefill answers for TTFT, decode for ITL. A missed TTFT is the decode's
when its leg's time to first byte (the KV pull and its queue) is the larger part; then decode
takes that ratio and prefill holds. Fewer than :data:`MIN_SAMPLES` samples: no ratio (the
count holds), unless the deployment is idle (nothing ended, in flight or queued), when the
traffic needs the minimum.

**The recommendation**, once ``q`` leaves ``[1 - scaleDown.tolerance, 1 + scaleUp.tolerance]``:
the instances the role's traffic needs to sit at its objective. Latency is not proportional to
the count (HPA's ``ceil(ready x q)`` assumes it is): both roles behave like a queue, ``q = a /
(1 - u)``, where ``a`` is the ratio at no load and ``u`` the share of the role's capacity the
traffic uses. The traffic needs ``ready x u / (1 - a)`` instances: grown to at least one more
when the objective is missed, shrunk when met.

- **Prefill** shares its steps among the prompts it holds (processor sharing): a prompt takes
  its no-load time times ``1 + N``, ``N`` the prefill legs in flight per slot over the window
  (Little's law on the routers' counts), so each window gives ``a = q / (1 + N)``. A window's
  TTFT percentile is set by its longest prompts (the p99 of a hundred requests is their
  longest), which no count shortens: taken alone it would grow the role for one long prompt
  and hold it there for a scale-down window. So once :data:`MIN_FIT_SAMPLES` windows are
  known, ``a`` is the median of the last :data:`BASELINE_SECONDS`' windows
  (:func:`prefill_base`), and the role is judged by the queue model itself: ``u`` is the work
  arriving (requests a second times a prompt's mean no-load time, ``mean leg / (1 + N)``) per
  slot, and ``q = a / (1 - u)``. Arriving, not ended: an overload shows its size.
- **Decode**: a step costs a fixed time plus a time per sequence, so ``a`` is where the line
  through the recent (sequences per slot, ``q``) pairs meets zero sequences
  (:func:`decode_base`), and ``u = 1 - a / q`` from the window's ITL. Without ``a`` (a fresh
  memory, a load that never varied) it does not shrink: the conservative side, where HPA's
  rule would shrink a queue into overload and flap. Judged by its window alone, a role that
  misses by :data:`SEVERE` or more grows by ``ready x q``, HPA's rule.

The window lags: requests arriving in its last quarter (at least :data:`RECENT_SECONDS`)
faster than in the rest of it, beyond a Poisson count's noise, are rising traffic; the need
grows with the rate at once (:func:`arrivals`), without the window's wait.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.spec.autoscaling import AutoscalingSpec
from pdserve.wire.load import mean, percentile

#: Fewer samples in the window than this, and a percentile says too little to act on.
MIN_SAMPLES = 10
#: How far back the decode's (sequences per slot, ITL ratio) pairs and the prefill's no-load ratios
#: count for each role's base latency.
BASELINE_SECONDS = 600.0
#: Pairs needed, and how far apart their loads must be, to draw a line through them.
MIN_FIT_SAMPLES = 4
MIN_FIT_SPREAD = 1.25
#: The pairs within this factor of the lightest load anchor the line.
LIGHT_LOAD = 1.25
#: A ratio is capped here: a stuck queue must not ask for a hundred-fold count (the policies cap it too).
MAX_RATIO = 10.0
#: A missed objective by this factor or more grows by it (HPA's rule), not by the queue's estimate.
SEVERE = 2.0
#: The latency no instance count removes is taken as at most this share of the objective.
MAX_BASE = 0.8
#: The recent part of the window whose arrivals show a rise: its last quarter, at least this long.
RECENT_SECONDS = 5


# --- the objective ratios ------------------------------------------------------------------


def percentile_ms(signals: Signals, kind: str, p: float) -> float | None:
    counts = signals.latency.get(kind, {})
    if sum(counts.values()) < MIN_SAMPLES:
        return None
    value = percentile(counts, p)
    return None if value is None else value * 1000


def objective_ratio(signals: Signals, kind: str, p: float, objective_s: float) -> float | None:
    ms = percentile_ms(signals, kind, p)
    return None if ms is None else min(MAX_RATIO, ms / 1000 / objective_s)


def role_ratios(
    signals: Signals, p: float, ttft: float | None, itl: float | None
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Prefill answers for TTFT and decode for ITL; a missed TTFT goes to the leg that takes longer."""
    ratios: dict[str, float | None] = {"prefill": ttft, "decode": itl}
    notes = {"prefill": "", "decode": ""}
    if ttft is None or ttft <= 1:
        return ratios, notes
    prefill_leg = percentile_ms(signals, "prefill", p)
    decode_first = percentile_ms(signals, "decode_first", p)
    if prefill_leg is not None and decode_first is not None and decode_first > prefill_leg:
        ratios["prefill"] = 1.0
        ratios["decode"] = max(itl or 0.0, ttft)
        notes["prefill"] = (
            f"TTFT missed at the decode (its first byte p{p:g} {decode_first:.0f} ms > prefill leg "
            f"{prefill_leg:.0f} ms)"
        )
        notes["decode"] = notes["prefill"]
    return ratios, notes


# --- the need ------------------------------------------------------------------


def per_slot(count: float, slots: int) -> float:
    return count / max(slots, 1)


def in_flight(signals: Signals, role: str) -> float:
    """The role's legs in flight on average over the window: the rate its legs ended at times their
    mean time (Little's law on the routers' counts); the routers' count now when too few ended."""
    legs = signals.latency.get(role, {})
    average = mean(legs)
    if sum(legs.values()) < MIN_SAMPLES or average is None or signals.covered_seconds <= 0:
        return float(signals.in_flight.get(role, 0))
    return sum(legs.values()) / signals.covered_seconds * average


def window_prefill_base(signals: Signals, slots: int, q: float | None) -> float | None:
    """This window's prefill ratio at no load, ``q / (1 + N)``, N its legs in flight per slot."""
    if q is None or sum(signals.latency.get("prefill", {}).values()) < MIN_SAMPLES:
        return None
    return q / (1 + per_slot(in_flight(signals, "prefill"), slots))


def prefill_base(bases: Sequence[tuple[float, float]]) -> float | None:
    """The prefill's TTFT ratio at no load: the median of the recent windows' (a window's
    percentile is its longest prompts', high or low by chance; the median of many is the
    traffic's). None until :data:`MIN_FIT_SAMPLES` windows are known."""
    if len(bases) < MIN_FIT_SAMPLES:
        return None
    return statistics.median(a for _, a in bases)


def prefill_model(
    signals: Signals, slots: int, running: int, base: float, rate: float
) -> tuple[float, float, str] | None:
    """The prefill's ratio and need in the queue model, and how they were reckoned: ``u`` the work
    arriving per slot (requests a second, or legs ended when more, times a prompt's mean no-load
    time), ``q = a / (1 - u)``, a need of ``ready x u / (1 - a)``. None without a measured leg."""
    legs = signals.latency.get("prefill", {})
    average = mean(legs)
    if average is None or signals.covered_seconds <= 0:
        return None
    alone = average / (1 + per_slot(in_flight(signals, "prefill"), slots))  # a prompt's no-load time
    ended = sum(legs.values()) / signals.covered_seconds
    u = max(rate, ended) * alone / max(slots, 1)
    a = min(base, MAX_BASE)
    q = MAX_RATIO if u >= 1 else min(MAX_RATIO, a / (1 - u))
    shown = f"queue model: no-load ratio {a:.2f} (recent windows' median), load {u:.2f} a slot: ratio {q:.2f}"
    return q, running * u / (1 - a), shown


def decode_base(samples: Sequence[tuple[float, float, float]]) -> float | None:
    """The decode's ITL ratio at no load, from the recent (sequences per slot, ratio) pairs: the
    least-squares slope, through the pairs of the lightest load seen (the end the answer is
    about: a busy machine bends the line up at the heavy end). None while the loads are too
    alike to draw it, or it slopes the wrong way; never above 90 % of the lowest ratio seen."""
    samples = [x for x in samples if x[1] > 0]  # a moment with no sequence in flight says nothing
    if len(samples) < MIN_FIT_SAMPLES:
        return None
    loads = [b for _, b, _ in samples]
    ratios = [q for _, _, q in samples]
    if max(loads) / min(loads) < MIN_FIT_SPREAD:
        return None
    n = len(samples)
    mean_b, mean_q = sum(loads) / n, sum(ratios) / n
    spread = sum((b - mean_b) ** 2 for b in loads)
    slope = sum((b - mean_b) * (q - mean_q) for b, q in zip(loads, ratios, strict=True)) / spread
    if slope <= 0:
        return None
    light = [q - slope * b for _, b, q in samples if b <= LIGHT_LOAD * min(loads)]
    return min(max(sum(light) / len(light), 0.0), 0.9 * min(ratios))


def traffic_need(running: int, q: float, base: float | None) -> float | None:
    """The instances the window's traffic needs at the objective (None without a base): the
    larger of two models. In the queue model ``q = a / (1 - u)``, steady at the window's load;
    past its objective a role is not steady (its backlog grows, and its latency with it), and the
    part of the latency over the no-load share shrinks at most in proportion to the count,
    ``running x (q - a) / (1 - a)`` (HPA's ``running x q`` when ``a`` is 0). The queue model is
    the larger below the objective (a role never shrinks into overload), the other above it."""
    if base is None:
        return None
    a = min(base, 0.95 * q, MAX_BASE)
    return running * max(1 - a / q, q - a) / (1 - a)


def recommend(
    spec: AutoscalingSpec, running: int, q: float, need: float | None, severe: bool = True
) -> tuple[int, str]:
    """The count to recommend from the objective ratio and the need, and how that was reckoned
    (``severe``: a ratio missed twice over grows by ``running x q``, HPA's rule)."""
    up, down = spec.behavior.scale_up, spec.behavior.scale_down
    if 1 - down.tolerance <= q <= 1 + up.tolerance:
        return running, ""
    shown = "" if need is None else f"its traffic needs {need:.1f} of {running} at the objective"
    if q > 1:
        rec = max(math.ceil((need or 0.0) - 1e-9), running + 1)
        if severe and q >= SEVERE:
            rec = max(rec, math.ceil(running * q - 1e-9))
        return rec, shown
    if need is None:
        return running, "no base latency known yet: not shrinking"
    return max(1, min(math.ceil(need - 1e-9), running)), shown


def arrivals(signals: Signals) -> tuple[float, float]:
    """Requests arriving a second now, and how many times as fast as in the window before its
    recent part (the window's latencies are mostly of that part): the rate of its last quarter
    (at least :data:`RECENT_SECONDS`) when beyond a Poisson count's two standard deviations over
    the rest of it; else the window's, at 1. The current second is still counting: left out."""
    seconds = list(signals.started[:-1])
    covered = min(len(seconds), int(signals.covered_seconds))
    if covered <= 0:
        return 0.0, 1.0
    seconds = seconds[-covered:]
    rate = sum(seconds) / covered
    recent = max(RECENT_SECONDS, covered // 4)
    if recent >= covered:
        return rate, 1.0
    before = sum(seconds[:-recent]) / (covered - recent)
    expected = before * recent
    arrived = sum(seconds[-recent:])
    if before <= 0 or arrived <= expected + 2 * math.sqrt(expected):
        return rate, 1.0
    return arrived / recent, arrived / expected
