"""The OpenTelemetry SDK, loaded only when a process is asked to trace.

Importing this module imports nothing of OpenTelemetry; :func:`start_tracing` does, and fails
with :class:`TracingUnavailable` (naming the extra to install) when the SDK is missing. The
SDK's own ``OTEL_*`` variables still apply: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``
(the resource), ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``/``_TIMEOUT``/``_COMPRESSION``/``_CERTIFICATE``
(the exporter), ``OTEL_BSP_*`` (the batch processor that exports from a thread of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.tracing.endpoint import GRPC, OtlpEndpoint

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import Tracer

#: How to get the SDK, as the error says it.
EXTRA = "pip install 'pdserve[tracing]'"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but the OpenTelemetry SDK or an OTLP exporter is not installed."""


@dataclass
class Tracing:
    """A started tracer and the provider whose batch processor exports its spans."""

    tracer: Tracer
    provider: TracerProvider

    def shutdown(self) -> None:
        """Export what is still buffered (up to the exporter's timeout), then stop the thread."""
        self.provider.shutdown()


def check_available(flag: str = "--otlp-traces-endpoint") -> None:
    """TracingUnavailable, naming the extra to install, unless the SDK and both exporters import."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"{flag} needs the OpenTelemetry SDK and its OTLP exporters, which are not installed "
            f"({exc}); install the tracing extra: {EXTRA}"
        ) from None


def start_tracing(
    name: str,
    endpoint: OtlpEndpoint,
    service: str | None = None,
    sampling_ratio: float | None = None,
    attributes: Mapping[str, str] | None = None,
    flag: str = "--otlp-traces-endpoint",
    id_generator: IdGenerator | None = None,
) -> Tracing:
    """A tracer named ``name`` whose spans go to ``endpoint`` in batches.

    ``service``: the resource's ``service.name`` unless ``OTEL_SERVICE_NAME`` or
    ``OTEL_RESOURCE_ATTRIBUTES`` give one; ``sampling_ratio``: head sampling of new traces
    (a request that brings a sampled or unsampled parent follows it), None for the SDK's default
    (``OTEL_TRACES_SAMPLER``, else every trace); ``flag`` names the setting in the error.
    """
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider, sampling
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            f"{flag} needs the OpenTelemetry SDK, which is not installed ({exc}); install the tracing "
            f"extra: {EXTRA}"
        ) from None
    exporter = span_exporter(endpoint, flag)
    resource = Resource.create(dict(attributes or {}))
    if service and str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    options: dict[str, Any] = {"resource": resource}
    if id_generator is not None:
        options["id_generator"] = id_generator
    if sampling_ratio is not None:
        options["sampler"] = sampling.ParentBased(sampling.TraceIdRatioBased(sampling_ratio))
    provider = TracerProvider(**options)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider.get_tracer(name), provider)


def span_exporter(endpoint: OtlpEndpoint, flag: str = "--otlp-traces-endpoint") -> SpanExporter:
    """The OTLP exporter of ``endpoint``'s protocol."""
    try:
        if endpoint.protocol == GRPC:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter(endpoint=endpoint.url, insecure=endpoint.insecure)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint.url)
    except ImportError as exc:
        raise TracingUnavailable(
            f"{flag} {endpoint.url} needs the OTLP {endpoint.protocol} exporter, which is not installed "
            f"({exc}); install the tracing extra: {EXTRA}"
        ) from None
