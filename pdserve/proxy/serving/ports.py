"""Two listening ports: the OpenAI API for clients, and an admin port for operators and scrapers.

With ``--admin-port`` the proxy listens on both, with one app and one state. What a request
may reach depends on the port it arrived on (the ASGI ``server`` of its scope):

* the client port serves everything except :data:`ADMIN_ONLY` (metrics, ``/debug/*``,
  profiling), which answer 404 there, so the client Service, which exposes only this port,
  never serves them;
* the admin port serves :data:`ADMIN_ONLY` plus :data:`BOTH` (the probes and what the operator
  asks routers), and 404 for the rest (no generation, no model listing).

Without ``--admin-port`` (local mode, tests) every path answers on the one port, as before.
"""

from __future__ import annotations

from typing import Any

#: Paths that only the admin port serves.
ADMIN_ONLY = frozenset({"/metrics", "/start_profile", "/stop_profile"})
ADMIN_PREFIXES = ("/debug/",)
#: Paths that answer on both ports: kubelet probes hit the client port, operators the admin one.
BOTH = frozenset({"/health", "/ready", "/routing/served"})


def is_admin_path(path: str) -> bool:
    return path in ADMIN_ONLY or path.startswith(ADMIN_PREFIXES)


def refused_here(scope: Any, admin_port: int | None) -> bool:
    """Whether this request's path is not served on the port it arrived on."""
    if admin_port is None or scope.get("type") != "http":
        return False
    server = tuple(scope.get("server") or ())
    on_admin = len(server) > 1 and server[1] == admin_port
    path = scope.get("path", "")
    if on_admin:
        return not (is_admin_path(path) or path in BOTH)
    return is_admin_path(path)
