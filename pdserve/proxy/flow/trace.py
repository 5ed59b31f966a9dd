"""What one request carries through its attempts, for its one log line and its metrics.

Apart from the dispatcher and the legs so that the relay (pdserve.proxy.flow.relay), which the
legs hand a stream to, reads it without importing the legs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.proxy.flow.attempts import Handoff


@dataclass
class Trace:
    """Everything the one log line and the request metrics of a request (or of a part) need."""

    request_id: str
    endpoint: str
    stream: bool
    started: float = field(default_factory=time.monotonic)
    attempts: int = 0
    prefill: str = "-"
    decode: str = "-"
    first_byte: float | None = None
    closed: bool = False
    engine_base: str = ""  # the X-Request-Id stem of the legs: the client's id, made unique
    claimed: bool = False  # the request id is the client's, claimed until the request ends
    prefill_legs: int = 0
    decode_legs: int = 0
    handoff: Handoff | None = None  # the last prefill's, while a decode retry may reuse it
    part_of: Trace | None = None  # a part of a fanned-out request: closed with the request
    parts: list[Trace] = field(default_factory=list)
    outcome: str | None = None  # a part's, once closed
