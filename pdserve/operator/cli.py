"""Run the pdserve operator: keep every PDDeployment's pods, router and routing table in step.

Watches PDDeployment objects and their pods in the given namespaces (or all of them), renders
the engines, router and routing ConfigMap, rolls out template changes one drain at a time and
reports status and Events. Uses $KUBECONFIG (or ~/.kube/config), or the in-cluster service
account when run as a pod.

Endpoints: liveness on --liveness-port (/healthz), Prometheus metrics on --metrics-port.
SIGTERM or SIGINT stop it gracefully.
"""

from __future__ import annotations

import argparse
import logging
import os

from pdserve.operator.handlers import OperatorOptions


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness-port", type=int, default=8080, help="port of /healthz, 0 to disable")
    parser.add_argument("--metrics-port", type=int, default=9090, help="port of /metrics, 0 to disable")
    parser.add_argument("--bind", default="0.0.0.0", help="address of the liveness and metrics endpoints")
    parser.add_argument("--log-format", choices=("json", "plain"), default="plain")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--resync-seconds",
        type=_positive,
        default=30.0,
        help="reconcile every PDDeployment at least this often",
    )
    parser.add_argument(
        "--debounce-ms",
        type=_positive,
        default=50.0,
        help="fold triggers arriving within this window into one reconcile",
    )
    # Passes mostly wait on the API server: enough workers that a burst of readiness changes
    # across many deployments does not queue behind other deployments' status writes.
    parser.add_argument("--workers", type=int, default=64, help="reconciles running in parallel")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG)")


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    if not args.namespace and not args.all_namespaces:
        raise SystemExit("pdserve operator: give --namespace NS (repeatable) or --all-namespaces")
    if args.workers < 1:
        raise SystemExit("pdserve operator: --workers must be at least 1")
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    logging.getLogger("pdserve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # one "Handler ... succeeded" line per watch event is noise
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.bind)
    options = OperatorOptions(
        resync_seconds=args.resync_seconds,
        debounce_seconds=args.debounce_ms / 1000.0,
        workers=args.workers,
        kubeconfig=args.kubeconfig,
    )
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    import pdserve.operator.handlers  # noqa: F401 - registers the handlers

    kopf.run(
        standalone=True,
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        memo=kopf.Memo(options=options),
    )
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value
