"""Policies: candidate order, ejection as a last resort, least-outstanding tie-breaks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from pdserve.proxy.policies import DEFAULT_POLICY, POLICIES, make_policy
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Instance, Role, Slot, interleaved_slots
from tests.support.tables import choose


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def slots() -> tuple[Slot, ...]:
    return interleaved_slots(
        [Instance("a", "http://a:1", 2, 1, True), Instance("b", "http://b:1", 2, 1, True)]
    )


def keys(candidates: list[Slot]) -> list[str]:
    return [s.key for s in candidates]


def test_registry() -> None:
    assert DEFAULT_POLICY == "flat-interleaved"
    assert set(POLICIES) == {"flat-interleaved", "least-outstanding"}
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        make_policy("random")


def test_every_policy_is_known_to_the_spec_parser_and_the_crd() -> None:
    """A policy is a module and a line in the registry, and its name in the spec's choices and the
    CRD's enum (docs/architecture.md#adding-a-routing-policy): they must agree."""
    import yaml

    from pdserve.deployment.spec import pddeployment

    crd_path = Path(__file__).resolve().parents[2] / "crds" / "pddeployments.pdserve.io.yaml"
    crd = yaml.safe_load(crd_path.read_text(encoding="utf-8"))
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    enum = spec["properties"]["router"]["properties"]["policy"]["enum"]
    assert set(POLICIES) == set(pddeployment.POLICIES) == set(enum)
    assert DEFAULT_POLICY == pddeployment.DEFAULT_POLICY


def test_flat_interleaved_candidates_rotate_once_per_request() -> None:
    policy, book = make_policy("flat-interleaved"), SlotBook(10)
    assert keys(choose(policy, Role.PREFILL, slots(), book)) == ["a/0", "b/0", "a/1", "b/1"]
    assert keys(choose(policy, Role.PREFILL, slots(), book)) == ["b/0", "a/1", "b/1", "a/0"]
    # each role has its own counter
    assert keys(choose(policy, Role.DECODE, slots(), book))[0] == "a/0"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_ejected_slots_come_last_until_the_cool_down_ends(name: str) -> None:
    clock = FakeClock()
    policy, book = make_policy(name), SlotBook(10, clock)
    assert book.eject(Role.PREFILL, "a/0") is True
    assert book.eject(Role.PREFILL, "a/0") is False  # already ejected: extended, not counted twice
    assert book.state(Role.PREFILL, "a/0").ejections == 1
    for _ in range(8):
        order = keys(choose(policy, Role.PREFILL, slots(), book))
        assert order[-1] == "a/0" and sorted(order) == ["a/0", "a/1", "b/0", "b/1"]
    assert book.ejected_for(Role.PREFILL, "a/0") == pytest.approx(10)
    clock.now += 10.5
    assert not book.ejected(Role.PREFILL, "a/0")
    firsts = Counter(keys(choose(policy, Role.PREFILL, slots(), book))[0] for _ in range(4))
    assert firsts == {"a/0": 1, "a/1": 1, "b/0": 1, "b/1": 1}


def test_all_ejected_still_yields_every_slot() -> None:
    policy, book = make_policy("flat-interleaved"), SlotBook(10)
    for s in slots():
        book.eject(Role.DECODE, s.key)
    assert sorted(keys(choose(policy, Role.DECODE, slots(), book))) == ["a/0", "a/1", "b/0", "b/1"]


def test_least_outstanding_prefers_the_idlest_slot() -> None:
    policy, book = make_policy("least-outstanding"), SlotBook(10)
    for key, n in {"a/0": 3, "b/0": 1, "a/1": 2, "b/1": 0}.items():
        for _ in range(n):
            book.started(Role.DECODE, key)
    assert keys(choose(policy, Role.DECODE, slots(), book)) == ["b/1", "b/0", "a/1", "a/0"]
    book.finished(Role.DECODE, "a/0", ok=False)
    assert book.state(Role.DECODE, "a/0").errors == 1 and book.in_flight(Role.DECODE, "a/0") == 2


def test_least_outstanding_ties_follow_the_interleaved_rotation() -> None:
    """An idle proxy spreads requests exactly like flat-interleaved."""
    policy, book = make_policy("least-outstanding"), SlotBook(10)
    firsts = [choose(policy, Role.PREFILL, slots(), book)[0].key for _ in range(8)]
    assert firsts == ["a/0", "b/0", "a/1", "b/1"] * 2
    book.started(Role.PREFILL, "a/0")  # a/0 busy: ties among the idle three, in rotation order
    assert keys(choose(policy, Role.PREFILL, slots(), book)) == ["b/0", "a/1", "b/1", "a/0"]


def test_empty_role_has_no_candidates() -> None:
    for name in POLICIES:
        assert choose(make_policy(name), Role.PREFILL, (), SlotBook(1)) == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_group_has_its_own_counter(name: str) -> None:
    """The decode slots of each revision are walked by a counter of their own."""
    policy, book = make_policy(name), SlotBook(10)
    firsts = [choose(policy, Role.DECODE, slots(), book, "ra")[0].key for _ in range(3)]
    assert firsts == ["a/0", "b/0", "a/1"]
    assert choose(policy, Role.DECODE, slots(), book, "rb")[0].key == "a/0"  # untouched by ra
    assert choose(policy, Role.DECODE, slots(), book)[0].key == "a/0"  # nor the default group
    assert choose(policy, Role.DECODE, slots(), book, "ra")[0].key == "b/1"
