"""Real processes on loopback for integration tests: `pdserve sim`, `pdserve proxy`, ...

Every process gets a free port, is waited on until its health URL answers, and is
terminated (then killed) at teardown, so no test leaves anything behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]


def pdserve_argv(*args: str) -> list[str]:
    """The command line of ``pdserve <args>`` with this interpreter (the tree under test)."""
    return [sys.executable, "-m", "pdserve.cli", *args]


def spawn_pdserve(
    args: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, append: bool = False
) -> subprocess.Popen[bytes]:
    """``pdserve <args>`` started from the repository root, unbuffered, both output streams into
    ``log_path`` (``append``: after what an earlier run of the same process wrote there)."""
    with log_path.open("ab" if append else "wb") as log:
        return subprocess.Popen(
            pdserve_argv(*args),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


class Startable(Protocol):
    def start(self) -> None: ...

    def stop(self) -> object: ...


S = TypeVar("S", bound=Startable)


@contextlib.contextmanager
def running(thing: S) -> Iterator[S]:
    """``thing`` started, and stopped however the block ends: the one shape of the fixtures and
    context managers around an operator, a watch or a recorder."""
    thing.start()
    try:
        yield thing
    finally:
        thing.stop()


_handed_out: set[int] = set()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` free loopback ports, none handed out before in this process. The kernel hands a
    just-released port out again, so two draws in a row can repeat: the sockets stay bound until all
    are drawn, and ports drawn earlier are skipped."""
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in _handed_out:
                ports.append(port)
    _handed_out.update(ports)
    return ports


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; fail fast if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s: {last}")


def wait_routable(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> Any:
    """A pdserve router's ``/debug/routing`` once its table has instances and every one is routable
    (while its workers start, the merged view may answer 503: retried)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was routable")
        try:
            with urllib.request.urlopen(url + "/debug/routing", timeout=5) as resp:
                debug = json.loads(resp.read())
            table = debug.get("table") or {}
            instances = [*table.get("prefill", []), *table.get("decode", [])]
            if instances and all(i.get("ready") and not i.get("draining") for i in instances):
                return debug
            last = "not every instance routable yet"
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} was not routable within {timeout}s: {last}")


@dataclass
class Proc:
    name: str
    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, grace: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)


@dataclass
class ProcessGroup:
    """Starts `pdserve <subcommand>` processes and stops all of them at teardown."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(
        self,
        name: str,
        subcommand: Sequence[str],
        port: int | None = None,
        health: str | None = "/health",
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> Proc:
        port = port or free_port()
        args = [*subcommand, "--port", str(port)]
        log_path = self.log_dir / f"{name}.log"
        proc = Proc(name, pdserve_argv(*args), port, log_path, spawn_pdserve(args, log_path, env))
        self.procs.append(proc)
        if health is not None:
            try:
                wait_http(proc.url + health, timeout=timeout, proc=proc.popen)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{name} did not start: {exc}\n--- {log_path} ---\n{proc.log()}") from exc
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(grace=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()
