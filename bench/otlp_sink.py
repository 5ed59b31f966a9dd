"""A minimal OTLP/HTTP traces receiver for the proxy benchmark (``python -m bench.otlp_sink``).

It takes ``POST /v1/traces`` (an ExportTraceServiceRequest in protobuf), counts the spans and
answers an empty ExportTraceServiceResponse, as a collector would; ``GET /stats`` says how many
requests and spans came. Not a collector: the benchmark measures what making and exporting
spans costs the router, and the sink runs in a process of its own so its CPU is not the router's.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_lock = threading.Lock()
_stats = {"requests": 0, "spans": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = ExportTraceServiceRequest.FromString(body)
        spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with _lock:
            _stats["requests"] += 1
            _stats["spans"] += spans
        self._answer(200, b"", "application/x-protobuf")

    def do_GET(self) -> None:
        if self.path == "/stats":
            with _lock:
                self._answer(200, json.dumps(_stats).encode(), "application/json")
        else:
            self._answer(200, b"ok", "text/plain")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_sink", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
