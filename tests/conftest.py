"""Shared fixtures: the Kubernetes test cluster (tests/support/kube.py), loopback processes and the
OpenTelemetry Collector of the tracing tests (tests/support/otelcol.py)."""

pytest_plugins = [
    "tests.support.kube",
    "tests.support.procs",
    "tests.support.operator",
    "tests.support.pdstack",
    "tests.support.otelcol",
]
