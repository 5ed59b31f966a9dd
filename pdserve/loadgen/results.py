"""What a replay measured, as numbers: latency percentiles, goodput, throughput and load over time.

Pure functions over the per-request records the client keeps (:class:`RequestRecord`), so they
are tested on synthetic samples. Definitions (as ``vllm bench serve`` has them):

* TTFT: from sending the request to its first content chunk; e2e: to the end of the stream;
* ITL: the gap between two consecutive content chunks of one stream (every gap of every request
  is a sample); TPOT, per request: ``(e2e - TTFT) / (output tokens - 1)``;
* goodput: completed requests per second that meet every SLO given: TTFT <= ``slo_ttft_ms`` and
  the request's mean ITL (its TPOT) <= ``slo_itl_ms``; a one-token answer has no ITL and meets it;
* percentiles interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the replay's start."""

    index: int
    scheduled_s: float
    input_length: int  # from the trace
    output_length: int  # asked for (max_tokens)
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    #: Arrival time of every content chunk after the first one.
    chunk_s: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int | None = None  # usage, as the server counted them
    output_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft_ms(self) -> float | None:
        if self.sent_s is None or self.first_token_s is None:
            return None
        return (self.first_token_s - self.sent_s) * 1000

    @property
    def e2e_ms(self) -> float | None:
        if self.sent_s is None or self.end_s is None:
            return None
        return (self.end_s - self.sent_s) * 1000

    def itls_ms(self) -> list[float]:
        if self.first_token_s is None:
            return []
        times = [self.first_token_s, *self.chunk_s]
        return [(b - a) * 1000 for a, b in itertools.pairwise(times)]

    def tpot_ms(self) -> float | None:
        tokens = self.output_tokens if self.output_tokens is not None else self.chunks
        ttft, e2e = self.ttft_ms, self.e2e_ms
        if ttft is None or e2e is None or tokens < 2:
            return None
        return (e2e - ttft) / (tokens - 1)

    def send_lag_ms(self) -> float | None:
        """How late the client sent the request: its own delay, not the server's."""
        return None if self.sent_s is None else (self.sent_s - self.scheduled_s) * 1000

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "index": self.index,
            "scheduled_s": r(self.scheduled_s),
            "sent_s": r(self.sent_s),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "ttft_ms": r(self.ttft_ms),
            "tpot_ms": r(self.tpot_ms()),
            "e2e_ms": r(self.e2e_ms),
            "chunks": self.chunks,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "error": self.error,
        }


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values`` by linear interpolation; values need not be sorted."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 and max, rounded to microseconds (None when there is no sample)."""
    if not values:
        return None
    ordered = sorted(values)
    out = {"mean": sum(ordered) / len(ordered)}
    out |= {f"p{p}": percentile(ordered, p) for p in PERCENTILES}
    out["max"] = ordered[-1]
    return {k: round(v, 3) for k, v in out.items()}


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft = record.ttft_ms
        if self.ttft_ms is not None and (ttft is None or ttft > self.ttft_ms):
            return False
        tpot = record.tpot_ms()
        return self.itl_ms is None or tpot is None or tpot <= self.itl_ms


def failure_kinds(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error.split(":")[0] for r in records if r.error is not None).most_common())


def summarize(records: Sequence[RequestRecord], slo: Slo = Slo()) -> dict[str, Any]:
    """The headline figures of a replay."""
    done = [r for r in records if r.ok]
    sent = [r for r in records if r.sent_s is not None]
    start = min((r.sent_s for r in sent if r.sent_s is not None), default=0.0)
    end = max((r.end_s for r in records if r.end_s is not None), default=start)
    duration = max(end - start, 0.0)

    def rate(n: float) -> float | None:
        return round(n / duration, 3) if duration > 0 else None

    output_tokens = sum(r.output_tokens if r.output_tokens is not None else r.chunks for r in done)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_length for r in done)
    good = [r for r in done if slo.met(r)] if slo.given else []
    reported = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    lags = [lag for r in sent if (lag := r.send_lag_ms()) is not None]
    return {
        "requests": len(records),
        "sent": len(sent),
        "completed": len(done),
        "failed": len(sent) - len(done),
        "not_sent": len(records) - len(sent),
        "failures": failure_kinds(records),
        "duration_s": round(duration, 3),
        "request_throughput": rate(len(done)),
        "output_token_throughput": rate(output_tokens),
        "input_token_throughput": rate(prompt_tokens),
        "ttft_ms": distribution([x for r in done if (x := r.ttft_ms) is not None]),
        "itl_ms": distribution([x for r in done for x in r.itls_ms()]),
        "tpot_ms": distribution([x for r in done if (x := r.tpot_ms()) is not None]),
        "e2e_ms": distribution([x for r in done if (x := r.e2e_ms) is not None]),
        "goodput": None
        if not slo.given
        else {
            "slo_ttft_ms": slo.ttft_ms,
            "slo_itl_ms": slo.itl_ms,
            "good": len(good),
            "share": round(len(good) / len(records), 4) if records else None,
            "request_throughput": rate(len(good)),
        },
        # From usage.prompt_tokens_details (vLLM's --enable-prompt-tokens-details): per request.
        "usage_cached_tokens": None
        if not reported
        else {
            "requests": len(reported),
            "cached_tokens": sum(r.cached_tokens or 0 for r in reported),
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in reported),
            "hit_ratio": round(
                sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported), 4
            ),
        },
        "send_lag_ms": distribution(lags),
    }


# --- over time ---------------------------------------------------------------------------------


def timeline(records: Sequence[RequestRecord], bin_s: float) -> list[dict[str, Any]]:
    """Per bin of ``bin_s`` seconds: requests sent, completed and failed in it, requests in flight
    at its end, and the TTFT and e2e percentiles of the requests sent in it."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    sent = [r for r in records if r.sent_s is not None]
    if not sent:
        return []
    last = max(t for r in sent for t in (r.sent_s, r.end_s) if t is not None)
    n = int(last // bin_s) + 1
    counts = {"sent": [0] * n, "completed": [0] * n, "failed": [0] * n}
    starts_minus_ends = [0] * (n + 1)
    ttft: list[list[float]] = [[] for _ in range(n)]
    e2e: list[list[float]] = [[] for _ in range(n)]
    for r in sent:
        assert r.sent_s is not None
        first = int(r.sent_s // bin_s)
        counts["sent"][first] += 1
        starts_minus_ends[first] += 1
        if r.end_s is None:
            continue
        end = int(r.end_s // bin_s)
        counts["completed" if r.ok else "failed"][end] += 1
        starts_minus_ends[end] -= 1  # in flight at the end of bins first .. end - 1
        if r.ok and r.ttft_ms is not None and r.e2e_ms is not None:
            ttft[first].append(r.ttft_ms)
            e2e[first].append(r.e2e_ms)
    bins = []
    in_flight = 0
    for i in range(n):
        in_flight += starts_minus_ends[i]
        bins.append(
            {
                "t_s": round(i * bin_s, 6),
                **{name: values[i] for name, values in counts.items()},
                "in_flight": in_flight,
                "ttft_ms_p50": round(percentile(ttft[i], 50), 3) if ttft[i] else None,
                "ttft_ms_p99": round(percentile(ttft[i], 99), 3) if ttft[i] else None,
                "e2e_ms_p50": round(percentile(e2e[i], 50), 3) if e2e[i] else None,
            }
        )
    return bins
