"""What any autoscaler could bill on a trace, against fixed-at-peak (pure; used by the autoscaling bench).

The issue's target compares an autoscaler's instance-seconds with a deployment fixed at the peak.
How low that share can go is a property of the trace before it is one of the autoscaler: a load
that varies little leaves little to save. This computes the share an *ideal* autoscaler would
bill: one that knows each window's load in advance and runs, per role, a count in proportion to
it, scaled so that the busiest window runs fixed-at-peak's count (the queue model's need at the
objective, ``ready x u / (1 - a)``, is in proportion to the traffic). Three figures, from the
most to the least generous:

* ``fractional``: any fraction of an instance, changed every window;
* ``whole``: whole instances (rounded up, at least ``minInstances``), changed every window;
* ``stabilised``: whole instances, and a count goes down only to the highest need of the
  scale-down stabilisation window (HPA's rule, which the issue asks the autoscaler to keep).

The load per role and window: prefill, the prompt tokens that arrive in it; decode, the
per-sequence step time its requests' tokens cost (the profile's ``decode_seq_ms`` plus
``context_ktoken_ms`` per thousand tokens of context, at each request's mean context), which is
what fills a decode step besides its fixed time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pdserve.loadgen.schedule import Arrival
from pdserve.sim.engine.profile import Profile

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Bound:
    bin_s: float
    down_window_s: float
    #: Per role, the mean load over the busiest window's (how much the trace varies).
    mean_over_peak: Mapping[str, float]
    #: The ideal autoscaler's instance-seconds over fixed-at-peak's, each way of counting.
    fractional: float
    whole: float
    stabilised: float
    #: Per role, the stabilised counts, one per window from the replay's start (for the plot).
    counts: Mapping[str, Sequence[int]]


def role_loads(
    arrivals: Sequence[Arrival], profile: Profile, bin_s: float
) -> tuple[float, dict[str, list[float]]]:
    """Per role, the load each window offers (arbitrary units per role, per second): the windows
    split the arrivals' span into equal ones as near ``bin_s`` as fit (no stub of a last window
    whose few arrivals would read as a peak). Returns the windows' length too."""
    end = max((a.at_s for a in arrivals), default=0.0)
    n = max(1, round(end / bin_s))
    width = max(end / n, 1e-9)
    out = {role: [0.0] * n for role in ROLES}
    step = profile.step
    for a in arrivals:
        i = min(n - 1, int(a.at_s // width))
        prompt, tokens = a.request.input_length, a.request.output_length
        out["prefill"][i] += prompt / width
        context = prompt + tokens / 2
        out["decode"][i] += tokens * (step.decode_seq_ms + context / 1000 * step.context_ktoken_ms) / width
    return width, out


def swing(arrivals: Sequence[Arrival], factor: float) -> list[Arrival]:
    """The same requests in the same order, the first and the last third of them arriving at
    ``1 / factor`` of the trace's rate (the gaps before them stretched ``factor`` times), the middle
    third as the trace has it. The shared trace's arrivals are Poisson at one rate, so an
    autoscaler has little to save on it; this is a load that swings ``factor`` times and stays low
    for many scale-down windows, built from the same requests. ``factor`` 1: the trace unchanged."""
    if factor <= 0:
        raise ValueError(f"the swing factor must be > 0, got {factor}")
    n = len(arrivals)
    out: list[Arrival] = []
    at = previous = arrivals[0].at_s if arrivals else 0.0
    for i, a in enumerate(arrivals):
        stretch = 1.0 if n // 3 <= i < 2 * n // 3 else factor
        at += (a.at_s - previous) * stretch
        previous = a.at_s
        out.append(replace(a, at_s=at))
    return out


def bound(
    arrivals: Sequence[Arrival],
    profile: Profile,
    peak: Mapping[str, int],
    minimum: Mapping[str, int],
    bin_s: float,
    down_window_s: float,
) -> Bound:
    """The ideal autoscaler's share of fixed-at-``peak``'s instance-seconds on ``arrivals``."""
    width, loads = role_loads(arrivals, profile, bin_s)
    held = max(0, math.ceil(down_window_s / width - 1e-9))
    fractional = whole = stabilised = 0.0
    counts: dict[str, list[int]] = {}
    mean_over_peak = {}
    for role in ROLES:
        rates = loads[role]
        top = max(rates) or 1.0
        mean_over_peak[role] = sum(rates) / len(rates) / top
        exact = [peak[role] * r / top for r in rates]
        need = [max(minimum[role], math.ceil(x - 1e-9)) for x in exact]
        kept = [max(need[max(0, i - held) : i + 1]) for i in range(len(need))]
        fractional += sum(exact) / len(exact)
        whole += sum(need) / len(need)
        stabilised += sum(kept) / len(kept)
        counts[role] = kept
    fixed = max(sum(peak.values()), 1)
    return Bound(
        width, down_window_s, mean_over_peak, fractional / fixed, whole / fixed, stabilised / fixed, counts
    )
