"""Workloads to replay: Mooncake JSONL traces, and a Poisson generator of the same shape.

A Mooncake line (the FAST'25 trace release) is one request: ``timestamp`` (ms from the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, the prompt's prefix blocks of
:data:`BLOCK_TOKENS` tokens; equal ids mean a shareable prefix (an id stands for its block and
every block before it). Other keys are ignored. A malformed line is refused with its line number
and field, before anything is sent.

The Poisson generator produces the same records, so everything downstream (prompts, schedule,
the offline cache model) is one code path.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: Tokens per hash id in Mooncake traces.
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        ts: float | int = int(self.timestamp_ms) if self.timestamp_ms.is_integer() else self.timestamp_ms
        return json.dumps(
            {
                "timestamp": ts,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


class TraceError(ValueError):
    """A trace that must not be replayed; names the line (1-based) and the field."""

    def __init__(self, source: str, line: int, field: str, reason: str) -> None:
        self.source, self.line, self.field, self.reason = source, line, field, reason
        where = f"{source}:{line}" + (f": {field}" if field else "")
        super().__init__(f"{where}: {reason}")


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(doc: dict[str, object], key: str, minimum: int) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _FieldProblem(
                key, "missing" if key not in doc else f"expected an integer, got {_show(value)}"
            )
    if value < minimum:
        raise _FieldProblem(key, f"expected an integer >= {minimum}, got {value}")
    return value


class _FieldProblem(Exception):
    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason


def parse_line(text: str) -> TraceRequest:
    """One Mooncake record; :class:`_FieldProblem` names what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _FieldProblem("", f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise _FieldProblem("", f"expected a JSON object, got {_show(doc)}")
    ts = doc.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise _FieldProblem(
            "timestamp", "missing" if "timestamp" not in doc else f"expected a number (ms), got {_show(ts)}"
        )
    if ts < 0:
        raise _FieldProblem("timestamp", f"expected a number >= 0 (ms), got {ts}")
    input_length = _count(doc, "input_length", 1)
    output_length = _count(doc, "output_length", 1)
    ids = doc.get("hash_ids", [])
    if not isinstance(ids, list):
        raise _FieldProblem("hash_ids", f"expected a list of integers, got {_show(ids)}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise _FieldProblem(f"hash_ids[{i}]", f"expected an integer >= 0, got {_show(h)}")
    if len(ids) > math.ceil(input_length / BLOCK_TOKENS):
        raise _FieldProblem(
            "hash_ids",
            f"{len(ids)} blocks of {BLOCK_TOKENS} tokens cover more than input_length {input_length}",
        )
    return TraceRequest(float(ts), input_length, output_length, tuple(ids))


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Every record of a JSONL text (blank lines skipped); :class:`TraceError` at the first bad one."""
    out: list[TraceRequest] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            out.append(parse_line(text))
        except _FieldProblem as exc:
            raise TraceError(source, number, exc.field, exc.reason) from None
    if not out:
        raise TraceError(source, 0, "", "no requests in the trace")
    return complete_blocks(out)


def complete_blocks(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Give the blocks a record has no hash id for (``hash_ids`` shorter than the prompt) fresh ids
    no other request uses: such blocks are the request's own, never shared."""
    fresh = 1 + max((h for r in requests for h in r.hash_ids), default=-1)
    out = []
    for r in requests:
        missing = math.ceil(r.input_length / BLOCK_TOKENS) - len(r.hash_ids)
        if missing > 0:
            r = TraceRequest(
                r.timestamp_ms, r.input_length, r.output_length, (*r.hash_ids, *range(fresh, fresh + missing))
            )
            fresh += missing
        out.append(r)
    return out


def read_trace(path: Path) -> list[TraceRequest]:
    try:
        with path.open(encoding="utf-8") as f:
            return parse_trace(f, str(path))
    except UnicodeDecodeError as exc:
        raise TraceError(str(path), 0, "", f"not UTF-8 text: {exc.reason}") from None


def write_trace(requests: Iterable[TraceRequest], path: Path) -> None:
    path.write_text("".join(r.to_json() + "\n" for r in requests), encoding="utf-8")


# --- Poisson generator -------------------------------------------------------------------------


@dataclass(frozen=True)
class PoissonSpec:
    """``rate`` requests/s for ``num_requests``; lengths uniform within ``range_ratio`` of the given
    means; the first ``prefix_share`` of each prompt's full blocks from one of ``prefix_groups``
    shared prefixes (a system prompt or document many requests start with), the rest unique."""

    rate: float
    num_requests: int
    input_length: int
    output_length: int
    range_ratio: float = 0.0
    prefix_share: float = 0.0
    prefix_groups: int = 8
    seed: int = 0

    def problems(self) -> list[str]:
        out = []
        if not self.rate > 0:
            out.append(f"--rate must be > 0, got {self.rate}")
        if self.num_requests < 1:
            out.append(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.input_length < 1 or self.output_length < 1:
            out.append("--input-len and --output-len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            out.append(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.prefix_share <= 1:
            out.append(f"--prefix-share must be in [0, 1], got {self.prefix_share}")
        if self.prefix_groups < 1:
            out.append(f"--prefix-groups must be >= 1, got {self.prefix_groups}")
        return out


def poisson_trace(spec: PoissonSpec) -> list[TraceRequest]:
    return list(_poisson(spec))


def _poisson(spec: PoissonSpec) -> Iterator[TraceRequest]:
    rng = random.Random(spec.seed)

    def length(mean: int) -> int:
        low = max(1, math.floor(mean * (1 - spec.range_ratio)))
        high = max(low, math.ceil(mean * (1 + spec.range_ratio)))
        return rng.randint(low, high)

    # Shared prefixes take ids 0 .. groups*max_blocks-1 (group g, block j: g*max_blocks + j);
    # unique blocks are numbered after them.
    max_blocks = math.ceil(math.ceil(spec.input_length * (1 + spec.range_ratio)) / BLOCK_TOKENS)
    next_unique = spec.prefix_groups * max_blocks
    clock_ms = 0.0
    for i in range(spec.num_requests):
        if i:
            clock_ms += rng.expovariate(spec.rate) * 1000
        input_length = length(spec.input_length)
        blocks = math.ceil(input_length / BLOCK_TOKENS)
        shared = min(round(spec.prefix_share * blocks), input_length // BLOCK_TOKENS)
        group = rng.randrange(spec.prefix_groups)
        ids = [group * max_blocks + j for j in range(shared)]
        ids += range(next_unique, next_unique + blocks - shared)
        next_unique += blocks - shared
        yield TraceRequest(round(clock_ms, 3), input_length, length(spec.output_length), tuple(ids))
