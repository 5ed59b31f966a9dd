"""Shared fixtures: the Kubernetes test cluster (tests/support/kube.py) and loopback processes."""

pytest_plugins = [
    "tests.support.kube",
    "tests.support.procs",
    "tests.support.operator",
    "tests.support.pdstack",
]
