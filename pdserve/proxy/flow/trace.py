"""What one request carries through its attempts, for its one log line and its metrics.

Apart from the dispatcher and the legs so that the relay (pdserve.proxy.flow.relay), which the
legs hand a stream to, reads it without importing the legs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.proxy.flow.attempts import Handoff
from pdserve.tracing.context import trace_id_of

if TYPE_CHECKING:  # loaded only when the router traces
    from pdserve.proxy.flow.spans import RequestSpans


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
    decode_sent: float | None = None  # when the decode leg that answers was sent
    closed: bool = False
    engine_base: str = ""  # the X-Request-Id stem of the legs: the client's id, made unique
    claimed: bool = False  # the request id is the client's, claimed until the request ends
    prefill_legs: int = 0
    decode_legs: int = 0
    handoff: Handoff | None = None  # the last prefill's, while a decode retry may reuse it
    part_of: Trace | None = None  # a part of a fanned-out request: closed with the request
    parts: list[Trace] = field(default_factory=list)
    outcome: str | None = None  # a part's, once closed
    part: int | None = None  # its index among the request's parts
    # Trace context: the client's (passed through to the engines when the router does not
    # trace), and the request's spans when it does (pdserve.proxy.flow.spans).
    traceparent: str | None = None
    tracestate: str | None = None
    spans: RequestSpans | None = None
    retry_reason: str | None = None  # why the current attempt is a retry ("prefill connect_error")
    kv_span: Any = None  # the open kv_handoff span, until the decode's first byte
    stream_span: Any = None  # the decode leg's span while the relay streams its answer


def logged_trace_id(spans: RequestSpans | None, traceparent: str | None) -> str | None:
    """The trace id a request's log lines name: its trace's when the router traced it, else the
    client's (a context passed through, or one the router's sampler left out)."""
    if spans is not None and spans.trace_id is not None:
        return spans.trace_id
    return trace_id_of(traceparent)
