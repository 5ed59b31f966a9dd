"""A real OpenTelemetry Collector for the tracing tests, and the spans it received.

``otelcol`` (function scope) starts the collector that ``hack/otelcol/build`` builds from the
collector's Go modules (the OTLP receiver, gRPC and HTTP, on free loopback ports, and the file
exporter), and stops it after the test. Its file holds one OTLP/JSON export request per line;
:meth:`Collector.spans` reads them back as :class:`ExportedSpan`.

The build takes minutes with an empty Go build cache, so it is a step of its own, cached under
``~/.cache/pdserve/otelcol`` (like the test cluster's): when the collected tests use ``otelcol``,
:func:`pytest_collection_finish` runs it once before the first test, outside any test's timeout,
and shows its progress.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import REPO, free_ports

BUILD = REPO / "hack" / "otelcol" / "build"
#: The OTLP/JSON span kinds (SPAN_KIND_*), by number.
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
#: Environment for processes under test: export in batches every 50 ms instead of every 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@dataclass(frozen=True)
class ExportedSpan:
    """One span as the collector wrote it."""

    service: str
    scope: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    error: bool
    resource: dict[str, Any]
    trace_state: str = ""

    def __repr__(self) -> str:
        return f"<{self.service} {self.name} {self.trace_id[:8]}/{self.span_id[:8]}<-{self.parent_id[:8]}>"


def _value(v: dict[str, Any]) -> Any:
    """An OTLP/JSON AnyValue as Python."""
    if "intValue" in v:
        return int(v["intValue"])
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


def parse_export(line: str) -> list[ExportedSpan]:
    """The spans of one line of the file exporter's output (an OTLP/JSON traces request)."""
    out = []
    for rs in json.loads(line).get("resourceSpans", []):
        resource = _attributes(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            scope = ss.get("scope", {}).get("name", "")
            for s in ss.get("spans", []):
                out.append(
                    ExportedSpan(
                        service=str(resource.get("service.name", "")),
                        scope=scope,
                        name=s["name"],
                        trace_id=s["traceId"],
                        span_id=s["spanId"],
                        parent_id=s.get("parentSpanId", ""),
                        kind=KINDS.get(int(s.get("kind", 0)), "UNSPECIFIED"),
                        start_ns=int(s["startTimeUnixNano"]),
                        end_ns=int(s["endTimeUnixNano"]),
                        attributes=_attributes(s.get("attributes")),
                        events=tuple(e["name"] for e in s.get("events", [])),
                        error=s.get("status", {}).get("code") == 2,
                        resource=resource,
                        trace_state=s.get("traceState", ""),
                    )
                )
    return out


@dataclass
class Collector:
    grpc_port: int
    http_port: int
    directory: Path
    process: subprocess.Popen[bytes]

    @property
    def spans_file(self) -> Path:
        return self.directory / "spans.jsonl"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    @property
    def grpc_endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def spans(self) -> list[ExportedSpan]:
        if not self.spans_file.exists():
            return []
        lines = self.spans_file.read_text().split("\n")[:-1]  # the last one may be half written
        return [span for line in lines if line.strip() for span in parse_export(line)]

    def wait_for(
        self, check: Callable[[list[ExportedSpan]], bool], timeout: float = 20.0, what: str = "spans"
    ) -> list[ExportedSpan]:
        """The spans once ``check`` holds for them (AssertionError with what came, after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if check(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the collector did not receive {what} within {timeout}s: {spans}")
            time.sleep(0.05)

    def mark(self) -> str:
        """Send a span of the test's own over gRPC and wait until it is in the file: whatever
        reached the collector before this call is in the file too (one pipeline, in order).
        Returns its trace id."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "test-marker"}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{self.grpc_port}", insecure=True))
        )
        span = provider.get_tracer("tests").start_span("marker")
        trace_id = f"{span.get_span_context().trace_id:032x}"
        span.end()
        provider.shutdown()
        self.wait_for(lambda spans: any(s.trace_id == trace_id for s in spans), what="the marker span")
        return trace_id

    def log(self) -> str:
        path = self.directory / "otelcol.log"
        return path.read_text(errors="replace") if path.exists() else ""


class CollectorUnavailable(RuntimeError):
    """The collector could not be built or started; the message says why."""


def built() -> Path | None:
    """The built collector, or None when hack/otelcol/build has not run (for this go.mod)."""
    out = subprocess.run([str(BUILD), "--print-bin"], capture_output=True, text=True, check=False)
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def build(say: Callable[[str], None]) -> Path:
    """The collector, built first if need be (minutes with an empty Go build cache), each line
    of the build passed to ``say``."""
    found = built()
    if found is not None:
        return found
    say("building the test collector (hack/otelcol/build; cached after this run) ...")
    started = time.monotonic()
    process = subprocess.Popen(
        [str(BUILD)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        say(line.rstrip())
    if process.wait() != 0 or (found := built()) is None:
        raise CollectorUnavailable("hack/otelcol/build failed:\n" + "\n".join(lines[-20:]))
    say(f"built in {time.monotonic() - started:.0f} s")
    return found


def config(grpc_port: int, http_port: int, spans_file: Path) -> dict[str, Any]:
    """The collector's configuration: OTLP in on loopback, every trace to a file, flushed often."""
    return {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                    "http": {"endpoint": f"127.0.0.1:{http_port}"},
                }
            }
        },
        "exporters": {"file": {"path": str(spans_file), "flush_interval": "50ms"}},
        "service": {
            "telemetry": {"metrics": {"level": "none"}},
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
        },
    }


def start_collector(directory: Path, binary: Path | None = None) -> Collector:
    """The collector on free loopback ports, writing to ``directory`` (CollectorUnavailable if it
    is not built or does not start)."""
    binary = binary or built()
    if binary is None:
        raise CollectorUnavailable("the test collector is not built: run hack/otelcol/build")
    directory.mkdir(parents=True, exist_ok=True)
    grpc_port, http_port = free_ports(2)
    config_file = directory / "otelcol.json"
    config_file.write_text(json.dumps(config(grpc_port, http_port, directory / "spans.jsonl")))
    log = (directory / "otelcol.log").open("wb")
    process = subprocess.Popen(
        [str(binary), "--config", f"file:{config_file}"], stdout=log, stderr=subprocess.STDOUT
    )
    collector = Collector(grpc_port, http_port, directory, process)
    deadline = time.monotonic() + 30
    while "Everything is ready" not in collector.log():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise CollectorUnavailable(f"the test collector did not start:\n{collector.log()}")
        time.sleep(0.05)
    return collector


@pytest.fixture
def otelcol(tmp_path: Path) -> Iterator[Collector]:
    try:
        collector = start_collector(tmp_path / "otelcol")
    except CollectorUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield collector
    finally:
        collector.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            collector.process.wait(10)
        if collector.process.poll() is None:
            collector.process.kill()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the collector (cached) before the first test when a collected test needs it."""
    if not any("otelcol" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if session.config.option.collectonly:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(f"otelcol: {line}")

    try:
        build(say)
    except CollectorUnavailable as exc:
        raise pytest.UsageError(f"the tracing tests need the test collector: {exc}") from None
