"""The docs say what the code does: generated reference, quoted errors, links (metric names:
test_metric_names.py, against what the components export)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.deployment import docgen

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def _source_text() -> str:
    files = [
        *REPO.joinpath("pdserve").rglob("*.py"),
        *REPO.joinpath("crds").glob("*.yaml"),
        *REPO.joinpath("charts", "pdserve", "templates").iterdir(),
    ]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def test_reference_is_generated_from_the_current_crd() -> None:
    assert (DOCS / "reference.md").read_text(encoding="utf-8") == docgen.generate(), (
        "docs/reference.md is stale: run hack/gen-reference"
    )


def test_reference_lists_every_spec_field_of_the_crd() -> None:
    import yaml

    crd = yaml.safe_load(docgen.CRD_FILE.read_text(encoding="utf-8"))
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    page = (DOCS / "reference.md").read_text(encoding="utf-8")
    for field in docgen.walk(spec_schema, "spec"):
        assert f"| `{field.path}` |" in page, field.path


def test_docgen_check_mode_detects_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert docgen.main(["--output", str(stale), "--check"]) == 1
    assert docgen.main(["--output", str(stale)]) == 0
    assert docgen.main(["--output", str(stale), "--check"]) == 0


def test_readme_keeps_the_commands_ci_and_users_rely_on() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for command in ("make test", "make lint", "make demo", "helm install", "pdserve up"):
        assert command in readme, command
    for verb in ("kubectl get pdd", "kubectl describe pdd", "kubectl scale pdd", "kubectl edit pdd"):
        assert verb in readme, verb
    assert readme.index("make demo") < readme.index("helm install"), "the quickstart comes first"


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md"])
def test_architecture_diagram_is_mermaid(page: str) -> None:
    assert "```mermaid\nflowchart" in (REPO / page).read_text(encoding="utf-8")


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"`[^`\n]*`", "", page.read_text(encoding="utf-8"))  # code spans hold no links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: broken link {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: no heading #{anchor} in {path}"


def test_troubleshooting_quotes_messages_pdserve_really_prints() -> None:
    source = _source_text()
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    quoted = re.findall(r"^### `([^`]+)`(.*)$", page, re.MULTILINE)
    others = ("(kubectl)", "(helm)", "(vLLM's log")  # printed by other programs
    ours = [message for message, rest in quoted if not any(o in rest for o in others)]
    assert len(ours) >= 10
    for message in ours:
        assert message in source, f"troubleshooting.md quotes {message!r}, which pdserve no longer prints"


def test_readme_cpu_manifest_is_the_example_file() -> None:
    """The README's CPU manifest is examples/cpu/nixl-1p-1d-dp2.yaml (the one make e2e-vllm runs)."""
    from pdserve.deployment.spec.parse import load_manifest, load_manifest_file

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n# examples/cpu/nixl-1p-1d-dp2.yaml\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "README shows the CPU manifest"
    example = REPO / "examples" / "cpu" / "nixl-1p-1d-dp2.yaml"
    assert load_manifest(block.group(1)) == load_manifest_file(example)
