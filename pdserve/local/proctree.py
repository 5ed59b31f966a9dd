"""Every process an engine started, found in /proc, so it can be stopped with the engine.

Why not the process group alone: `vllm serve` starts an API server, engine cores and workers
in its session; when the main process is killed they are re-parented to init and keep
serving (its port, its /health, its ZMQ sockets), and a process may leave the session
(setsid). So the runner keeps, per engine, the processes of its session plus every
descendant it has ever seen, each as (pid, start time): pids are reused (pid_max is often
32768), a start time makes the pair unique, and a pair that no longer matches is never
signalled.

Linux only (/proc); elsewhere the tree is the main process alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    sid: int
    start: int  # clock ticks after boot (field 22 of /proc/PID/stat)
    zombie: bool


def parse_stat(text: str) -> ProcStat | None:
    """One ``/proc/PID/stat`` line; the command name may hold spaces and parentheses."""
    pid_text, _, rest = text.partition(" (")
    _, _, fields_text = rest.rpartition(") ")
    fields = fields_text.split()
    try:
        return ProcStat(int(pid_text), int(fields[1]), int(fields[3]), int(fields[19]), fields[0] == "Z")
    except (IndexError, ValueError):
        return None


def scan(root: Path = PROC) -> dict[int, ProcStat]:
    """Every process now, by pid (those that exit while being read are skipped)."""
    out: dict[int, ProcStat] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            stat = parse_stat((root / name / "stat").read_text())
        except OSError:
            continue
        if stat is not None:
            out[stat.pid] = stat
    return out


def members(
    table: Mapping[int, ProcStat], leader: int, leader_start: int, known: Iterable[tuple[int, int]]
) -> set[tuple[int, int]]:
    """(pid, start) of the live processes that belong to the engine led by ``leader``.

    Those descended from the leader, those in its session (while the session id is still
    its: no other process has taken the leader's pid), and those seen before that still run.
    """
    out: set[tuple[int, int]] = set()
    children: dict[int, list[ProcStat]] = defaultdict(list)
    for proc in table.values():
        children[proc.ppid].append(proc)
    current = table.get(leader)
    if current is None or current.start == leader_start:
        stack = [leader]
        while stack:
            for child in children.pop(stack.pop(), []):
                if child.start >= leader_start:
                    out.add((child.pid, child.start))
                    stack.append(child.pid)
        out |= {(p.pid, p.start) for p in table.values() if p.sid == leader and p.start >= leader_start}
    for pid, start in known:
        seen = table.get(pid)
        if seen is not None and seen.start == start:
            out.add((pid, start))
    return {(pid, start) for pid, start in out if not table[pid].zombie}


@dataclass
class ProcessTree:
    """The processes of one engine start: its main process (the session leader) and all it began."""

    leader: int
    leader_start: int
    known: set[tuple[int, int]] = field(default_factory=set)

    @classmethod
    def of(cls, pid: int, root: Path = PROC) -> ProcessTree:
        try:
            stat = parse_stat((root / str(pid) / "stat").read_text())
        except OSError:
            stat = None
        tree = cls(pid, stat.start if stat is not None else 0)
        if stat is not None:
            tree.known.add((pid, stat.start))
        return tree

    def refresh(self, table: Mapping[int, ProcStat] | None = None) -> set[tuple[int, int]]:
        """Record the processes alive now (call it periodically: a process may leave the session
        and must have been seen before its parent dies); returns them."""
        table = scan() if table is None else table
        self.known = members(table, self.leader, self.leader_start, self.known)
        return self.known

    def pids(self) -> list[int]:
        return sorted(pid for pid, _ in self.refresh())

    def signal(self, sig: int) -> list[int]:
        """Send ``sig`` to every live process of the tree; the pids it went to."""
        sent = []
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent.append(pid)
        return sent


def kill_all(trees: Iterable[ProcessTree], sig: int = signal.SIGKILL) -> list[int]:
    return [pid for tree in trees for pid in tree.signal(sig)]


# --- ports --------------------------------------------------------------------------------------


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (as servers do, with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def listening_inodes(port: int, root: Path = PROC) -> set[int]:
    """Socket inodes listening on TCP ``port`` (IPv4 or IPv6, any address)."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (root / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def socket_holders(inodes: set[int], pids: Iterable[int], root: Path = PROC) -> set[int]:
    """The pids among ``pids`` that hold one of the socket ``inodes`` open."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders: set[int] = set()
    for pid in pids:
        fd_dir = root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd_dir / fd) in wanted:
                    holders.add(pid)
                    break
    return holders


def port_holders(port: int, root: Path = PROC) -> set[int]:
    """Every process listening on ``port`` (scans all processes: for messages, not for polling)."""
    inodes = listening_inodes(port, root)
    return socket_holders(inodes, scan(root), root) if inodes else set()
