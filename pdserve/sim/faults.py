"""Fault injection for the simulator: specs, their parsing, and the choice of a fault per request.

Why: the proxy's guard rails (handoff validation, deadlines, retries, ejection) can only be
tested against a backend that misbehaves on demand, the way real vLLM does.

Syntax of one spec (``--fault`` and ``POST /sim/faults``)::

    KIND[:ARG][@RATE]

``RATE`` is the probability in [0, 1] that the fault fires on a request it applies to (default
1). Kinds without an argument also accept ``KIND:RATE`` (``http-500:0.5``). Only
``slow-first-byte`` and ``slow-end`` take an argument, a delay in milliseconds
(``slow-first-byte:2000@0.5``). ``busy`` (503) and ``busy-429`` (429) answer as a saturated
engine does, with ``Retry-After``: a router must try another slot, not eject this one.
``slow-end`` is not a misbehaviour but real vLLM's timing: its
stream ends (the last chunk of the body) in a write of its own, some time after ``[DONE]``.
Everything here is pure; the server applies the chosen fault.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

T = TypeVar("T")


class FaultKind(StrEnum):
    MALFORMED_KV_PARAMS = "malformed-kv-params"
    HTTP_500 = "http-500"
    HANG = "hang"
    SLOW_FIRST_BYTE = "slow-first-byte"
    DROP_MID_STREAM = "drop-mid-stream"
    RESET = "reset"
    SLOW_END = "slow-end"
    BUSY = "busy"
    BUSY_429 = "busy-429"


#: Kinds that answer as a saturated engine, and their status.
BUSY_STATUS = {FaultKind.BUSY: 503, FaultKind.BUSY_429: 429}

#: Kinds whose argument is a delay in milliseconds.
DELAYED = (FaultKind.SLOW_FIRST_BYTE, FaultKind.SLOW_END)


#: The legs a generation request can be: a P/D prefill, a P/D decode, or an ordinary request.
LEGS = ("prefill", "decode", "plain")


class FaultSpecError(ValueError):
    """A fault spec that cannot be applied; the message says what is wrong and what is expected."""


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rate: float = 1.0
    delay_ms: int | None = None  # slow-first-byte and slow-end only
    legs: frozenset[str] | None = None  # None: every leg
    ranks: frozenset[int] | None = None  # None: every rank

    def applies_to(self, leg: str, rank: int) -> bool:
        # Only a prefill answer carries kv_transfer_params to malform.
        if self.kind is FaultKind.MALFORMED_KV_PARAMS and leg != "prefill":
            return False
        if self.legs is not None and leg not in self.legs:
            return False
        return self.ranks is None or rank in self.ranks

    def spec(self) -> str:
        arg = f":{self.delay_ms}" if self.delay_ms is not None else ""
        return f"{self.kind}{arg}@{self.rate:g}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": str(self.kind), "rate": self.rate, "spec": self.spec()}
        if self.delay_ms is not None:
            out["ms"] = self.delay_ms
        if self.legs is not None:
            out["roles"] = sorted(self.legs)
        if self.ranks is not None:
            out["ranks"] = sorted(self.ranks)
        return out


_KINDS = ", ".join(k.value for k in FaultKind)


def parse_fault(spec: str) -> Fault:
    """Parse ``KIND[:ARG][@RATE]``; raise FaultSpecError naming the problem."""
    text = spec.strip()
    rate_text: str | None = None
    if "@" in text:
        text, rate_text = text.split("@", 1)
    arg_text: str | None = None
    if ":" in text:
        text, arg_text = text.split(":", 1)
    kind = _kind(text, spec)
    delay_ms: int | None = None
    if kind in DELAYED:
        if arg_text is None:
            raise FaultSpecError(f"fault {spec!r}: {kind} needs a delay in milliseconds, e.g. {kind}:2000")
        delay_ms = _delay(arg_text, spec)
    elif arg_text is not None:
        if rate_text is not None:
            raise FaultSpecError(f"fault {spec!r}: {kind} takes no argument (use {kind}@RATE)")
        rate_text = arg_text
    rate = 1.0 if rate_text is None else _rate(rate_text, spec)
    return Fault(kind, rate, delay_ms)


def parse_faults(specs: Sequence[str]) -> tuple[Fault, ...]:
    return tuple(parse_fault(s) for s in specs)


def faults_from_json(body: object) -> tuple[Fault, ...]:
    """The body of ``POST /sim/faults``: ``{"faults": [...]}``, each a spec string or an object
    ``{"kind", "rate"?, "ms"?, "roles"?, "ranks"?}``. An empty list heals the instance."""
    if not isinstance(body, Mapping) or "faults" not in body:
        raise FaultSpecError('body must be a JSON object {"faults": [...]}')
    items = body["faults"]
    if not isinstance(items, list):
        raise FaultSpecError("faults: expected a list")
    return tuple(_fault_item(item, f"faults[{i}]") for i, item in enumerate(items))


def choose_fault(faults: Sequence[Fault], rng: random.Random, leg: str, rank: int) -> Fault | None:
    """The first applicable fault whose dice roll fires (one roll per applicable fault, in order),
    so a seeded RNG gives the same sequence of faults for the same sequence of requests."""
    for fault in faults:
        if fault.applies_to(leg, rank) and rng.random() < fault.rate:
            return fault
    return None


def drop_after_chunks(num_tokens: int) -> int:
    """drop-mid-stream sends this many token chunks, then aborts: at least one, so the client
    has started streaming, and never the whole answer."""
    return max(1, num_tokens // 2)


# --- helpers ------------------------------------------------------------------------------------


def _kind(text: str, spec: str) -> FaultKind:
    try:
        return FaultKind(text.strip())
    except ValueError:
        raise FaultSpecError(
            f"fault {spec!r}: unknown kind {text.strip()!r}; expected one of {_KINDS}"
        ) from None


def _rate(text: str, spec: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise FaultSpecError(f"fault {spec!r}: rate {text!r} is not a number in [0, 1]") from None
    if not 0.0 <= rate <= 1.0:
        raise FaultSpecError(f"fault {spec!r}: rate {text!r} is outside [0, 1]")
    return rate


def _delay(text: str, spec: str) -> int:
    if not text.strip().isdigit():
        raise FaultSpecError(f"fault {spec!r}: delay {text!r} is not a whole number of milliseconds")
    return int(text)


def _fault_item(item: object, path: str) -> Fault:
    if isinstance(item, str):
        try:
            return parse_fault(item)
        except FaultSpecError as exc:
            raise FaultSpecError(f"{path}: {exc}") from None
    if not isinstance(item, Mapping):
        raise FaultSpecError(f"{path}: expected a spec string or an object with 'kind'")
    kind_value = item.get("kind")
    if not isinstance(kind_value, str):
        raise FaultSpecError(f"{path}.kind: expected one of {_KINDS}")
    kind = _kind(kind_value, kind_value)
    rate_value = item.get("rate", 1.0)
    if isinstance(rate_value, bool) or not isinstance(rate_value, int | float) or not 0 <= rate_value <= 1:
        raise FaultSpecError(f"{path}.rate: expected a number in [0, 1], got {rate_value!r}")
    delay_ms: int | None = None
    ms_value = item.get("ms")
    if kind in DELAYED:
        if isinstance(ms_value, bool) or not isinstance(ms_value, int) or ms_value < 0:
            raise FaultSpecError(f"{path}.ms: {kind} needs a delay in milliseconds (integer >= 0)")
        delay_ms = ms_value
    elif ms_value is not None:
        raise FaultSpecError(f"{path}.ms: only {', '.join(DELAYED)} take a delay")
    legs = _filter(item.get("roles"), f"{path}.roles", str)
    if legs is not None and not legs <= set(LEGS):
        raise FaultSpecError(f"{path}.roles: expected a list of {', '.join(LEGS)}")
    ranks = _filter(item.get("ranks"), f"{path}.ranks", int)
    return Fault(kind, float(rate_value), delay_ms, legs, ranks)


def _filter(value: object, path: str, item_type: type[T]) -> frozenset[T] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, item_type) and not isinstance(v, bool) for v in value
    ):
        raise FaultSpecError(f"{path}: expected a list of {item_type.__name__}")
    return frozenset(value)
