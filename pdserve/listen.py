"""Ports a command is told to listen on: one that cannot be had is one line naming its flag.

A second `pdserve operator`, router or simulator on the same host would otherwise die with a
traceback ending in ``OSError: [Errno 98] Address already in use``, naming neither the port nor
the flag that chose it. Each command checks its ports before it starts anything (a port taken in
the instant between the check and the real bind still fails loudly, only less politely).

Depends on nothing else in pdserve.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable


def bind_problem(exc: OSError, host: str, port: int, flag: str) -> str:
    """What a failed bind of ``host``:``port`` (chosen by ``flag``) means, and what to do."""
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use ({flag}): stop what holds it, or pick another {flag}"
    if exc.errno == errno.EACCES:
        return f"not allowed to listen on port {port} on {host} ({flag}): ports below 1024 need privileges"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}:{port} ({flag}): {host} is not an address of this machine"
    return f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}"


def unavailable(binds: Iterable[tuple[str, int, str]]) -> str | None:
    """The first of ``(host, port, flag)`` that cannot be listened on, as one line; None when
    every one can (port 0, "any free port" or "off", is not checked)."""
    for host, port, flag in binds:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As the servers bind: a connection in TIME_WAIT does not hold a port, a listener does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return bind_problem(exc, host, port, flag)
    return None
