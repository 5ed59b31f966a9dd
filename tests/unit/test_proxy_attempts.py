"""The retry policy: when a handoff may go to another decode, unreachable instances, candidate order."""

from __future__ import annotations

import pytest

from pdserve.proxy.engine.upstream import LegError
from pdserve.proxy.flow.attempts import (
    Handoff,
    LegFailure,
    Walk,
    handoff_reusable,
    no_slot_detail,
    no_slot_reply,
)
from pdserve.proxy.policies import POLICIES, make_policy
from pdserve.proxy.state.health import SlotBook, Unreachable
from pdserve.routing import Connector, Instance, Role, RoutingTable, Slot, build_slot_table, interleaved_slots

P = Instance("p", "http://p:1", 1, 1, True)
D0 = Instance("d0", "http://d0:1", 2, 1, True)
D1 = Instance("d1", "http://d1:1", 1, 1, True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def failure(role: Role, outcome: str) -> LegFailure:
    slot = Slot(P, 0) if role is Role.PREFILL else Slot(D0, 0)
    return LegFailure(role, slot, LegError(outcome, "x"))


@pytest.mark.parametrize(
    ("outcome", "reusable", "age", "expected"),
    [
        ("connect_error", True, 1.0, True),  # the decode never got the request: the KV is intact
        ("connect_error", True, 14.9, True),
        ("connect_error", True, 15.0, False),  # half the 30 s lease gone: a new prefill is safer
        ("connect_error", False, 1.0, False),  # MoRIIO: the handoff names its one decode
        ("dropped", True, 1.0, False),  # the decode may have pulled (and freed) the KV
        ("http_5xx", True, 1.0, False),  # vLLM's serving layer frees a rejected request's KV
        ("timeout", True, 1.0, False),  # cancelled: the decode's abort frees the prefill's KV
    ],
)
def test_a_handoff_is_reused_only_when_no_decode_can_have_touched_it(
    outcome: str, reusable: bool, age: float, expected: bool
) -> None:
    handoff = Handoff({"remote_engine_id": "e"}, Slot(P, 0), received=100.0)
    decided = handoff_reusable(handoff, failure(Role.DECODE, outcome), reusable, 30.0, 100.0 + age)
    assert decided is expected
    assert not handoff_reusable(None, failure(Role.DECODE, outcome), reusable, 30.0, 101.0)
    assert not handoff_reusable(handoff, failure(Role.PREFILL, outcome), reusable, 30.0, 101.0)


def test_unreachable_instances_come_back_after_the_cool_down() -> None:
    clock = Clock()
    down = Unreachable(10.0, clock)
    d0 = Slot(D0, 1)
    assert not down.any() and down.reachable(Role.DECODE, d0)
    down.mark(Role.DECODE, "d0")
    assert down.any() and not down.reachable(Role.DECODE, d0)
    assert down.reachable(Role.PREFILL, Slot(Instance("d0", "http://x:1"), 0))  # per role
    assert down.reachable(Role.DECODE, Slot(D1, 0))
    clock.now += 4
    assert down.retry_after(Role.DECODE, [d0]) == pytest.approx(6.0)
    assert down.snapshot() == {"decode": {"d0": 6.0}}
    clock.now += 6.5
    assert down.reachable(Role.DECODE, d0) and not down.any() and down.snapshot() == {}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_candidates_skip_unreachable_then_put_ejected_last(name: str) -> None:
    clock = Clock()
    policy, book = make_policy(name), SlotBook(10.0, clock)
    slots = list(interleaved_slots([D0, D1]))  # d0/0, d1/0, d0/1
    assert policy.candidates(Role.DECODE, slots, book, 0) == slots  # nothing wrong: in order
    book.eject(Role.DECODE, "d1/0")
    assert policy.candidates(Role.DECODE, slots, book, 0) == [slots[0], slots[2], slots[1]]
    book.unreachable.mark(Role.DECODE, "d0")
    assert policy.candidates(Role.DECODE, slots, book, 0) == [slots[1]]  # unreachable: never
    clock.now += 10.5
    assert policy.candidates(Role.DECODE, slots, book, 0) == slots


def test_a_retry_tries_the_slots_that_failed_last() -> None:
    slots = list(interleaved_slots([D0, D1]))  # d0/0, d1/0, d0/1
    walk = Walk(prefill_turn=0)
    assert walk.tried_last(Role.DECODE, slots) == slots
    walk.failed.add((Role.DECODE, "d0/0"))
    walk.failed.add((Role.PREFILL, "d1/0"))  # another role's failure changes nothing here
    assert walk.tried_last(Role.DECODE, slots) == [slots[1], slots[2], slots[0]]
    assert walk.tried_last(Role.DECODE, slots[:1]) == slots[:1]  # nothing else left: tried again


def test_no_slot_replies_say_why_and_when_to_retry() -> None:
    clock = Clock()
    down = Unreachable(10.0, clock)
    table = RoutingTable("x", 1, Connector("nixl"), (P,), (D0, D1))
    slots = build_slot_table(table)
    assert no_slot_detail(Role.PREFILL, None, down) == ("no routing table is loaded yet", 1.0)
    down.mark(Role.DECODE, "d0")
    down.mark(Role.DECODE, "d1")
    clock.now += 2.5
    detail, wait = no_slot_detail(Role.DECODE, slots, down)
    assert detail == "d0, d1 refused connections; retried in 8 s" and wait == pytest.approx(7.5)
    reply = no_slot_reply(Role.DECODE, detail, wait)
    assert reply.status == 503 and reply.headers == ((b"retry-after", b"8"),)
    lonely = build_slot_table(
        RoutingTable(
            "x", 1, Connector("nixl"), (P,), (Instance("d", "http://d:1", ready=True, revision="new"),)
        )
    )
    detail, _ = no_slot_detail(Role.DECODE, lonely, down)
    assert detail.startswith("the unversioned revision has 1 routable prefill slot(s) but no routable decode")
    empty = build_slot_table(RoutingTable("x", 1, Connector("nixl"), (P,), ()))
    assert no_slot_detail(Role.DECODE, empty, down)[0] == "none is ready in the routing table"
