"""W3C Trace Context (``traceparent``) as text: what the router forwards, logs and writes. Pure.

The router passes a client's ``traceparent`` and ``tracestate`` through to the engines even when
it does not trace itself (so vLLM's spans still join the client's trace), and logs the trace id;
neither needs the SDK.
"""

from __future__ import annotations

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


def traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C ``traceparent`` header of a span context (version 00)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def trace_id_of(header: str | None) -> str | None:
    """The trace id (32 hex digits) a ``traceparent`` header carries, if it is well formed."""
    if header is None or len(header) < 55 or header[2] != "-" or header[35] != "-":
        return None
    trace_id = header[3:35]
    try:
        if int(trace_id, 16) == 0:
            return None
    except ValueError:
        return None
    return trace_id.lower()
