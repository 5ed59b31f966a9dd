"""What the HTTP layer sends back for a generation request: a buffered body or a stream."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdserve.proxy.engine import codec
from pdserve.wire.openai import error_body

JSON = "application/json"


class ReplyStream(Protocol):
    """Chunks relayed as they come; ``aclose`` ends the stream early (closes the upstreams).

    ``complete`` turns true once the chunks returned so far are the whole answer (its
    ``[DONE]`` event): the HTTP layer then ends the response with that chunk, in one write,
    instead of waiting for the engine's end of body, and says so with ``delivered`` once it
    is sent (``aclose`` then finishes the stream as a success).

    ``push_to`` offers a writer that takes chunks as they arrive, outside the iteration (see
    pdserve.proxy.serving.generation.PUSH_BODY); a stream may ignore it.
    """

    @property
    def complete(self) -> bool: ...

    def delivered(self) -> None: ...

    def push_to(self, push: Callable[[bytes], bool]) -> None: ...

    def __aiter__(self) -> ReplyStream: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None: ...


@dataclass
class Reply:
    status: int
    body: bytes | ReplyStream
    content_type: str = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()
    reason: str | None = None  # the router's own error: sent as X-PDServe-Error


def error_reply(
    status: int, message: str, reason: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> Reply:
    """The router's own error: vLLM's body, pdserve's reason in the X-PDServe-Error header."""
    return Reply(status, codec.dumps(error_body(status, message)), headers=headers, reason=reason)
