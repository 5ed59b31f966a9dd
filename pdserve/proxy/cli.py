"""Run the P/D router in front of the prefill and decode vLLM instances of one deployment.

Each generation request (/v1/completions, /v1/chat/completions) goes to a prefill slot, then
(with the prefill's KV handoff) to a decode slot, whose answer is streamed back. Slots are
(instance, data-parallel rank) pairs read from the routing table, which comes from exactly one
source: --routing-configmap (list+watch of the ConfigMap through the API server, in a cluster)
or --routing-file (a watched file, for local mode and tests). --workers processes (default: the
CPUs available) share the port and one flat-interleaved counter per role in shared memory.

Environment variables give defaults for the main flags (a flag wins): PDSERVE_ROUTING_FILE,
PDSERVE_ROUTING_CONFIGMAP, KUBECONFIG, PDSERVE_PROXY_HOST, PDSERVE_PROXY_PORT, PDSERVE_PROXY_POLICY,
PROXY_HTTP_SERVER, PROXY_LISTEN_BACKLOG, PDSERVE_PROXY_MAX_RETRIES, PDSERVE_PROXY_API_KEY,
PDSERVE_BACKEND_API_KEY, PDSERVE_PROXY_SHUTDOWN_GRACE_SECONDS, PDSERVE_PROXY_SHUTDOWN_DELAY_SECONDS,
PDSERVE_PROXY_LOG_LEVEL, PDSERVE_PROXY_ADMIN_PORT, PDSERVE_PROXY_ADMIN_HOST, PDSERVE_LOCAL_DECODE, POD_NAME,
PDSERVE_INSTANCE_INDEX. Prefer the environment for keys: command lines
are visible to every user of the machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.listen import unavailable
from pdserve.proxy.policies import DEFAULT_POLICY, POLICIES
from pdserve.proxy.serving.cpus import available_cpus
from pdserve.proxy.settings import (
    DEFAULT_DECODE_TTFB_S,
    DEFAULT_HTTP_SERVER,
    DEFAULT_KV_LEASE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FAN_OUT,
    DEFAULT_MAX_PER_SLOT,
    DEFAULT_PREFILL_TTFB_S,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_QUEUE_TIMEOUT_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_STREAM_IDLE_S,
    HTTP_SERVERS,
    ProxySettings,
)
from pdserve.routing.sidecar import LocalDecode

if TYPE_CHECKING:  # the ConfigMap source's modules load only when it is chosen (start-up time)
    import socket
    from collections.abc import Sequence

    from pdserve.proxy.state.shared import SharedState
    from pdserve.proxy.table.kubeconfig import ApiCredentials, ConfigMapRef


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--routing-configmap",
        metavar="[NAMESPACE/]NAME",
        default=None,
        help="list+watch this ConfigMap (key routing.json) through the API server; without NAMESPACE/ "
        "the namespace is POD_NAMESPACE's, else the service account's [env PDSERVE_ROUTING_CONFIGMAP]",
    )
    add(
        "--kubeconfig",
        type=Path,
        default=None,
        help="with --routing-configmap from outside a cluster: the kubeconfig whose current context "
        "(server, CA, client certificate or token) reaches the API server; in a pod the service "
        "account is used [env KUBECONFIG]",
    )
    add(
        "--routing-file",
        type=Path,
        default=None,
        help="routing table JSON file (local mode, tests); watched and hot-reloaded "
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
        "--admin-host",
        default=_env("PDSERVE_PROXY_ADMIN_HOST"),
        help="address of the admin port (default: --host's); e.g. --host 127.0.0.1 --admin-host 0.0.0.0 "
        "keeps the API to the pod while probes and scrapers reach the admin port "
        "[env PDSERVE_PROXY_ADMIN_HOST]",
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
        help="ASGI server: uvicorn with httptools (a third less CPU per request), or hypercorn; both on "
        "uvloop with the same backlog, keep-alive and grace period (default %(default)s) "
        "[env PROXY_HTTP_SERVER]",
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
        "--kv-lease-seconds",
        type=float,
        default=DEFAULT_KV_LEASE_S,
        help="how long a prefill keeps its KV for the decode (vLLM NIXL's kv_lease_duration; 480 for "
        "vLLM before leases, its VLLM_NIXL_ABORT_REQUEST_TIMEOUT): a decode that could not be reached "
        "is retried with the same KV while less than half of it has passed, else after a new prefill; "
        "0 always re-prefills (default %(default)s)",
    )
    add(
        "--max-fan-out",
        type=int,
        default=DEFAULT_MAX_FAN_OUT,
        help="most sequences (prompts x n) one request may ask for; each is its own prefill/decode "
        "request, merged in the answer; more gets 400 (default %(default)s)",
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
        "--shutdown-grace-seconds",
        "--grace-seconds",
        dest="grace_seconds",
        type=float,
        default=float(_env("PDSERVE_PROXY_SHUTDOWN_GRACE_SECONDS", str(DEFAULT_SHUTDOWN_GRACE_S)) or 0),
        help="on SIGTERM: stop accepting, let in-flight requests and streams finish this long, then "
        "cancel them (default %(default)s) [env PDSERVE_PROXY_SHUTDOWN_GRACE_SECONDS]",
    )
    add(
        "--shutdown-delay-seconds",
        type=float,
        default=float(_env("PDSERVE_PROXY_SHUTDOWN_DELAY_SECONDS", "0") or 0),
        help="on SIGTERM: /ready answers 503 at once, but connections are still accepted this long "
        "before the grace period starts; for load balancers without a pod preStop hook "
        "(default %(default)s) [env PDSERVE_PROXY_SHUTDOWN_DELAY_SECONDS]",
    )
    add(
        "--reload-interval",
        type=float,
        default=0.2,
        help="seconds between checks of the routing file (default %(default)s)",
    )
    add(
        "--local-decode",
        metavar="URL",
        default=_env("PDSERVE_LOCAL_DECODE"),
        help="decode-sidecar mode: send every decode leg to this engine (http://$(POD_IP):8000 in a decode "
        "pod: its own engine) and walk its DP ranks here; prefills come from the routing table. /ready "
        "then also needs the engine's /health [env PDSERVE_LOCAL_DECODE]",
    )
    add(
        "--local-dp-size",
        type=int,
        default=1,
        help="with --local-decode: the local engine's data-parallel size: its local ranks on a node of a "
        "multi-node instance with an API server per node (default %(default)s)",
    )
    add(
        "--local-first-rank",
        type=int,
        default=0,
        help="with --local-decode: the global DP rank of the local engine's first rank (a node of a "
        "multi-node instance with an API server per node: its --data-parallel-start-rank); its slots "
        "keep their global ranks and carry local ranks in X-data-parallel-rank (default %(default)s)",
    )
    add(
        "--local-revision",
        default="",
        help="with --local-decode: the local engine's pairing revision; only prefills of this revision "
        "are used (default: the unversioned revision)",
    )
    add(
        "--local-name",
        default=_env("POD_NAME", ""),
        help="with --local-decode: this pod's name in the routing table (draining, kvAddress; the "
        "slot name in metrics) [env POD_NAME]",
    )
    add(
        "--instance-index",
        type=int,
        default=int(_env("PDSERVE_INSTANCE_INDEX", "0") or 0),
        help="with --local-decode: this decode instance's index; the prefill walk starts at "
        "index * prefill slots / decode instances, so equal traffic per decode pod gives every prefill "
        "slot an exact share (default %(default)s) [env PDSERVE_INSTANCE_INDEX]",
    )
    add(
        "--max-per-slot",
        type=int,
        default=int(_env("PDSERVE_PROXY_MAX_PER_SLOT", str(DEFAULT_MAX_PER_SLOT)) or 0),
        help="most legs in flight per slot (one engine rank), router-wide; a request whose slots are "
        "full waits in the admission queue; 0: no limit (default %(default)s) "
        "[env PDSERVE_PROXY_MAX_PER_SLOT]",
    )
    add(
        "--admission-queue",
        type=int,
        default=DEFAULT_QUEUE_SIZE,
        help="requests that may wait for a slot with room (per worker); more get 429 with Retry-After "
        "(default %(default)s)",
    )
    add(
        "--admission-timeout",
        type=float,
        default=DEFAULT_QUEUE_TIMEOUT_S,
        help="seconds a request may wait in the admission queue before it gets 429 (default %(default)s)",
    )
    add(
        "--workers",
        type=int,
        default=int(_env("PDSERVE_PROXY_WORKERS", "0") or 0),
        help="worker processes sharing the port (SO_REUSEPORT), one routing counter per role in shared "
        "memory; 0: the CPUs available to the process (affinity and cgroup cpu.max) "
        "[env PDSERVE_PROXY_WORKERS]",
    )
    add(
        "--log-level",
        default=_env("PDSERVE_PROXY_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log level; info logs one line per request (default %(default)s) [env PDSERVE_PROXY_LOG_LEVEL]",
    )


class UsageError(Exception):
    """Flags or credentials the proxy cannot start with; printed, exit status 2."""


def table_source(
    args: argparse.Namespace, env: dict[str, str] | os._Environ[str] = os.environ
) -> tuple[Path | None, ConfigMapRef | None, ApiCredentials | None]:
    """Exactly one of --routing-file and --routing-configmap (flags first, then their env vars)."""
    file_value: str | Path | None = args.routing_file
    configmap_value: str | None = args.routing_configmap
    if file_value is not None and configmap_value is not None:
        raise UsageError("give one table source, not both: --routing-file or --routing-configmap")
    if file_value is None and configmap_value is None:
        file_value = env.get("PDSERVE_ROUTING_FILE") or None
        configmap_value = env.get("PDSERVE_ROUTING_CONFIGMAP") or None
        if file_value and configmap_value:
            raise UsageError(
                "both PDSERVE_ROUTING_FILE and PDSERVE_ROUTING_CONFIGMAP are set: give one table source "
                "(or choose with --routing-file / --routing-configmap)"
            )
    if file_value:
        if args.kubeconfig is not None:
            raise UsageError("--kubeconfig is only used with --routing-configmap, not with --routing-file")
        return Path(file_value), None, None
    if not configmap_value:
        raise UsageError(
            "a routing table source is required: --routing-configmap [NAMESPACE/]NAME (in a cluster) or "
            "--routing-file PATH (env PDSERVE_ROUTING_CONFIGMAP or PDSERVE_ROUTING_FILE)"
        )
    from pdserve.proxy.table.kubeconfig import (
        CredentialsError,
        default_namespace,
        in_cluster,
        kubeconfig_paths,
        load_kubeconfig,
        parse_configmap_ref,
    )

    try:
        kubeconfig = args.kubeconfig or env.get("KUBECONFIG")
        if kubeconfig:
            paths = [args.kubeconfig] if args.kubeconfig else kubeconfig_paths(str(kubeconfig))
            creds = load_kubeconfig(paths)
        else:
            creds = in_cluster(env)
        creds.ssl_context()  # fail now, with the file's name, not at the first request
        ref = parse_configmap_ref(configmap_value, lambda: default_namespace(env, creds=creds))
    except CredentialsError as exc:
        raise UsageError(str(exc)) from None
    return None, ref, creds


def local_decode(args: argparse.Namespace) -> LocalDecode | None:
    """The --local-* flags as one value; None without --local-decode."""
    if not args.local_decode:
        return None
    url = str(args.local_decode)
    if not url.startswith(("http://", "https://")):
        raise UsageError(
            f"--local-decode: expected an http(s) URL such as http://127.0.0.1:8000, got {url!r}"
        )
    if args.local_dp_size < 1:
        raise UsageError(f"--local-dp-size: expected an integer >= 1, got {args.local_dp_size}")
    if args.local_first_rank < 0:
        raise UsageError(f"--local-first-rank: expected an integer >= 0, got {args.local_first_rank}")
    if args.instance_index < 0:
        raise UsageError(f"--instance-index: expected an integer >= 0, got {args.instance_index}")
    return LocalDecode(
        url,
        args.local_dp_size,
        args.local_revision,
        args.local_name,
        args.instance_index,
        args.local_first_rank,
    )


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    routing_file, configmap, kube = table_source(args)
    return ProxySettings(
        routing_file=routing_file,
        routing_configmap=configmap,
        kube=kube,
        host=args.host,
        port=args.port,
        policy=args.policy,
        http_server=args.http_server,
        backlog=args.backlog,
        max_retries=max(0, args.max_retries),
        kv_lease_seconds=max(0.0, args.kv_lease_seconds),
        max_fan_out=max(1, args.max_fan_out),
        eject_seconds=args.eject_seconds,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or None,
        backend_api_key=args.backend_api_key or None,
        prefill_ttfb_timeout=args.prefill_ttfb_timeout,
        decode_ttfb_timeout=args.decode_ttfb_timeout,
        stream_idle_timeout=args.stream_idle_timeout,
        connect_timeout=args.connect_timeout,
        keep_alive_seconds=args.keep_alive_seconds,
        grace_seconds=max(0.0, args.grace_seconds),
        shutdown_delay_seconds=max(0.0, args.shutdown_delay_seconds),
        reload_interval=args.reload_interval,
        log_level=args.log_level,
        admin_port=args.admin_port,
        admin_host=args.admin_host or None,
        local_decode=local_decode(args),
        max_per_slot=max(0, args.max_per_slot),
        admission_queue=max(0, args.admission_queue),
        admission_timeout=max(0.0, args.admission_timeout),
        workers=args.workers if args.workers > 0 else available_cpus(),
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except UsageError as exc:
        print(f"pdserve proxy: {exc}", file=sys.stderr)
        return 2
    if args.admin_port is not None and args.admin_port == args.port:
        print(f"pdserve proxy: --admin-port must differ from --port ({args.port})", file=sys.stderr)
        return 2
    taken = unavailable(
        [(settings.host, settings.port, "--port")]
        + (
            [(settings.admin_host or settings.host, settings.admin_port, "--admin-port")]
            if settings.admin_port
            else []
        )
    )
    if taken:
        print(f"pdserve proxy: {taken}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if settings.workers > 1:
        from pdserve.proxy.serving.workers import run_workers  # forks before the server's imports

        return run_workers(settings, serve_process)
    serve_process(settings)
    return 0


def serve_process(
    settings: ProxySettings, shared: SharedState | None = None, sockets: Sequence[socket.socket] = ()
) -> None:
    """One process of the router: the app (pdserve.proxy.app) on the chosen HTTP server. The heavy
    imports happen here, once the flags are valid (and in a worker, after the fork)."""
    from pdserve.proxy.app import create_app
    from pdserve.proxy.serving.server import run_server

    run_server(settings, create_app, shared, sockets)
