"""HPA's behavior, as the autoscaler applies it per role (pure): stabilisation windows and step
policies, over the recommendations and scale events of the recent past.

Kept apart from the decision (pdserve.deployment.plan.autoscale) because it is HPA's own rule,
the same whatever the recommendation is made of: the benchmark's per-role, utilisation-driven
baseline (bench/autoscaling_bench.py) applies it too, so the two differ only in what they
recommend.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from pdserve.deployment.spec.autoscaling import Behavior, ScalingRules


@dataclass(frozen=True)
class Recommendation:
    time: float
    counts: Mapping[str, int]


@dataclass(frozen=True)
class ScaleEvent:
    time: float
    role: str
    change: int  # instances added (> 0) or removed (< 0)


@dataclass(frozen=True)
class History:
    """Recommendations (for the stabilisation windows) and scale events (for the step policies).
    An empty history (a restarted operator) makes the first scale-down wait a whole window."""

    recommendations: tuple[Recommendation, ...] = ()
    events: tuple[ScaleEvent, ...] = ()
    started: float | None = None  # when this history began

    def pruned(self, behavior: Behavior, now: float) -> History:
        """Without what no window or period looks at any more."""
        keep = max(
            behavior.scale_up.stabilization_window_seconds, behavior.scale_down.stabilization_window_seconds
        )
        periods = [p.period_seconds for p in (*behavior.scale_up.policies, *behavior.scale_down.policies)]
        return replace(
            self,
            recommendations=tuple(r for r in self.recommendations if r.time > now - keep),
            events=tuple(e for e in self.events if e.time > now - max(periods, default=0)),
        )

    def recorded(self, now: float, recommendation: Mapping[str, int], moves: Mapping[str, int]) -> History:
        """With this decision's recommendation and its count changes (role -> instances added)."""
        return replace(
            self,
            recommendations=(*self.recommendations, Recommendation(now, dict(recommendation))),
            events=(*self.events, *(ScaleEvent(now, role, n) for role, n in moves.items() if n)),
            started=self.started if self.started is not None else now,
        )


def stabilised(
    behavior: Behavior, history: History, role: str, current: int, rec: int, now: float
) -> tuple[int, str]:
    """HPA's rule: up to the lowest recommendation of the up window, down to the highest of the
    down window; with the reason when the window held the count back."""
    up_window = behavior.scale_up.stabilization_window_seconds
    down_window = behavior.scale_down.stabilization_window_seconds
    up_rec = down_rec = rec
    for past in history.recommendations:
        value = past.counts[role]
        if past.time > now - up_window:
            up_rec = min(up_rec, value)
        if past.time > now - down_window:
            down_rec = max(down_rec, value)
    if history.started is None or history.started > now - down_window:
        down_rec = max(down_rec, current)  # too little history: the window starts now
    out = current
    if out < up_rec:
        out = up_rec
    if out > down_rec:
        out = down_rec
    note = ""
    if rec < current and out > rec:
        note = f"scale-down waits its {down_window} s window (highest recommendation in it: {out})"
    elif rec > current and out < rec:
        note = f"scale-up waits its {up_window} s window (lowest recommendation in it: {out})"
    return out, note


def step_limited(
    behavior: Behavior, history: History, role: str, current: int, target: int, now: float
) -> tuple[int, str]:
    """``target`` within the policies' step from ``current``; with the reason when it was cut."""
    if target == current:
        return target, ""
    up = target > current
    limit = _limit(behavior.scale_up if up else behavior.scale_down, history.events, role, current, now, up)
    if up and target > limit:
        return limit, f"step limited to {limit} by scaleUp policies"
    if not up and target < limit:
        return limit, f"step limited to {limit} by scaleDown policies"
    return target, ""


def _limit(
    rules: ScalingRules, events: Iterable[ScaleEvent], role: str, current: int, now: float, up: bool
) -> int:
    """HPA's per-period limit: from the count at each policy period's start, the policies' steps."""
    if rules.select_policy == "Disabled":
        return current
    events = [e for e in events if e.role == role and (e.change > 0) == up]
    limits = []
    for policy in rules.policies:
        moved = sum(e.change for e in events if e.time > now - policy.period_seconds)
        start = current - moved
        if policy.type == "Instances":
            limits.append(start + policy.value if up else start - policy.value)
        elif up:
            limits.append(math.ceil(start * (1 + policy.value / 100)))
        else:
            limits.append(math.ceil(start * (1 - policy.value / 100)))
    pick = max if (rules.select_policy == "Max") == up else min
    return pick(limits)
