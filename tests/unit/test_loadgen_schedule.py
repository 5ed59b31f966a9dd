"""The open-loop schedule as data: trace times from the first request, divided by the speed-up,
the first N requests with --limit."""

from __future__ import annotations

import pytest

from pdserve.loadgen.schedule import offered_rate, schedule
from pdserve.loadgen.trace import TraceRequest


def _at(*times_ms: float) -> list[TraceRequest]:
    return [TraceRequest(t, 10, 1, (i,)) for i, t in enumerate(times_ms)]


def test_times_start_at_the_first_request_and_shrink_with_the_speedup() -> None:
    requests = _at(1000, 1500, 3000, 3000)
    assert [a.at_s for a in schedule(requests)] == [0.0, 0.5, 2.0, 2.0]
    assert [a.at_s for a in schedule(requests, speedup=10)] == [0.0, 0.05, 0.2, 0.2]
    assert [a.at_s for a in schedule(requests, speedup=0.5)] == [0.0, 1.0, 4.0, 4.0]
    assert [a.request for a in schedule(requests)] == requests


def test_limit_takes_the_first_requests_by_time_and_ties_keep_trace_order() -> None:
    requests = _at(300, 100, 200, 100)
    arrivals = schedule(requests, limit=3)
    assert [a.request.hash_ids for a in arrivals] == [(1,), (3,), (2,)]
    assert [a.index for a in arrivals] == [0, 1, 2]
    assert [a.at_s for a in arrivals] == [0.0, 0.0, 0.1]
    assert len(schedule(requests, limit=10)) == 4


def test_offered_rate() -> None:
    assert offered_rate(schedule(_at(0, 500, 1000), speedup=2)) == pytest.approx(4.0)
    assert offered_rate(schedule(_at(0))) is None


@pytest.mark.parametrize(("speedup", "limit"), [(0, None), (-1, None), (1, 0)])
def test_bad_speedup_or_limit(speedup: float, limit: int | None) -> None:
    with pytest.raises(ValueError):
        schedule(_at(0), speedup, limit)
