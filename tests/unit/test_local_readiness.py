"""Local mode's readiness rule for a running engine: the pods' readiness probe (failureThreshold 3),
so a busy engine that is late with one /health answer keeps its place in the routing table."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.local.supervisor import READINESS_FAILURES, readiness


def walk(answers: list[bool]) -> list[bool]:
    ready, failures, seen = False, 0, []
    for answered in answers:
        ready, failures = readiness(ready, failures, answered)
        seen.append(ready)
    return seen


def test_one_late_answer_keeps_a_ready_engine_ready() -> None:
    assert walk([True, False, True]) == [True, True, True]


def test_a_ready_engine_leaves_at_the_third_failure_in_a_row() -> None:
    assert READINESS_FAILURES == 3
    assert walk([True, False, False, False, False]) == [True, True, True, False, False]


def test_an_engine_not_yet_ready_stays_out_until_it_answers() -> None:
    assert walk([False, False, True]) == [False, False, True]


@given(st.lists(st.booleans(), max_size=40))
def test_ready_exactly_when_one_of_the_last_answers_succeeded(answers: list[bool]) -> None:
    for i, ready in enumerate(walk(answers)):
        last = answers[max(0, i - READINESS_FAILURES + 1) : i + 1]
        assert ready == any(last), (answers[: i + 1], ready)
