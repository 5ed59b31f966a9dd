"""What the HTTP layer sends back for a generation request: a buffered body or a stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.proxy import codec
from pdserve.wire.openai import error_body

JSON = "application/json"


class ReplyStream(Protocol):
    """Chunks relayed as they come; ``aclose`` ends the stream early (closes the upstreams)."""

    def __aiter__(self) -> ReplyStream: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None: ...


@dataclass
class Reply:
    status: int
    body: bytes | ReplyStream
    content_type: str = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


def error_reply(
    status: int, message: str, type_: str, code: str | int, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> Reply:
    return Reply(status, codec.dumps(error_body(message, type_, code)), headers=headers)
