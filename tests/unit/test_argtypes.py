"""The flag generator (pdserve.argtypes): flags declared on settings dataclasses, parsed back by
field name, and the commands' value objects that take them by name."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields

import pytest

from pdserve.argtypes import Flag, add_flags, flag_values, positive_int, setting, stating_default
from pdserve.loadgen import cli as loadgen_cli
from pdserve.loadgen.replay import ReplayOptions
from pdserve.loadgen.trace import PoissonSpec
from pdserve.operator import cli as operator_cli
from pdserve.sim import cli as sim_cli
from pdserve.sim.config import SimConfig
from pdserve.sim.group import GroupConfig


@dataclass(frozen=True)
class Example:
    source: str = setting(None, "source", metavar="SRC", help="where from")
    count: int = setting(3, "--count", type=positive_int, env="EXAMPLE_COUNT", help="how many")
    tag: tuple[str, ...] = setting((), "-t", "--tag", action="append", help="repeatable")
    colour: bool = setting(True, "--no-colour", action="store_false", help="plain output")
    label: str | None = setting(None, "--label", type=str, help="empty: none")


@dataclass(frozen=True)
class Target:
    count: int
    colour: bool = True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="example")
    add_flags(p, Example)
    return p


def test_flags_parse_back_by_field_name() -> None:
    args = parser().parse_args(["x", "--count", "5", "-t", "a", "--tag", "b", "--no-colour", "--label", ""])
    assert flag_values(args, Example) == {
        "source": "x",
        "count": 5,
        "tag": ["a", "b"],
        "colour": False,
        "label": None,  # an empty string is no value where the default is none
    }
    assert flag_values(args, Example, into=Target) == {"count": 5, "colour": False}
    assert flag_values(parser().parse_args(["y"]), Example)["tag"] == []  # a fresh list each parse


def test_the_environment_gives_a_default_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXAMPLE_COUNT", "7")
    assert parser().parse_args(["x"]).count == 7
    assert parser().parse_args(["x", "--count", "2"]).count == 2


def test_a_bad_value_is_named_the_way_every_command_words_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["x", "--count", "0"])
    assert "argument --count: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_a_bad_environment_value_names_the_variable_and_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXAMPLE_COUNT", "many")
    with pytest.raises(SystemExit):
        parser()
    assert "EXAMPLE_COUNT='many' (the default of --count): expected a value" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("help_text", "default", "shown"),
    [
        ("ranks", 1, "ranks (default: 1)"),
        ("ms", 20.0, "ms (default: 20)"),
        ("ms", 0.5, "ms (default: 0.5)"),
        ("role", "both", "role (default: both)"),
        ("seed (default: random)", None, "seed (default: random)"),  # the help words its own
        ("port (NIXL; default: 5600)", 5600, "port (NIXL; default: 5600)"),
        ("a switch", False, "a switch"),
        ("repeatable", (), "repeatable"),
        ("the leader's address", None, "the leader's address"),
    ],
)
def test_stating_default_shows_a_value_once(help_text: str, default: object, shown: str) -> None:
    assert stating_default(Flag(("--x",), help_text), default) == shown


# A value object takes the flags it shares a field name with: a renamed field would silently
# drop its flag (most have a default), so the shared names are written down here.
@pytest.mark.parametrize(
    ("settings_class", "into", "shared"),
    [
        (sim_cli.SimFlags, SimConfig, {"role", "dp_size", "ttft_ms", "itl_ms", "tokens", "seed"}),
        (
            sim_cli.GroupFlags,
            GroupConfig,
            {"dp_local", "start_rank", "hybrid_lb", "headless", "nnodes", "node_rank"},
        ),
        (loadgen_cli.PoissonFlags, PoissonSpec, {f.name for f in fields(loadgen_cli.PoissonFlags)}),
        (
            loadgen_cli.ReplayFlags,
            ReplayOptions,
            {
                "url",
                "model",
                "endpoint",
                "api_key",
                "speedup",
                "admin_url",
                "metrics_interval_s",
                "timeout_s",
                "max_connections",
                "ignore_eos",
                "progress",
            },
        ),
    ],
)
def test_the_value_objects_take_the_flags_they_share(
    settings_class: type, into: type, shared: set[str]
) -> None:
    assert {f.name for f in fields(settings_class)} & {f.name for f in fields(into)} == shared


@pytest.mark.parametrize(
    ("configure", "argv", "classes"),
    [
        (sim_cli.configure, [], (sim_cli.SimFlags, sim_cli.TracingFlags, sim_cli.GroupFlags)),
        (loadgen_cli.configure_replay, ["poisson"], (loadgen_cli.ReplayFlags, loadgen_cli.PoissonFlags)),
        (
            operator_cli.configure,
            [],
            (operator_cli.ScopeFlags, operator_cli.OperatorFlags, operator_cli.ElectionFlags),
        ),
    ],
)
def test_without_flags_every_setting_is_its_declared_default(
    configure: Callable[[argparse.ArgumentParser], None],
    argv: list[str],
    classes: tuple[type, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PDSERVE_OPERATOR_OTLP_TRACES_ENDPOINT", raising=False)
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(argv)
    for settings_class in classes:
        defaults = {f.name: f.default for f in fields(settings_class) if f.name != "trace"}
        parsed = {k: v for k, v in flag_values(args, settings_class).items() if k != "trace"}
        assert parsed == {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}
