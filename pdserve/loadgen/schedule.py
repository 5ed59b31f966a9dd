"""When each request is sent: open-loop arrivals at the trace's times, compressed by a speed-up.

Open loop: a request leaves at its time whatever the server has not answered yet, as users arrive
(a closed loop, a fixed number of clients, would slow down with the server and hide its queue).
The schedule is data, computed before the first send, so it can be tested without a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.loadgen.trace import TraceRequest


@dataclass(frozen=True)
class Arrival:
    index: int  # the request's position in the trace (0-based, after sorting by time)
    at_s: float  # seconds after the replay's start
    request: TraceRequest


def schedule(
    requests: Sequence[TraceRequest], speedup: float = 1.0, limit: int | None = None
) -> list[Arrival]:
    """The first ``limit`` requests by timestamp (ties keep trace order), the first one at 0 s and
    the others ``(timestamp - first) / 1000 / speedup`` seconds later."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    ordered = sorted(requests, key=lambda r: r.timestamp_ms)[:limit]
    if not ordered:
        return []
    start = ordered[0].timestamp_ms
    return [Arrival(i, (r.timestamp_ms - start) / 1000 / speedup, r) for i, r in enumerate(ordered)]


def offered_rate(arrivals: Sequence[Arrival]) -> float | None:
    """Requests per second the schedule offers (None for a single instant)."""
    if len(arrivals) < 2 or arrivals[-1].at_s <= 0:
        return None
    return (len(arrivals) - 1) / arrivals[-1].at_s
