"""A performance profile: what one engine step of a given GPU (or CPU) and model costs, and what
moving KV between a prefill and a decode costs.

Why a profile and not --ttft-ms: a real engine's latencies follow from its load. A step that
prefills P tokens and decodes D sequences over C tokens of KV takes
``step_ms + P * prefill_token_ms + D * decode_seq_ms + C / 1000 * context_ktoken_ms``, so TTFT
grows with the queue and the prompt, and inter-token latency with the batch. KV moved by a P/D
connector takes ``kv_transfer.latency_ms + tokens * bytes_per_token / bandwidth``.

A request reaches the engine's queue ``request.frontend_ms`` after it reached the server (vLLM's
API server parses, tokenizes and hands it to the engine core over IPC; its TTFT counts that).

A profile is a YAML (or JSON) file; the packaged ones (``pdserve/sim/engine/profiles/``) are
named by their file name without the suffix. Every figure is required and none may be negative:
a profile that lacks one is refused with the field named (:class:`ProfileError`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PACKAGED = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class StepCost:
    step_ms: float
    prefill_token_ms: float
    decode_seq_ms: float
    context_ktoken_ms: float


@dataclass(frozen=True)
class RequestCost:
    frontend_ms: float


@dataclass(frozen=True)
class TransferCost:
    bytes_per_token: float
    bandwidth_gb_per_s: float
    latency_ms: float


@dataclass(frozen=True)
class EngineDefaults:
    """vLLM's defaults on this hardware; the flags of the same names override them."""

    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    source: str
    step: StepCost
    request: RequestCost
    kv_transfer: TransferCost
    engine: EngineDefaults

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        s = self.step
        ms = (
            s.step_ms
            + prefill_tokens * s.prefill_token_ms
            + decode_seqs * s.decode_seq_ms
            + context_tokens / 1000 * s.context_ktoken_ms
        )
        return ms / 1000

    def transfer_seconds(self, tokens: int) -> float:
        t = self.kv_transfer
        if tokens <= 0:
            return 0.0
        seconds = tokens * t.bytes_per_token / (t.bandwidth_gb_per_s * 1e9) if t.bandwidth_gb_per_s else 0.0
        return t.latency_ms / 1000 + seconds


def packaged_names() -> list[str]:
    return sorted(p.stem for p in PACKAGED.glob("*.yaml"))


def resolve(spec: str) -> Path:
    """``spec`` as a file, else as a packaged profile's name."""
    path = Path(spec)
    if path.is_file():
        return path
    packaged = PACKAGED / f"{spec}.yaml"
    if packaged.is_file():
        return packaged
    raise ProfileError(
        f"profile {spec!r}: no such file, and not a packaged profile ({', '.join(packaged_names())})"
    )


def load(spec: str) -> Profile:
    path = resolve(spec)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"profile {path}: cannot read it: {exc}") from exc
    return parse(data, str(path))


def parse(data: object, where: str = "profile") -> Profile:
    """A profile from its parsed document; ProfileError names the first bad field."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where}: expected a mapping at the top level")

    def section(name: str) -> Mapping[str, Any]:
        value = data.get(name)
        if not isinstance(value, Mapping):
            raise ProfileError(f"{where}: {name} is missing (a mapping of figures)")
        return value

    def number(sec: str, field: str) -> float:
        value = section(sec).get(field)
        if value is None:
            raise ProfileError(f"{where}: {sec}.{field} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ProfileError(f"{where}: {sec}.{field} must be a number, got {value!r}")
        if value < 0:
            raise ProfileError(f"{where}: {sec}.{field} must not be negative, got {value}")
        return float(value)

    def count(sec: str, field: str) -> int:
        value = number(sec, field)
        if value < 1 or value != int(value):
            raise ProfileError(f"{where}: {sec}.{field} must be an integer >= 1, got {value:g}")
        return int(value)

    def text(field: str) -> str:
        value = data.get(field)
        if not isinstance(value, str) or not value.strip():
            raise ProfileError(f"{where}: {field} is missing (say what the figures come from)")
        return value.strip()

    return Profile(
        name=str(data.get("name") or Path(where).stem),
        description=text("description"),
        source=text("source"),
        step=StepCost(
            step_ms=number("step", "step_ms"),
            prefill_token_ms=number("step", "prefill_token_ms"),
            decode_seq_ms=number("step", "decode_seq_ms"),
            context_ktoken_ms=number("step", "context_ktoken_ms"),
        ),
        request=RequestCost(frontend_ms=number("request", "frontend_ms")),
        kv_transfer=TransferCost(
            bytes_per_token=number("kv_transfer", "bytes_per_token"),
            bandwidth_gb_per_s=number("kv_transfer", "bandwidth_gb_per_s"),
            latency_ms=number("kv_transfer", "latency_ms"),
        ),
        engine=EngineDefaults(
            block_size=count("engine", "block_size"),
            num_gpu_blocks=count("engine", "num_gpu_blocks"),
            max_num_seqs=count("engine", "max_num_seqs"),
            max_num_batched_tokens=count("engine", "max_num_batched_tokens"),
        ),
    )
