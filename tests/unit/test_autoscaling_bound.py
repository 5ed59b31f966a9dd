"""The autoscaling bench's ideal autoscaler (bench/autoscaling_bound.py): what following the load
exactly would bill against a deployment fixed at the peak."""

from __future__ import annotations

from itertools import pairwise

import pytest

from bench.autoscaling_bound import bound, swing
from pdserve.loadgen.schedule import Arrival
from pdserve.loadgen.trace import TraceRequest
from pdserve.sim.engine.profile import load

PROFILE = load("synthetic-autoscaling")
PEAK = {"prefill": 4, "decode": 4}
MINIMUM = {"prefill": 1, "decode": 1}


def arrivals(per_window: list[int], window: float = 10.0) -> list[Arrival]:
    """``per_window[i]`` equal requests spread over window ``i``."""
    out = []
    for i, n in enumerate(per_window):
        for k in range(n):
            at = i * window + (k + 0.5) * window / n
            out.append(Arrival(len(out), at, TraceRequest(at * 1000, 1000, 100, ())))
    return out


def test_a_flat_load_leaves_nothing_to_save() -> None:
    b = bound(arrivals([8] * 12), PROFILE, PEAK, MINIMUM, 10.0, 30.0)
    assert (
        b.fractional == pytest.approx(1.0)
        and b.whole == pytest.approx(1.0)
        and b.stabilised == pytest.approx(1.0)
    )


def test_a_load_at_a_quarter_of_its_peak_most_of_the_time() -> None:
    """Peak in 2 windows of 12, a quarter of it in the others: an ideal autoscaler runs 1 of 4 per
    role there; its scale-down waits 25 s, 3 windows, after the peak."""
    b = bound(arrivals([8, 8] + [2] * 10), PROFILE, PEAK, MINIMUM, 10.0, 25.0)
    assert b.fractional == pytest.approx((2 * 4 + 10 * 1) / 12 / 4)
    assert b.whole == pytest.approx(b.fractional)
    assert b.stabilised == pytest.approx((5 * 4 + 7 * 1) / 12 / 4)  # 4 until 3 windows after the peak
    assert list(b.counts["prefill"]) == [4] * 5 + [1] * 7
    assert b.mean_over_peak["prefill"] == pytest.approx(b.fractional)


def test_whole_instances_round_up_and_never_go_below_the_minimum() -> None:
    b = bound(arrivals([8, 3, 0, 3]), PROFILE, PEAK, MINIMUM, 10.0, 0.0)
    assert list(b.counts["prefill"]) == [4, 2, 1, 2]  # 1.5 -> 2, nothing -> minInstances
    assert b.whole > b.fractional


def test_swing_slows_the_first_and_last_third_and_keeps_the_requests() -> None:
    trace = arrivals([3] * 4)  # 12 requests, gaps of 3.33 s
    swung = swing(trace, 3.0)
    gaps = [b.at_s - a.at_s for a, b in pairwise(swung)]
    before = [b.at_s - a.at_s for a, b in pairwise(trace)]
    assert [a.request for a in swung] == [a.request for a in trace] and swung[0].at_s == trace[0].at_s
    # the gap before request i is stretched unless i is in the middle third (4..7)
    assert gaps == pytest.approx([g * (1 if 4 <= i + 1 < 8 else 3) for i, g in enumerate(before)])
    assert swing(trace, 1.0) == trace
    b_trace = bound(trace, PROFILE, PEAK, MINIMUM, 10.0, 0.0)
    b_swung = bound(swung, PROFILE, PEAK, MINIMUM, 10.0, 0.0)
    assert b_swung.fractional < b_trace.fractional  # a load that swings leaves more to save
    with pytest.raises(ValueError, match="swing factor"):
        swing(trace, 0.0)
