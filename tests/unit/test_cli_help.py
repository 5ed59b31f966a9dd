"""`pdserve <command> --help` says what the command does: its defaults and the environment it reads.

Every flag with a default shows it, and every environment variable a command's package reads
(``os.environ[...]``, ``environ.get(...)``) is named in its help. (`pdserve proxy --help` is
generated from its settings and checked with them.)
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from pdserve.cli import SUBCOMMANDS

PACKAGE = Path(__file__).resolve().parents[2] / "pdserve"
#: command -> the package whose environment reads it documents
COMMANDS = {"operator": "operator", "sim": "sim", "up": "local", "render": "deployment"}
#: A read of the process environment (an assignment, for a child, is not a setting).
ENV_READ = re.compile(r"""\bos\.environ(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]+)["'](?!\]\s*=[^=])""")
#: Not read as settings: set for children, or the stand-in's own translation of vLLM's flags.
NOT_SETTINGS = {"PYTHONUNBUFFERED"}


def _parser(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(SUBCOMMANDS[command][0])
    parser = argparse.ArgumentParser(
        prog=f"pdserve {command}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.configure(parser)
    return parser


def _env_read(package: str) -> set[str]:
    names: set[str] = set()
    for path in (PACKAGE / package).rglob("*.py"):
        if path.name == "vllm_cli.py":  # the `vllm` stand-in: vLLM's own flags and variables
            continue
        names |= set(ENV_READ.findall(path.read_text(encoding="utf-8")))
    return names - NOT_SETTINGS


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_default_is_shown(command: str) -> None:
    missing = []
    for action in _parser(command)._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        unset = action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS)
        if unset and not isinstance(action, argparse.BooleanOptionalAction):
            continue
        if "default" not in (action.help or ""):
            missing.append("/".join(action.option_strings))
    assert not missing, f"pdserve {command} --help shows no default for {missing}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_environment_variable_read_is_in_the_help(command: str) -> None:
    text = _parser(command).format_help()
    missing = sorted(name for name in _env_read(COMMANDS[command]) if name not in text)
    assert not missing, f"pdserve {command} --help does not name {missing}"


def test_the_scan_finds_what_the_commands_read() -> None:
    assert {"KUBECONFIG", "KUBERNETES_SERVICE_HOST"} <= _env_read("operator")
    assert {"VLLM_API_KEY", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"} <= _env_read("sim")


def test_the_operator_names_the_downward_api_variables_it_reads() -> None:
    """leader.py reads them through a mapping (testable), which the scan does not follow."""
    text = _parser("operator").format_help()
    assert "POD_NAME " in text and "POD_NAMESPACE " in text


def test_up_help_says_vllm_runs_without_gpus_too() -> None:
    (engine,) = [a for a in _parser("up")._actions if "--engine" in a.option_strings]
    assert (
        "GPUs" in (engine.help or "") and "CPU" in (engine.help or "") and "--device" in (engine.help or "")
    )
