"""Run the P/D router in front of the prefill and decode vLLM instances of one deployment.

Each generation request (/v1/completions, /v1/chat/completions) goes to a prefill slot, then
(with the prefill's KV handoff) to a decode slot, whose answer is streamed back. Slots are
(instance, data-parallel rank) pairs read from the routing table, which comes from exactly one
source: --routing-configmap (list+watch of the ConfigMap through the API server, in a cluster)
or --routing-file (a watched file, for local mode and tests). --workers processes (default: the
CPUs available) share the port and one flat-interleaved counter per role in shared memory.

The flags are generated from pdserve.proxy.settings, where each default is written once.
Environment variables give defaults for the flags that name one (a flag wins); every variable
the router reads is listed at the end. Prefer the environment for keys: command lines are
visible to every user of the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.argtypes import Flag, SettingsError, add_flags, flag_values, flags_of
from pdserve.listen import unavailable
from pdserve.proxy.serving.cpus import available_cpus
from pdserve.proxy.settings import GROUPS, ProxySettings, TableSettings

if TYPE_CHECKING:  # the ConfigMap source's modules load only when it is chosen (start-up time)
    import socket

    from pdserve.proxy.serving.worker_views import WorkerInfo
    from pdserve.proxy.table.kubeconfig import ApiCredentials, ConfigMapRef

#: Variables the router reads that give no flag's default: (name, what for).
ENVIRONMENT: tuple[tuple[str, str], ...] = (
    (
        "PDSERVE_ROUTING_FILE",
        "the routing file, when neither --routing-file nor --routing-configmap is given",
    ),
    ("PDSERVE_ROUTING_CONFIGMAP", "the routing ConfigMap, when neither source flag is given"),
    ("KUBECONFIG", "with --routing-configmap and no --kubeconfig: the kubeconfig file(s)"),
    ("POD_NAMESPACE", "the ConfigMap's namespace when --routing-configmap names none"),
    (
        "KUBERNETES_SERVICE_HOST, KUBERNETES_SERVICE_PORT",
        "in a pod without a kubeconfig: the API server (with the service account's token and CA)",
    ),
    ("PROMETHEUS_MULTIPROC_DIR", "set by the router for its worker processes' metrics; do not set it"),
)


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    return repr(value) if value == "" else str(value)


def _help(flag: Flag, default: object) -> str:
    env = f" [env {flag.env}]" if flag.env else ""
    return f"{flag.help} (default {_shown(default)}){env}".replace("%", "%%")


def configure(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ProxySettings, parser.add_argument_group("routing policy"), _help)
    for _, title, settings_class in GROUPS:
        group = parser.add_argument_group(title)
        if settings_class is TableSettings:
            _add_table_source(group)
        add_flags(parser, settings_class, group, _help)
    parser.epilog = "environment variables the router reads (a flag wins over its variable):\n" + "\n".join(
        f"  {name}: {what}" for name, what in environment()
    )


def _add_table_source(group: Any) -> None:
    """The source flags: resolved together (and with credentials) by :func:`table_source`."""
    group.add_argument(
        "--routing-configmap",
        metavar="[NAMESPACE/]NAME",
        default=None,
        help="list+watch this ConfigMap (key routing.json) through the API server; without NAMESPACE/ "
        "the namespace is POD_NAMESPACE's, else the service account's; exactly one of this and "
        "--routing-file (default unset) [env PDSERVE_ROUTING_CONFIGMAP]",
    )
    group.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="with --routing-configmap from outside a cluster: the kubeconfig whose current context "
        "(server, CA, client certificate or token) reaches the API server; in a pod the service "
        "account is used (default unset) [env KUBECONFIG]",
    )
    group.add_argument(
        "--routing-file",
        type=Path,
        default=None,
        help="routing table JSON file (local mode, tests); watched and hot-reloaded (default unset) "
        "[env PDSERVE_ROUTING_FILE]",
    )


def environment() -> list[tuple[str, str]]:
    """Every environment variable the router reads, with what it is for, by name."""
    found = [
        (flag.env, f"the default of {flag.names[0]}") for _, flag, _ in flags_of(ProxySettings) if flag.env
    ]
    for _, _, settings_class in GROUPS:
        found += [
            (flag.env, f"the default of {flag.names[0]}")
            for _, flag, _ in flags_of(settings_class)
            if flag.env
        ]
    return sorted([*found, *ENVIRONMENT])


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


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    routing_file, configmap, kube = table_source(args)
    try:
        table = TableSettings(routing_file, configmap, kube, **flag_values(args, TableSettings))
        groups = {name: cls(**flag_values(args, cls)) for name, _, cls in GROUPS if cls is not TableSettings}
        settings = ProxySettings(table=table, **groups, **flag_values(args, ProxySettings))
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    if settings.server.workers == 0:
        server = dataclasses.replace(settings.server, workers=available_cpus())
        settings = dataclasses.replace(settings, server=server)
    if settings.tracing.endpoint is not None:
        _check_tracing_available()
    return settings


def _check_tracing_available() -> None:
    """Tracing asked for without the SDK: say which extra to install before anything starts."""
    from pdserve.tracing.sdk import TracingUnavailable, check_available

    try:
        check_available("--otlp-traces-endpoint")
    except TracingUnavailable as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except UsageError as exc:
        print(f"pdserve proxy: {exc}", file=sys.stderr)
        return 2
    listen = settings.listen
    ports = [(listen.host, listen.port, "--port")]
    if listen.admin_port is not None:
        ports.append((listen.admin_host or listen.host, listen.admin_port, "--admin-port"))
    taken = unavailable(ports)
    if taken:
        print(f"pdserve proxy: {taken}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if settings.server.workers > 1:
        from pdserve.proxy.serving.workers import run_workers  # forks before the server's imports

        return run_workers(settings, serve_process)
    serve_process(settings)
    return 0


def serve_process(
    settings: ProxySettings, sockets: Sequence[socket.socket] = (), worker: WorkerInfo | None = None
) -> None:
    """One process of the router: the app (pdserve.proxy.app) on the chosen HTTP server. The heavy
    imports happen here, once the flags are valid (and in a worker, after the fork)."""
    from pdserve.proxy.app import create_app
    from pdserve.proxy.serving.server import run_server

    run_server(settings, create_app, sockets, worker)
