"""One process `pdserve up` supervises (an engine, a router): how it starts, the processes it
started, the signals they get, and how it ended, in words.

Every child runs in its own session with its CPU affinity, and on Linux gets SIGTERM when
`pdserve up` dies (PR_SET_PDEATHSIG). Its processes are tracked across restarts
(:mod:`pdserve.local.proctree`: its session plus every descendant seen), so everything it ever
started is stopped with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.local.proctree import ProcessTree, ProcStat, kill_all, scan


@dataclass
class Child:
    """One supervised process (an engine or the proxy), the processes it started, and its restart
    bookkeeping."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    ports: tuple[int, ...] = ()  # must be free before a (re)start
    cpus: tuple[int, ...] | None = None  # CPU affinity of the process and all it starts
    popen: subprocess.Popen[bytes] | None = None
    tree: ProcessTree | None = None
    healthy_once: bool = False
    owner_checked: bool = False  # the listener on its port was seen to be one of its processes
    ready: bool = False  # in the routing table as ready (the runner's last readiness answer)
    failed_probes: int = 0  # failed /health answers in a row since it was last ready
    failed_starts: int = 0
    exited_at: float | None = None  # when the exit of the main process was noticed
    restart_at: float = 0.0
    restarts: int = 0
    port_warned: bool = False
    trees: list[ProcessTree] = field(default_factory=list)  # of every start, for the final stop

    def start(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                start_new_session=True,
                preexec_fn=_child_setup(self.cpus) if sys.platform == "linux" else None,
            )
        finally:
            log.close()
        self.tree = ProcessTree.of(self.popen.pid)
        table = scan()
        self.trees = [t for t in self.trees if t.refresh(table)] + [self.tree]
        self.healthy_once = False
        self.owner_checked = False
        self.exited_at = None
        self.port_warned = False

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_tree(self, sig: int) -> list[int]:
        """``sig`` to every process of every start of this child still alive."""
        return kill_all(self.trees, sig)

    def tree_alive(self, table: Mapping[int, ProcStat] | None = None) -> bool:
        """Whether a process of any start of this child still runs (``table``: a /proc scan to use)."""
        table = scan() if table is None else table
        return any(t.refresh(table) for t in self.trees)

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def _child_setup(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """Runs in the child before exec: its CPU affinity (inherited by all it starts), and
    PR_SET_PDEATHSIG, so the kernel sends it SIGTERM when `pdserve up` dies."""

    def setup() -> None:
        import ctypes

        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)

    return setup


def describe_exit(code: int | None) -> str:
    """How a process ended, saying a signal when one ended it: a negative returncode is death by
    that signal, 128 + n is how a shell or a handler that re-raised reports signal n."""
    if code is None:
        return "stopped"
    number = -code if code < 0 else code - 128 if 128 < code <= 128 + 64 else 0
    if not number:
        return f"exited with code {code}"
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"was stopped by {name}" if code < 0 else f"exited with code {code} (stopped by {name})"
