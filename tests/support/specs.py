"""Small builders shared by the unit tests of the deployment package: a PDDeployment from a few
spec fields, and the golden-file check (``PDSERVE_UPDATE_GOLDEN=1`` rewrites instead)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pdserve.deployment.spec.pddeployment import PDDeployment, parse_pddeployment

IMAGE = "vllm/vllm-openai:v0.12.0"


def manifest(name: str = "r1", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "image": IMAGE}
    body.update(spec)
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": body,
    }


def pdd_of(**spec: Any) -> PDDeployment:
    """A parsed PDDeployment ``r1``: model ``m``, a vLLM image, and ``spec`` on top."""
    return parse_pddeployment(manifest(**spec))


def check_golden(golden: Path, text: str) -> None:
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSERVE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} differs; review and regenerate with PDSERVE_UPDATE_GOLDEN=1"
    )
