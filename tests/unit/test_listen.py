"""A port already in use is one line naming the flag that chose it, for every command that listens."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pdserve.listen import unavailable


@pytest.fixture
def busy() -> Iterator[int]:
    """A port something listens on, as another operator, router or simulator would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_unavailable_names_the_flag_and_skips_port_zero(busy: int) -> None:
    assert unavailable([("127.0.0.1", 0, "--off"), ("127.0.0.1", busy, "--metrics-port")]) == (
        f"port {busy} on 127.0.0.1 is already in use (--metrics-port): stop what holds it, or pick "
        "another --metrics-port"
    )
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert unavailable([("127.0.0.1", port, "--port")]) is None
    assert "is not an address of this machine" in (unavailable([("192.0.2.1", 9, "--bind")]) or "")


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (
            ["operator", "-A", "--bind", "127.0.0.1", "--liveness-port", "0", "--metrics-port"],
            "--metrics-port",
        ),
        (
            ["operator", "-A", "--bind", "127.0.0.1", "--metrics-port", "0", "--liveness-port"],
            "--liveness-port",
        ),
        (["proxy", "--routing-file", "/nonexistent.json", "--host", "127.0.0.1", "--port"], "--port"),
        (
            [
                "proxy",
                "--routing-file",
                "/nonexistent.json",
                "--host",
                "127.0.0.1",
                "--port",
                "FREE",
                "--admin-port",
            ],
            "--admin-port",
        ),
        (["sim", "--port"], "--port"),
    ],
    ids=["operator-metrics", "operator-liveness", "proxy", "proxy-admin", "sim"],
)
def test_a_second_server_on_the_same_port_says_so_in_one_line(
    busy: int, command: list[str], flag: str
) -> None:
    with socket.socket() as free:  # a port nothing listens on, for the flag that is not the busy one
        free.bind(("127.0.0.1", 0))
        command = [str(free.getsockname()[1]) if c == "FREE" else c for c in command]
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *command, str(busy)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "POD_NAMESPACE": "ns"},  # no kubeconfig needed: refused first
    )
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert f"port {busy} on 127.0.0.1 is already in use ({flag})" in line, result.stderr
