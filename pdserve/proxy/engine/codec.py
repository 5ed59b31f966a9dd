"""JSON on the hot path: orjson, falling back to the stdlib for what orjson refuses.

orjson parses and writes several times faster than the stdlib, and every request is parsed
once and written twice (the two legs). It refuses the non-JSON constants NaN and Infinity,
which the stdlib (and so vLLM's own server) accepts: those bodies take the stdlib path, so the
proxy accepts what it accepted before. Differences from the stdlib, both outside what vLLM
serves: integers beyond 64 bits are read as floats, and a NaN or Infinity is written as null.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes | str) -> Any:
    """Parse JSON; invalid JSON raises the stdlib's ValueError (its message says where)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: a type orjson cannot write
        return json.dumps(value).encode()
