"""Shared fixtures: the Kubernetes test cluster (tests/support/kube.py), loopback processes and the
OpenTelemetry Collector of the tracing tests (tests/support/otelcol.py).

The property tests draw the same examples on every run (seeded by a hash of each test) and keep no
example database, so CI, a clean checkout and a developer's machine test the same cases and a
failure reproduces anywhere. To search further: ``HYPOTHESIS_PROFILE=explore`` (random seeds and
the local example database, Hypothesis' own default)."""

import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

pytest_plugins = [
    "tests.support.kube",
    "tests.support.procs",
    "tests.support.operator",
    "tests.support.pdstack",
    "tests.support.otelcol",
]
