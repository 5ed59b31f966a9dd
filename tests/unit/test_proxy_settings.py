"""`pdserve proxy`'s flags come from its settings: every flag that ever existed still works, each
help shows its default, every environment variable the router reads is listed, and bad values
are refused naming the flag or the variable."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from pdserve.argtypes import SettingsError, flags_of
from pdserve.proxy import cli
from pdserve.proxy.settings import (
    GROUPS,
    ListenSettings,
    ProxySettings,
    RetrySettings,
    SidecarSettings,
    TableSettings,
)
from pdserve.routing.sidecar import LocalDecode

PROXY = Path(__file__).resolve().parents[2] / "pdserve" / "proxy"

# The interface: rendered pods, docs, tests and users pass these. None may go.
FLAGS = [
    "--routing-configmap",
    "--kubeconfig",
    "--routing-file",
    "--host",
    "--port",
    "--admin-port",
    "--admin-host",
    "--policy",
    "--http-server",
    "--backlog",
    "--max-retries",
    "--kv-lease-seconds",
    "--max-fan-out",
    "--eject-seconds",
    "--max-body-bytes",
    "--api-key",
    "--backend-api-key",
    "--prefill-ttfb-timeout",
    "--decode-ttfb-timeout",
    "--stream-idle-timeout",
    "--connect-timeout",
    "--keep-alive-seconds",
    "--shutdown-grace-seconds",
    "--grace-seconds",
    "--shutdown-delay-seconds",
    "--reload-interval",
    "--local-decode",
    "--local-dp-size",
    "--local-first-rank",
    "--local-revision",
    "--local-name",
    "--instance-index",
    "--max-per-slot",
    "--admission-queue",
    "--admission-timeout",
    "--workers",
    "--log-level",
]


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.configure(out)
    return out


def settings(*argv: str) -> ProxySettings:
    return cli.settings_from_args(parser().parse_args(["--routing-file", "t.json", *argv]))


def test_every_flag_of_the_interface_is_there() -> None:
    known = {name for action in parser()._actions for name in action.option_strings}
    assert set(FLAGS) <= known, sorted(set(FLAGS) - known)


def test_every_flag_shows_its_default() -> None:
    for action in parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "(default " in (action.help or ""), action.option_strings


def test_the_cli_defaults_are_the_settings_defaults() -> None:
    """One place for each default: a router started without flags runs with the dataclasses'."""
    built = settings()
    assert built.policy == ProxySettings.__dataclass_fields__["policy"].default
    for name, _, settings_class in GROUPS:
        group = getattr(built, name)
        for field, _, default in flags_of(settings_class):
            if (name, field) != ("server", "workers"):  # 0: resolved to the CPUs available
                assert getattr(group, field) == default, (name, field)
    assert built.server.workers >= 1


def _named(node: ast.AST) -> object:
    """The string an expression reads a variable by, if it is one of the shapes that do."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        first = node.args[0]
        return (
            first.value if node.func.attr in ("get", "getenv") and isinstance(first, ast.Constant) else None
        )
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        return node.value.value if any(n.endswith("_ENV") for n in names) else None
    return None


def environment_read_by_the_router() -> set[str]:
    """Every variable name the router's source reads: ``os.environ.get("X")``, ``env["X"]``, ...
    and module constants naming one (``MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"``)."""
    found: set[str] = set()
    for path in PROXY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            key = _named(node)
            if isinstance(key, str) and re.fullmatch(r"[A-Z][A-Z0-9_]{3,}", key):
                found.add(key)
    return found


def test_every_environment_variable_the_router_reads_is_in_its_help() -> None:
    text = parser().format_help()
    read = environment_read_by_the_router() | {flag.env for _, flag, _ in cli_flags() if flag.env}
    assert {"PDSERVE_PROXY_MAX_PER_SLOT", "PDSERVE_PROXY_WORKERS", "KUBERNETES_SERVICE_HOST"} <= read
    missing = sorted(name for name in read if f"  {name}" not in text and f", {name}:" not in text)
    assert not missing, f"not listed in `pdserve proxy --help`: {missing}"


def cli_flags() -> list[tuple[str, object, object]]:
    out = list(flags_of(ProxySettings))
    for _, _, settings_class in GROUPS:
        out += list(flags_of(settings_class))
    return out  # type: ignore[return-value]


def test_environment_gives_defaults_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PROXY_MAX_PER_SLOT", "7")
    monkeypatch.setenv("PDSERVE_PROXY_WORKERS", "3")
    monkeypatch.setenv("PDSERVE_PROXY_ADMIN_PORT", "0")  # rendered as 0: no admin port
    monkeypatch.setenv("PDSERVE_PROXY_API_KEY", "")  # empty: unset
    built = settings()
    assert (built.admission.max_per_slot, built.server.workers) == (7, 3)
    assert (built.listen.admin_port, built.requests.api_key) == (None, None)
    assert settings("--max-per-slot", "9", "--workers", "1").admission.max_per_slot == 9


def test_a_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDSERVE_PROXY_PORT", "eighty")
    with pytest.raises(SystemExit) as exit_:
        parser()
    assert exit_.value.code == 2
    assert (
        "PDSERVE_PROXY_PORT='eighty' (the default of --port): expected an integer" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--max-retries", "-1"), "--max-retries: expected a value >= 0, got -1"),
        (("--stream-idle-timeout", "0"), "--stream-idle-timeout: expected a value >= 0.001"),
        (
            ("--local-dp-size", "0", "--local-decode", "http://e:8000"),
            "--local-dp-size: expected a value >= 1",
        ),
        (("--local-decode", "e:8000"), "--local-decode: expected an http(s) URL"),
        (("--port", "9000", "--admin-port", "9000"), "--admin-port must differ from --port (9000)"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        settings(*argv)


def test_settings_check_themselves_when_built_directly() -> None:
    with pytest.raises(SettingsError, match="give one routing table source"):
        TableSettings()
    with pytest.raises(SettingsError, match="--eject-seconds"):
        RetrySettings(eject_seconds=-1)
    with pytest.raises(SettingsError, match="--port"):
        ListenSettings(port=0)
    table = TableSettings(routing_file=Path("t.json"))
    assert ProxySettings(table=table).table.source == "file t.json"
    assert dataclasses.is_dataclass(ProxySettings) and ProxySettings.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_sidecar_flags_make_one_local_decode() -> None:
    assert settings().sidecar.local is None
    built = settings(
        "--local-decode",
        "http://10.0.0.5:8000",
        "--local-dp-size",
        "2",
        "--local-name",
        "d-0",
        "--instance-index",
        "1",
    )
    assert built.sidecar.local == LocalDecode("http://10.0.0.5:8000", 2, "", "d-0", 1, 0)
    assert SidecarSettings().local is None
