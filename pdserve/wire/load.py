"""The load a router sees, as it reports it on ``GET /load``: windowed latency histograms that add up.

The autoscaler needs latency percentiles over the last minute or so across every router (and
every worker process of a router). Percentiles do not add up; histograms with the same buckets
do. So a router keeps counts in fixed log-spaced buckets and reports the counts of a window; the
reader sums the counts of every router and takes the percentile of the sum.

Buckets: bucket ``k`` holds values in ``(BASE * FACTOR**(k-1), BASE * FACTOR**k]`` seconds, bucket 0
everything up to ``BASE``; a percentile is read as its bucket's geometric middle, within
``±(sqrt(FACTOR) - 1)`` (5 %) of the true value. In JSON a histogram is ``{"<k>": count}``, empty
buckets left out.

The view (one router, or several merged by :func:`merge_views`)::

    {"deployment": "d", "window_seconds": 60, "covered_seconds": 60.0,
     "requests": {"ok": 120, "failed": 0}, "started": [2, 1, 3, ..., 2],
     "latency": {"ttft": {...}, "itl": {...}, "prefill": {...}, "decode_first": {...}, "decode": {...}},
     "in_flight": {"prefill": 3, "decode": 12}, "queued": 0}

``requests`` counts client requests that ended within the window, ``started`` those that arrived,
second by second (oldest first, the current second last: the trend within the window, which the
ended requests show late), ``latency`` the samples of the ended ones:
``ttft`` from the client's request to the first byte sent back, ``itl`` the mean gap between the
decode's stream events of one request (one sample per streamed request with at least two gaps),
``prefill`` the prefill leg's answer time, ``decode_first`` the decode leg's time to its first
byte and ``decode`` the whole decode leg of a stream (with ``prefill``, what Little's law turns
into the legs in flight over the window). ``in_flight`` (legs by role) and ``queued`` (requests
waiting for a slot with room) are now.
``covered_seconds`` is the part of the window the router has been up for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BASE = 1e-4
FACTOR = 1.1
#: About 10 minutes: anything longer counts as that.
MAX_BUCKET = 170
#: Longest window a reader may ask a router for.
HISTORY_SECONDS = 600
_LOG_FACTOR = math.log(FACTOR)

LATENCIES = ("ttft", "itl", "prefill", "decode_first", "decode")
ROLES = ("prefill", "decode")
OUTCOMES = ("ok", "failed")

Counts = dict[int, int]


def bucket_of(seconds: float) -> int:
    if seconds <= BASE:
        return 0
    return min(MAX_BUCKET, math.ceil(math.log(seconds / BASE) / _LOG_FACTOR - 1e-9))


def bucket_value(bucket: int) -> float:
    """The value a bucket stands for: its geometric middle (``BASE`` for bucket 0)."""
    return BASE if bucket <= 0 else BASE * FACTOR ** (bucket - 0.5)


def percentile(counts: Mapping[int, int], p: float) -> float | None:
    """The ``p``-th percentile (0-100, nearest rank) of a histogram, in seconds; None when empty."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(p / 100 * total))
    seen = 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= rank:
            return bucket_value(bucket)
    return bucket_value(max(counts))


def mean(counts: Mapping[int, int]) -> float | None:
    """The mean of a histogram (each sample at its bucket's value), in seconds; None when empty."""
    total = sum(counts.values())
    if total <= 0:
        return None
    return sum(bucket_value(b) * n for b, n in counts.items()) / total


def add_counts(into: Counts, more: Mapping[int, int]) -> None:
    for bucket, count in more.items():
        into[bucket] = into.get(bucket, 0) + count


def counts_to_json(counts: Mapping[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(counts.items()) if v}


def counts_from_json(doc: object) -> Counts:
    """A histogram from its JSON; ValueError naming what is wrong."""
    if not isinstance(doc, Mapping):
        raise ValueError("a histogram must be an object of bucket -> count")
    out: Counts = {}
    for key, value in doc.items():
        try:
            bucket = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"bucket {key!r} is not an integer") from None
        if not 0 <= bucket <= MAX_BUCKET:
            raise ValueError(f"bucket {bucket} is outside 0-{MAX_BUCKET}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"bucket {bucket}: count {value!r} is not an integer >= 0")
        out[bucket] = out.get(bucket, 0) + value
    return out


def started_from_json(doc: object) -> list[int]:
    """Arrivals per second from their JSON; ValueError naming what is wrong."""
    if not isinstance(doc, list):
        raise ValueError("started must be a list of counts per second")
    if len(doc) > HISTORY_SECONDS:
        raise ValueError(f"started has {len(doc)} seconds, more than {HISTORY_SECONDS}")
    for value in doc:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"started: count {value!r} is not an integer >= 0")
    return list(doc)


def add_series(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Two routers' counts per second, added second by second from the latest (each router cuts
    its seconds by its own clock: they line up within a second)."""
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    out = list(longer)
    offset = len(longer) - len(shorter)
    for i, count in enumerate(shorter):
        out[offset + i] += count
    return out


def merge_views(views: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One view from several (worker processes of a router, or every router of a deployment):
    counts and gauges add up, the window is the shortest any of them covers."""
    views = list(views)
    latency: dict[str, Counts] = {kind: {} for kind in LATENCIES}
    requests = dict.fromkeys(OUTCOMES, 0)
    in_flight = dict.fromkeys(ROLES, 0)
    queued = 0
    started: list[int] = []
    for view in views:
        started = add_series(started, started_from_json(view.get("started", [])))
        for kind in LATENCIES:
            add_counts(latency[kind], counts_from_json((view.get("latency") or {}).get(kind, {})))
        for outcome in OUTCOMES:
            requests[outcome] += int((view.get("requests") or {}).get(outcome, 0))
        for role in ROLES:
            in_flight[role] += int((view.get("in_flight") or {}).get(role, 0))
        queued += int(view.get("queued", 0))
    first = views[0] if views else {}
    return {
        "deployment": first.get("deployment"),
        "window_seconds": first.get("window_seconds"),
        "covered_seconds": min((float(v.get("covered_seconds", 0.0)) for v in views), default=0.0),
        "requests": requests,
        "started": started,
        "latency": {kind: counts_to_json(c) for kind, c in latency.items()},
        "in_flight": in_flight,
        "queued": queued,
    }
