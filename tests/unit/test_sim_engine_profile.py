"""Performance profiles: the packaged ones load, a bad one is refused naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from pdserve.sim.engine.profile import PACKAGED, ProfileError, load, packaged_names, parse


def packaged(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((PACKAGED / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("name", packaged_names())
def test_packaged_profiles_load_and_say_where_their_figures_come_from(name: str) -> None:
    assert name in packaged_names()
    profile = load(name)
    assert profile.name == name and len(profile.source) > 80
    assert profile.step_seconds(0, 1, 0) > 0 and profile.transfer_seconds(1000) > 0


def test_step_and_transfer_costs() -> None:
    data = packaged("cpu-tiny-llama")
    data["step"] = {"step_ms": 2.0, "prefill_token_ms": 0.5, "decode_seq_ms": 0.25, "context_ktoken_ms": 1.0}
    data["kv_transfer"] = {"bytes_per_token": 1000, "bandwidth_gb_per_s": 1.0, "latency_ms": 3.0}
    p = parse(data)
    assert p.step_seconds(prefill_tokens=10, decode_seqs=4, context_tokens=2000) == pytest.approx(0.010)
    assert p.transfer_seconds(1_000_000) == pytest.approx(0.003 + 1.0)
    assert p.transfer_seconds(0) == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["step"].pop("decode_seq_ms"), "step.decode_seq_ms is missing"),
        (lambda d: d.pop("kv_transfer"), "kv_transfer is missing"),
        (lambda d: d["request"].update(frontend_ms=-1), "request.frontend_ms must not be negative"),
        (lambda d: d["step"].update(step_ms="fast"), "step.step_ms must be a number"),
        (lambda d: d["step"].update(step_ms=True), "step.step_ms must be a number"),
        (lambda d: d["engine"].update(block_size=0), "engine.block_size must be an integer >= 1"),
        (lambda d: d["engine"].update(max_num_seqs=2.5), "engine.max_num_seqs must be an integer >= 1"),
        (lambda d: d.pop("source"), "source is missing"),
    ],
)
def test_a_bad_figure_is_refused_by_name(change: Any, message: str) -> None:
    data = copy.deepcopy(packaged("cpu-tiny-llama"))
    change(data)
    with pytest.raises(ProfileError, match=message):
        parse(data, "bad.yaml")


def test_an_unknown_profile_names_the_packaged_ones() -> None:
    with pytest.raises(ProfileError, match=r"cpu-tiny-llama, h200-llama-3\.1-8b"):
        load("no-such-profile")
