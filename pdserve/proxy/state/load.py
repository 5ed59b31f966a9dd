"""What this router saw of the load lately: latency histograms and outcomes in one-second slices.

``GET /load?window=S`` (pdserve.wire.load) sums the slices of the last ``S`` seconds, so the
autoscaler reads percentiles over any window up to :data:`HISTORY_SECONDS` without the router
knowing which one it wants. A request costs a counter when it arrives and one dictionary update
per sample when it ends; the decode stream's inter-event gaps are summed by the relay (a count per
chunk), not timed one by one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.wire.load import (
    HISTORY_SECONDS,
    LATENCIES,
    OUTCOMES,
    Counts,
    add_counts,
    bucket_of,
    counts_to_json,
)


@dataclass
class _Slice:
    second: int
    latency: dict[str, Counts] = field(default_factory=lambda: {kind: {} for kind in LATENCIES})
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    started: int = 0


class LoadWindow:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._slices: deque[_Slice] = deque()

    def _slice(self) -> _Slice:
        second = int(self._clock())
        slices = self._slices
        if slices and slices[-1].second == second:
            return slices[-1]
        current = _Slice(second)
        slices.append(current)
        while slices and slices[0].second <= second - HISTORY_SECONDS:
            slices.popleft()
        return current

    def observe(self, kind: str, seconds: float) -> None:
        counts = self._slice().latency[kind]
        bucket = bucket_of(seconds)
        counts[bucket] = counts.get(bucket, 0) + 1

    def started(self) -> None:
        self._slice().started += 1

    def ended(self, ok: bool) -> None:
        self._slice().outcomes["ok" if ok else "failed"] += 1

    def view(self, window: float) -> dict[str, Any]:
        """The counts of the last ``window`` seconds (gauges are added by the caller)."""
        now = self._clock()
        window = min(max(window, 1.0), HISTORY_SECONDS)
        first = int(now - window) + 1
        latency: dict[str, Counts] = {kind: {} for kind in LATENCIES}
        outcomes = dict.fromkeys(OUTCOMES, 0)
        started = [0] * (int(now) - first + 1)
        for piece in self._slices:
            if piece.second < first:
                continue
            started[piece.second - first] += piece.started
            for kind, counts in piece.latency.items():
                add_counts(latency[kind], counts)
            for outcome, count in piece.outcomes.items():
                outcomes[outcome] += count
        return {
            "window_seconds": window,
            "covered_seconds": round(min(window, now - self._started), 3),
            "requests": outcomes,
            "started": started,
            "latency": {kind: counts_to_json(c) for kind, c in latency.items()},
        }
