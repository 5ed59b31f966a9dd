"""The one effect the readers of the routers' and engines' answers need: an HTTP GET, given by
the shell (the operator's and ``pdserve up``'s own clients), so the reading is written once and
stays free of I/O (plan/drain.py's :func:`read_served`, plan/signals.py's :func:`read_signals`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable


class GetError(Exception):
    """A GET that got no answer (refused, timed out, broken); its text says what happened."""


#: (status, body) of a URL, or GetError.
Get = Callable[[str], Awaitable[tuple[int, str]]]


async def get_json(get: Get, url: str) -> tuple[object, str | None]:
    """The JSON a URL answers with 200, or (None, what went wrong)."""
    try:
        status, body = await get(url)
        if status != 200:
            return None, f"{url} answered {status}"
        return json.loads(body), None
    except (GetError, ValueError) as exc:
        return None, f"{url} unreachable: {exc}"
