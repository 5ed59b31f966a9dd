"""The Dockerfile is hadolint clean, installs the version the source declares, and runs as non-root."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import __version__

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_clean() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (it is a dev dependency: make install)")
    result = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pinned_version_matches_the_package() -> None:
    match = re.search(r"^ARG VERSION=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match is not None
    assert match.group(1) == __version__


def test_final_stage_is_non_root_and_runs_pdserve() -> None:
    text = DOCKERFILE.read_text()
    final_stage = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER [1-9][0-9]*$", final_stage, re.MULTILINE), (
        "final stage must set a numeric non-root USER"
    )
    assert 'ENTRYPOINT ["pdserve"]' in final_stage
    # No compiler toolchain or wheel files in the final image: install from the build stage by bind mount.
    assert "--mount=type=bind,from=build" in final_stage
    assert "apt-get" not in final_stage


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines
    assert {"!pyproject.toml", "!README.md", "!pdserve/"} <= set(lines)
