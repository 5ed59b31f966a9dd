"""Fault specs of `pdserve sim`: parsing, JSON bodies, and which fault fires on which request."""

from __future__ import annotations

import random

import pytest

from pdserve.sim.faults import (
    Fault,
    FaultKind,
    FaultSpecError,
    choose_fault,
    drop_after_chunks,
    faults_from_json,
    parse_fault,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("http-500", Fault(FaultKind.HTTP_500, 1.0)),
        ("http-500:0.5", Fault(FaultKind.HTTP_500, 0.5)),
        ("http-500@0.25", Fault(FaultKind.HTTP_500, 0.25)),
        ("reset:1", Fault(FaultKind.RESET, 1.0)),
        ("hang@0", Fault(FaultKind.HANG, 0.0)),
        ("slow-first-byte:2000", Fault(FaultKind.SLOW_FIRST_BYTE, 1.0, 2000)),
        ("slow-first-byte:2000@0.5", Fault(FaultKind.SLOW_FIRST_BYTE, 0.5, 2000)),
        (" drop-mid-stream ", Fault(FaultKind.DROP_MID_STREAM, 1.0)),
        ("malformed-kv-params:0.1", Fault(FaultKind.MALFORMED_KV_PARAMS, 0.1)),
    ],
)
def test_parse_fault_accepts_documented_syntax(spec: str, expected: Fault) -> None:
    assert parse_fault(spec) == expected


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("explode", "unknown kind 'explode'"),
        ("http-500:2", "outside [0, 1]"),
        ("http-500@-0.1", "outside [0, 1]"),
        ("http-500:half", "not a number"),
        ("slow-first-byte", "needs a delay"),
        ("slow-first-byte:1.5", "whole number of milliseconds"),
        ("reset:0.5@0.5", "takes no argument"),
    ],
)
def test_parse_fault_rejects_bad_specs_clearly(spec: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_fault(spec)
    assert fragment in str(info.value)
    assert repr(spec) in str(info.value)


def test_spec_round_trips() -> None:
    for spec in ("http-500@0.5", "slow-first-byte:30@1", "reset@1"):
        assert parse_fault(spec).spec() == spec
        assert parse_fault(parse_fault(spec).spec()) == parse_fault(spec)


def test_faults_from_json_accepts_strings_and_objects() -> None:
    faults = faults_from_json(
        {
            "faults": [
                "http-500@0.5",
                {"kind": "slow-first-byte", "ms": 10, "rate": 0.2, "roles": ["decode"], "ranks": [1]},
            ]
        }
    )
    assert faults == (
        Fault(FaultKind.HTTP_500, 0.5),
        Fault(FaultKind.SLOW_FIRST_BYTE, 0.2, 10, frozenset({"decode"}), frozenset({1})),
    )
    assert faults_from_json({"faults": []}) == ()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([], "JSON object"),
        ({"fault": []}, "JSON object"),
        ({"faults": "reset"}, "expected a list"),
        ({"faults": [{"kind": "nope"}]}, "unknown kind"),
        ({"faults": [{"kind": "reset", "rate": 3}]}, "faults[0].rate"),
        ({"faults": [{"kind": "reset", "rate": True}]}, "faults[0].rate"),
        ({"faults": [{"kind": "slow-first-byte"}]}, "faults[0].ms"),
        ({"faults": [{"kind": "reset", "ms": 5}]}, "only slow-first-byte"),
        ({"faults": [{"kind": "reset", "roles": ["router"]}]}, "faults[0].roles"),
        ({"faults": [{"kind": "reset", "ranks": ["0"]}]}, "faults[0].ranks"),
        ({"faults": ["reset", 7]}, "faults[1]"),
        ({"faults": ["http-500:7"]}, "faults[0]"),
    ],
)
def test_faults_from_json_names_the_bad_field(body: object, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        faults_from_json(body)
    assert fragment in str(info.value)


def test_choose_fault_respects_rate_and_seed() -> None:
    faults = (Fault(FaultKind.HTTP_500, 0.3),)
    rng_a, rng_b = random.Random(42), random.Random(42)
    seq_a = [choose_fault(faults, rng_a, "plain", 0) for _ in range(200)]
    seq_b = [choose_fault(faults, rng_b, "plain", 0) for _ in range(200)]
    assert seq_a == seq_b
    fired = sum(1 for f in seq_a if f is not None)
    assert 30 < fired < 90  # rate 0.3 of 200, far from 0 and from 200


def test_choose_fault_rate_bounds() -> None:
    rng = random.Random(1)
    assert all(choose_fault((Fault(FaultKind.RESET, 1.0),), rng, "plain", 0) for _ in range(50))
    assert not any(choose_fault((Fault(FaultKind.RESET, 0.0),), rng, "plain", 0) for _ in range(50))


def test_choose_fault_first_that_fires_wins_and_filters_apply() -> None:
    rng = random.Random(0)
    hang = Fault(FaultKind.HANG, 1.0, legs=frozenset({"decode"}))
    reset = Fault(FaultKind.RESET, 1.0, ranks=frozenset({1}))
    http = Fault(FaultKind.HTTP_500, 1.0)
    faults = (hang, reset, http)
    assert choose_fault(faults, rng, "decode", 0) is hang
    assert choose_fault(faults, rng, "prefill", 1) is reset
    assert choose_fault(faults, rng, "prefill", 0) is http


def test_malformed_kv_params_only_hits_prefill_answers() -> None:
    rng = random.Random(0)
    fault = Fault(FaultKind.MALFORMED_KV_PARAMS, 1.0)
    assert choose_fault((fault,), rng, "prefill", 0) is fault
    assert choose_fault((fault,), rng, "decode", 0) is None
    assert choose_fault((fault,), rng, "plain", 0) is None


@pytest.mark.parametrize(("tokens", "sent"), [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8)])
def test_drop_after_chunks_sends_some_but_never_all(tokens: int, sent: int) -> None:
    assert drop_after_chunks(tokens) == sent
