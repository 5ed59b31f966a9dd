"""What the e2e modules share: versions, cache paths, progress lines, HTTP and metrics helpers."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.wire import vllm
from tests.support.pdstack import http

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

#: What real-vllm-cpu.md found to work on a 2-core x86 machine without GPUs.
VLLM_VERSION = vllm.VERSION
TORCH_VERSION = "2.13.0"
NIXL_VERSION = "1.5.1"
#: The Mooncake transfer engine without CUDA (TCP; its native library still needs libibverbs.so.1).
MOONCAKE_VERSION = "0.3.13.post1"
FIXTURES = REPO / "tests" / "fixtures" / f"vllm-{VLLM_VERSION}"
#: The example the e2e runs, as a user would.
MANIFEST = REPO / "examples" / "cpu" / "nixl-1p-1d-dp2.yaml"
#: Its spec.model: a repo id resolved offline from HF_HOME (model.py puts the tiny model there).
MODEL_ID = "pdserve-test/tiny-llama"
#: Its metadata.name: the services of its traces are <name>-router, -prefill, -decode.
MANIFEST_NAME = "tiny"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def venv_dir() -> Path:
    return cache_root() / f"vllm-venv-{VLLM_VERSION}"


def hf_home() -> Path:
    return cache_root() / "hf"


def engine_env() -> dict[str, str]:
    """The environment `pdserve up --engine vllm` runs in: the venv's vllm first on PATH, models
    from the cache only."""
    return {
        **os.environ,
        "PATH": f"{venv_dir() / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HOME": str(hf_home()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


_T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[e2e-vllm {time.monotonic() - _T0:6.1f}s] {text}", flush=True)


class Failed(AssertionError):
    """A check of the e2e failed; the message says which and with what figures."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


# --- HTTP -----------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The SSE data payloads, parsed (``"[DONE]"`` kept as a string)."""
        out: list[Any] = []
        for line in self.body.decode().split("\n"):
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


def request(
    method: str,
    url: str,
    body: object = None,
    headers: Mapping[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 120.0,
) -> Answer:
    start = time.monotonic()
    answer = http(method, url, body, dict(headers or {}), raw, timeout)
    return Answer(answer.status, answer.headers, answer.body, time.monotonic() - start)


def metrics(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``/metrics`` as {sample name: {sorted labels: value}}."""
    text = request("GET", url + "/metrics").body.decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(
    samples: Mapping[str, Mapping[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= set(k))


def python_of_venv() -> str:
    return str(venv_dir() / "bin" / "python")


def fail_exit(exc: BaseException) -> int:
    print(f"\ne2e-vllm: FAILED: {exc}", file=sys.stderr, flush=True)
    return 1
