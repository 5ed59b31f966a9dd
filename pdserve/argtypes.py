"""The value types of the commands' numeric flags (argparse ``type=``), so every command words a
bad value the same way: ``argument --rate: expected a number > 0, got 0``.

Depends on nothing else in pdserve.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)


def _checked(text: str, convert: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    value = convert(text)  # a ValueError becomes argparse's "invalid <type> value"
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: v > 0, "a number > 0")


def non_negative_float(text: str) -> float:
    return _checked(text, float, lambda v: not v < 0, "a number >= 0")


def port(text: str) -> int:
    return _checked(text, int, lambda v: 1 <= v <= 65535, "a port number 1-65535")
