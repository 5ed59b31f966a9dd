"""vLLM's request span, made by a simulated engine (``--otlp-traces-endpoint``) as vLLM 0.32 makes it.

Loaded only when the simulator traces. What vLLM does, and so the simulator:

* its OpenAI server passes a request's ``traceparent``/``tracestate`` headers to the engine
  (``_get_trace_headers``, vllm/entrypoints/serve/engine/serving.py);
* once the request has finished, the output processor makes one span (``do_tracing``,
  vllm/v1/engine/output_processor.py): ``llm_request``, kind SERVER, from the request's arrival
  to now, the child of those headers' context, with the ``gen_ai.*`` attributes below; a request
  aborted before it finished (a cut connection) has none;
* the tracer is ``vllm.tracing.otel``'s, its resource carries ``vllm.instrumenting_module_name``
  and ``vllm.process_id``, the exporter is the one ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names
  (gRPC by default) and the sampler the SDK's default (vllm/tracing/otel.py). ``service.name``
  comes from ``OTEL_SERVICE_NAME`` (the operator and ``pdserve up`` set it), else the SDK's
  ``unknown_service``, as with vLLM.

``--collect-detailed-traces`` is accepted as vLLM accepts it (it needs an endpoint); vLLM 0.32
adds no span attribute for it either.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.tracing.endpoint import PROTOCOL_ENV, vllm_endpoint
from pdserve.tracing.sdk import Tracing, start_tracing

#: vLLM's tracer and resource (vllm/tracing/otel.py).
SCOPE = "vllm.tracing.otel"
MODULE = "vllm.llm_engine"


@dataclass(frozen=True)
class Finished:
    """A finished request's times (wall clock, seconds) and sizes, as vLLM's stats keep them."""

    arrival: float
    scheduled: float
    first_token: float
    last_token: float
    prompt_tokens: int
    completion_tokens: int


class EngineTracer:
    """Makes the ``llm_request`` span of each finished request."""

    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing
        self._tracer = tracing.tracer
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, endpoint: str) -> EngineTracer:
        """vLLM's reading of ``--otlp-traces-endpoint`` (pdserve.tracing.endpoint.vllm_endpoint)."""
        target = vllm_endpoint(endpoint, os.environ.get(PROTOCOL_ENV))
        attributes = {"vllm.instrumenting_module_name": MODULE, "vllm.process_id": str(os.getpid())}
        return cls(start_tracing(SCOPE, target, attributes=attributes))

    def shutdown(self) -> None:
        self._tracing.shutdown()

    def finished(
        self,
        trace_headers: Mapping[str, str] | None,
        external_id: str,
        times: Finished,
        body: Mapping[str, Any],
    ) -> None:
        """The span of a request that has just finished (vLLM's ``do_tracing``)."""
        context = self._propagator.extract(trace_headers) if trace_headers else None
        attributes: dict[str, Any] = {
            "gen_ai.latency.time_to_first_token": times.first_token - times.arrival,
            "gen_ai.latency.e2e": time.time() - times.arrival,
            "gen_ai.latency.time_in_queue": times.scheduled - times.arrival,
            "gen_ai.usage.prompt_tokens": times.prompt_tokens,
            "gen_ai.usage.completion_tokens": times.completion_tokens,
            "gen_ai.latency.time_in_model_prefill": times.first_token - times.scheduled,
            "gen_ai.latency.time_in_model_decode": times.last_token - times.first_token,
            "gen_ai.latency.time_in_model_inference": times.last_token - times.scheduled,
            "gen_ai.request.id": external_id,
        }
        # vLLM sets these when truthy: the sampling parameters (their defaults when the request
        # leaves them out) and the max_tokens the request gave.
        given = body.get("max_tokens", body.get("max_completion_tokens"))
        for name, value in (
            ("gen_ai.request.top_p", body.get("top_p", 1.0)),
            ("gen_ai.request.max_tokens", given),
            ("gen_ai.request.temperature", body.get("temperature", 1.0)),
            ("gen_ai.request.n", body.get("n", 1)),
        ):
            if isinstance(value, int | float) and not isinstance(value, bool) and value:
                attributes[name] = value
        span = self._tracer.start_span(
            "llm_request", context, SpanKind.SERVER, attributes, start_time=int(times.arrival * 1e9)
        )
        span.end()
