"""What an OTLP traces endpoint URL means, and how a vLLM engine is told the same. Pure.

pdserve's processes read the protocol from the URL's scheme: ``http(s)://HOST:PORT/v1/traces``
is OTLP over HTTP (protobuf; a URL without a path gets ``/v1/traces``, the collector's default),
``grpc://HOST:PORT`` OTLP over gRPC without TLS and ``grpcs://HOST:PORT`` with TLS.

vLLM 0.32 reads it differently (``vllm/tracing/otel.py``): its ``--otlp-traces-endpoint`` is
handed to the exporter that ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names, gRPC unless that says
``http/protobuf``, and its gRPC exporter is always insecure unless the URL's scheme is
``https``. :func:`vllm_settings` turns one pdserve URL into vLLM's flag value and variable, so
the router and the engines of a deployment send to the same place the same way; the simulator
reads the flag as vLLM does (:func:`vllm_endpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"
#: The path an OTLP/HTTP receiver takes traces on.
TRACES_PATH = "/v1/traces"
#: vLLM's (and the SDK's) variable naming the exporter's protocol.
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_SCHEMES = {"http": HTTP_PROTOBUF, "https": HTTP_PROTOBUF, "grpc": GRPC, "grpcs": GRPC}


class EndpointError(ValueError):
    """An endpoint URL that names no OTLP protocol pdserve can send to."""


@dataclass(frozen=True)
class OtlpEndpoint:
    """Where spans go: the exporter's protocol, the URL as that exporter takes it, and whether
    the connection is plain text (gRPC only; an HTTP URL says it by its scheme)."""

    protocol: str  # HTTP_PROTOBUF | GRPC
    url: str
    insecure: bool = True


def parse_endpoint(text: str) -> OtlpEndpoint:
    """pdserve's reading of an ``--otlp-traces-endpoint`` (module doc); EndpointError if unusable."""
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    protocol = _SCHEMES.get(scheme)
    if protocol is None or not parts.hostname or any(c.isspace() for c in text):
        raise EndpointError(
            f"expected http(s)://HOST:PORT/v1/traces (OTLP over HTTP) or grpc://HOST:PORT (OTLP over "
            f"gRPC; grpcs:// with TLS), got {text!r}"
        )
    try:
        port = parts.port
    except ValueError:
        raise EndpointError(f"{text!r}: the port is not a number from 1 to 65535") from None
    if protocol == GRPC:
        if parts.path not in ("", "/") or parts.query:
            raise EndpointError(f"{text!r}: an OTLP/gRPC endpoint is HOST:PORT only, without a path")
        if port is None:
            raise EndpointError(f"{text!r}: give the collector's gRPC port, e.g. grpc://HOST:4317")
        return OtlpEndpoint(GRPC, f"{scheme}://{parts.netloc}", insecure=scheme == "grpc")
    path = parts.path if parts.path not in ("", "/") else TRACES_PATH
    query = f"?{parts.query}" if parts.query else ""
    return OtlpEndpoint(HTTP_PROTOBUF, f"{scheme}://{parts.netloc}{path}{query}", insecure=scheme == "http")


def vllm_settings(endpoint: OtlpEndpoint) -> tuple[str, dict[str, str]]:
    """vLLM's ``--otlp-traces-endpoint`` value and the variables that make vLLM 0.32 send to
    ``endpoint`` as pdserve would (module doc)."""
    if endpoint.protocol == HTTP_PROTOBUF:
        return endpoint.url, {PROTOCOL_ENV: HTTP_PROTOBUF}
    netloc = urlsplit(endpoint.url).netloc
    # vLLM's gRPC exporter is insecure unless the URL says https.
    return ("http" if endpoint.insecure else "https") + f"://{netloc}", {PROTOCOL_ENV: GRPC}


def vllm_endpoint(text: str, protocol: str | None) -> OtlpEndpoint:
    """vLLM's reading of its flag: ``protocol`` (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, gRPC when
    unset) picks the exporter, which takes the URL as given."""
    chosen = (protocol or GRPC).strip()
    if chosen == HTTP_PROTOBUF:
        return OtlpEndpoint(HTTP_PROTOBUF, text)
    if chosen != GRPC:
        raise EndpointError(f"Unsupported OTLP protocol '{chosen}' is configured")  # vLLM's words
    return OtlpEndpoint(GRPC, text, insecure=urlsplit(text).scheme.lower() != "https")
