"""Run the P/D router in front of the prefill and decode vLLM instances of one deployment.

Each generation request (/v1/completions, /v1/chat/completions) goes to a prefill slot, then
(with the prefill's KV handoff) to a decode slot, whose answer is streamed back. Slots are
(instance, data-parallel rank) pairs read from the routing file, which is watched and
hot-reloaded (a mounted ConfigMap or a plain file). One process, one event loop: the
flat-interleaved counter is the process's only counter.

Environment variables give defaults for the main flags (a flag wins): PDSERVE_ROUTING_FILE,
PDSERVE_PROXY_HOST, PDSERVE_PROXY_PORT, PDSERVE_PROXY_POLICY, PROXY_HTTP_SERVER, PROXY_LISTEN_BACKLOG,
PDSERVE_PROXY_MAX_RETRIES, PDSERVE_PROXY_API_KEY, PDSERVE_BACKEND_API_KEY,
PDSERVE_PROXY_LOG_LEVEL, PDSERVE_PROXY_ADMIN_PORT. Prefer the environment for keys: command
lines are visible to every user of the machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pdserve.proxy.policies import DEFAULT_POLICY, POLICIES
from pdserve.proxy.settings import (
    DEFAULT_DECODE_TTFB_S,
    DEFAULT_HTTP_SERVER,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PREFILL_TTFB_S,
    DEFAULT_STREAM_IDLE_S,
    HTTP_SERVERS,
    ProxySettings,
)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--routing-file",
        type=Path,
        default=_env("PDSERVE_ROUTING_FILE"),
        help="routing table JSON (the ConfigMap key routing.json, mounted); watched and hot-reloaded "
        "[env PDSERVE_ROUTING_FILE]",
    )
    add(
        "--host",
        default=_env("PDSERVE_PROXY_HOST", "0.0.0.0"),
        help="address to listen on (default %(default)s) [env PDSERVE_PROXY_HOST]",
    )
    add(
        "--port",
        type=int,
        default=int(_env("PDSERVE_PROXY_PORT", "8000") or 8000),
        help="port to listen on (default %(default)s) [env PDSERVE_PROXY_PORT]",
    )
    add(
        "--admin-port",
        type=int,
        default=int(_env("PDSERVE_PROXY_ADMIN_PORT", "0") or 0) or None,
        help="also listen here, and serve /metrics, /debug/* and profiling only here (the client port "
        "answers 404 for them; /health, /ready and /routing/served answer on both) "
        "[env PDSERVE_PROXY_ADMIN_PORT]",
    )
    add(
        "--policy",
        choices=sorted(POLICIES),
        default=_env("PDSERVE_PROXY_POLICY", DEFAULT_POLICY),
        help="slot choice: flat-interleaved gives every slot exactly one request per cycle; "
        "least-outstanding picks the slot with the fewest in-flight requests (default %(default)s) "
        "[env PDSERVE_PROXY_POLICY]",
    )
    add(
        "--http-server",
        choices=HTTP_SERVERS,
        default=_env("PROXY_HTTP_SERVER", DEFAULT_HTTP_SERVER),
        help="ASGI server: hypercorn, or uvicorn with httptools (less CPU per request); both on uvloop "
        "with the same backlog, keep-alive and grace period (default %(default)s) [env PROXY_HTTP_SERVER]",
    )
    add(
        "--backlog",
        type=int,
        default=int(_env("PROXY_LISTEN_BACKLOG", "4096") or 4096),
        help="listen backlog: connections the kernel queues during a burst (default %(default)s) "
        "[env PROXY_LISTEN_BACKLOG]",
    )
    add(
        "--max-retries",
        type=int,
        default=int(_env("PDSERVE_PROXY_MAX_RETRIES", "2") or 2),
        help="extra attempts on other slots after a connect error, 5xx, deadline or bad KV handoff, "
        "before anything was sent to the client (default %(default)s) [env PDSERVE_PROXY_MAX_RETRIES]",
    )
    add(
        "--eject-seconds",
        type=float,
        default=10.0,
        help="cool-down of a failed slot: it is tried only after every healthy slot (default %(default)s)",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default %(default)s)",
    )
    add(
        "--api-key",
        default=_env("PDSERVE_PROXY_API_KEY"),
        help="if set, clients must send 'Authorization: Bearer <key>' (401 otherwise); /health, /ready "
        "and /metrics stay open [env PDSERVE_PROXY_API_KEY]",
    )
    add(
        "--backend-api-key",
        default=_env("PDSERVE_BACKEND_API_KEY"),
        help="key sent to the vLLM backends; without it the client's Authorization header is forwarded "
        "[env PDSERVE_BACKEND_API_KEY]",
    )
    add(
        "--prefill-ttfb-timeout",
        type=float,
        default=DEFAULT_PREFILL_TTFB_S,
        help="seconds a prefill may take to answer (a long prompt takes minutes) before it is cancelled "
        "and retried elsewhere (default %(default)s)",
    )
    add(
        "--decode-ttfb-timeout",
        type=float,
        default=DEFAULT_DECODE_TTFB_S,
        help="seconds until the decode's first byte (its whole answer when not streaming) before it is "
        "cancelled and retried (default %(default)s)",
    )
    add(
        "--stream-idle-timeout",
        type=float,
        default=DEFAULT_STREAM_IDLE_S,
        help="seconds allowed between two chunks of a stream before it is cancelled and ended with an "
        "error event (default %(default)s)",
    )
    add(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to open a TCP connection to a backend (default %(default)s)",
    )
    add(
        "--keep-alive-seconds",
        type=float,
        default=300.0,
        help="how long an idle client connection is kept open between requests (default %(default)s)",
    )
    add(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM: stop accepting, let in-flight requests finish this long (default %(default)s)",
    )
    add(
        "--reload-interval",
        type=float,
        default=0.2,
        help="seconds between checks of the routing file (default %(default)s)",
    )
    add(
        "--log-level",
        default=_env("PDSERVE_PROXY_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log level; info logs one line per request (default %(default)s) [env PDSERVE_PROXY_LOG_LEVEL]",
    )


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        routing_file=args.routing_file,
        host=args.host,
        port=args.port,
        policy=args.policy,
        http_server=args.http_server,
        backlog=args.backlog,
        max_retries=max(0, args.max_retries),
        eject_seconds=args.eject_seconds,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or None,
        backend_api_key=args.backend_api_key or None,
        prefill_ttfb_timeout=args.prefill_ttfb_timeout,
        decode_ttfb_timeout=args.decode_ttfb_timeout,
        stream_idle_timeout=args.stream_idle_timeout,
        connect_timeout=args.connect_timeout,
        keep_alive_seconds=args.keep_alive_seconds,
        grace_seconds=args.grace_seconds,
        reload_interval=args.reload_interval,
        log_level=args.log_level,
        admin_port=args.admin_port,
    )


def run(args: argparse.Namespace) -> int:
    if args.routing_file is None:
        print("pdserve proxy: --routing-file (or PDSERVE_ROUTING_FILE) is required", file=sys.stderr)
        return 2
    if args.admin_port is not None and args.admin_port == args.port:
        print(f"pdserve proxy: --admin-port must differ from --port ({args.port})", file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    from pdserve.proxy.server import run_server  # heavy imports only once the flags are valid

    run_server(settings)
    return 0
