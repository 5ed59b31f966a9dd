"""Run the pdserve operator: keep every PDDeployment's pods, router and routing table in step.

Watches PDDeployment objects and their pods in the given namespaces (or all of them), renders
the engines, router and routing ConfigMap, rolls out template changes one drain at a time and
reports status and Events. Uses $KUBECONFIG (or ~/.kube/config), or the in-cluster service
account when run as a pod.

Endpoints: liveness on --liveness-port (/healthz), Prometheus metrics on --metrics-port.
SIGTERM or SIGINT stop it gracefully.

High availability: run several replicas. They elect a leader through the Lease
--leader-election-id in --leader-election-namespace; only the leader reconciles (the others keep
their watches warm), every write checks that its lease is fresh, and a replica that loses the
lease exits with status 1 to be restarted as a follower. A graceful stop hands the lease over.
Outside a cluster, with no namespace for the Lease (no --leader-election-namespace, no
$POD_NAMESPACE, no service account), it runs as a single replica without election and says so,
as controller-runtime's operators do by default: run one against a cluster at a time, or give
--leader-election-namespace. --leader-elect makes the election required, --no-leader-elect off.

Environment:
  KUBECONFIG                the kubeconfig when --kubeconfig is not given (else ~/.kube/config)
  KUBERNETES_SERVICE_HOST   set in a pod: the in-cluster service account is used
  POD_NAME                  the leader-election identity (plus a random suffix; else the hostname)
  POD_NAMESPACE             the Lease's namespace when --leader-election-namespace is not given
  PDSERVE_OPERATOR_OTLP_TRACES_ENDPOINT  --otlp-traces-endpoint when not given; OTEL_* as the SDK reads them

Examples:
  pdserve operator --all-namespaces                  # from a laptop: one replica, no election
  pdserve operator -n serving --leader-election-namespace pdserve-system
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.argtypes import add_flags, positive_float, setting, stating_default
from pdserve.deployment.spec.pddeployment import DEFAULT_IMAGE
from pdserve.listen import unavailable
from pdserve.operator.control.handlers import OperatorOptions
from pdserve.operator.control.leader import (
    DEFAULT_LEASE_NAME,
    LEASE_DURATION,
    RENEW_DEADLINE,
    RETRY_PERIOD,
    ElectionConfig,
    default_identity,
    default_namespace,
    validate,
)

if TYPE_CHECKING:
    from pdserve.operator.control.leader import LeaderElector


@dataclass(frozen=True)
class ScopeFlags:
    """Which namespaces are watched: given ones, or all (one or the other)."""

    namespace: tuple[str, ...] = setting(
        (), "-n", "--namespace", action="append", metavar="NS", help="watch this namespace (repeatable)"
    )
    all_namespaces: bool = setting(
        False, "-A", "--all-namespaces", action="store_true", help="watch every namespace"
    )


@dataclass(frozen=True)
class OperatorFlags:
    """The endpoints, logs, reconcile pacing, rendered image and tracing."""

    liveness_port: int = setting(8080, "--liveness-port", help="port of /healthz, 0 to disable")
    metrics_port: int = setting(9090, "--metrics-port", help="port of /metrics, 0 to disable")
    bind: str = setting("0.0.0.0", "--bind", help="address of the liveness and metrics endpoints")
    log_format: str = setting(
        "plain",
        "--log-format",
        choices=("json", "plain"),
        help="json: one object per line, for log pipelines",
    )
    verbose: bool = setting(False, "--verbose", action="store_true", help="debug logging (default: info)")
    resync_seconds: float = setting(
        30.0,
        "--resync-seconds",
        type=positive_float,
        help="reconcile every PDDeployment at least this often",
    )
    debounce_ms: float = setting(
        50.0,
        "--debounce-ms",
        type=positive_float,
        help="fold triggers arriving within this window into one reconcile",
    )
    # Passes mostly wait on the API server: enough workers that a burst of readiness changes
    # across many deployments does not queue behind other deployments' status writes.
    workers: int = setting(64, "--workers", help="reconciles running in parallel")
    pdserve_image: str = setting(
        DEFAULT_IMAGE,
        "--pdserve-image",
        metavar="IMAGE",
        help="the image of router pods, and of engine: sim pods, whose PDDeployment names none "
        "(spec.router.image); the chart passes the image it runs the operator from",
    )
    kubeconfig: str | None = setting(
        None,
        "--kubeconfig",
        help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else the in-cluster service "
        "account)",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "--otlp-traces-endpoint",
        env="PDSERVE_OPERATOR_OTLP_TRACES_ENDPOINT",
        metavar="URL",
        help="export every reconcile pass as a span, a rollout's passes as one trace, to this OTLP "
        "receiver: http(s)://HOST:PORT/v1/traces or grpc://HOST:PORT (default: "
        "$PDSERVE_OPERATOR_OTLP_TRACES_ENDPOINT, else off); needs the tracing extra (pdserve[tracing])",
    )


@dataclass(frozen=True)
class ElectionFlags:
    """Leader election among replicas (pdserve.operator.control.leader)."""

    leader_elect: bool | None = setting(
        None,
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        help="reconcile only while holding the leader Lease; --no-leader-elect for a single replica "
        "without a Lease (default: on where a namespace for the Lease is known, else off with a "
        "warning)",
    )
    leader_election_namespace: str | None = setting(
        None,
        "--leader-election-namespace",
        metavar="NS",
        help="namespace of the Lease (default: $POD_NAMESPACE, else the service account's namespace)",
    )
    leader_election_id: str = setting(
        DEFAULT_LEASE_NAME,
        "--leader-election-id",
        metavar="NAME",
        help=f"name of the Lease (default: {DEFAULT_LEASE_NAME}); replicas sharing it elect one leader",
    )
    lease_duration: int = setting(
        LEASE_DURATION,
        "--lease-duration",
        metavar="S",
        help="seconds a follower waits, after the lease last changed, before taking it over",
    )
    renew_deadline: float = setting(
        RENEW_DEADLINE,
        "--renew-deadline",
        metavar="S",
        help="the leader stops writing, and exits, when it has not renewed for this long",
    )
    retry_period: float = setting(
        RETRY_PERIOD,
        "--retry-period",
        metavar="S",
        help="seconds between renewals and acquisition attempts",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ScopeFlags, parser.add_mutually_exclusive_group())
    add_flags(parser, OperatorFlags, describe=stating_default)
    election = parser.add_argument_group("leader election (several replicas, one active)")
    add_flags(parser, ElectionFlags, election, describe=stating_default)


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    if not args.namespace and not args.all_namespaces:
        raise SystemExit("pdserve operator: give --namespace NS (repeatable) or --all-namespaces")
    if args.workers < 1:
        raise SystemExit("pdserve operator: --workers must be at least 1")
    taken = unavailable(
        [(args.bind, args.metrics_port, "--metrics-port"), (args.bind, args.liveness_port, "--liveness-port")]
    )
    if taken:
        raise SystemExit(f"pdserve operator: {taken}")
    if args.otlp_traces_endpoint:
        _check_tracing(args.otlp_traces_endpoint)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    election = election_config(args)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    logging.getLogger("pdserve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # one "Handler ... succeeded" line per watch event is noise
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.bind)
    # Bound to kopf's loop on first use and set on it (handlers.startup). A threading.Event would
    # leave one of kopf's executor threads waiting on it at exit.
    stop = asyncio.Event()
    elector = _elector(election, args.kubeconfig) if election is not None else None

    options = OperatorOptions(
        resync_seconds=args.resync_seconds,
        debounce_seconds=args.debounce_ms / 1000.0,
        workers=args.workers,
        kubeconfig=args.kubeconfig,
        elector=elector,
        stop=stop,
        pdserve_image=args.pdserve_image,
        traces_endpoint=args.otlp_traces_endpoint,
    )
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    import pdserve.operator.control.handlers  # noqa: F401 - registers the handlers

    kopf.run(
        standalone=True,
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        memo=kopf.Memo(options=options),
        stop_flag=stop,
    )
    if elector is not None and elector.lost is not None:
        return 1
    return 0


def election_config(args: argparse.Namespace) -> ElectionConfig | None:
    """The election settings from the flags, or None without election (--no-leader-elect, or
    by default where no namespace for the Lease is known: a warning says so); SystemExit if invalid."""
    if args.leader_elect is False:
        return None
    problems = validate(args.lease_duration, args.renew_deadline, args.retry_period)
    if problems:
        raise SystemExit("pdserve operator: " + "; ".join(problems))
    namespace = args.leader_election_namespace or default_namespace()
    if not namespace and args.leader_elect is None:
        print(
            "pdserve operator: warning: no namespace for the leader-election Lease (not in a pod, no "
            "--leader-election-namespace, no $POD_NAMESPACE): running as a single replica without "
            "leader election; do not run a second operator against this cluster, or give "
            "--leader-election-namespace NS",
            file=sys.stderr,
            flush=True,
        )
        return None
    if not namespace:
        raise SystemExit(
            "pdserve operator: leader election needs a namespace for its Lease: pass "
            "--leader-election-namespace NS (or set POD_NAMESPACE), or --no-leader-elect to run a "
            "single replica without election"
        )
    if not args.leader_election_id:
        raise SystemExit("pdserve operator: --leader-election-id must not be empty")
    return ElectionConfig(
        namespace=namespace,
        name=args.leader_election_id,
        identity=default_identity(),
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
    )


def _elector(config: ElectionConfig, kubeconfig: str | None) -> LeaderElector:
    from pdserve.operator.cluster.kube import Kube
    from pdserve.operator.control.leader import LeaderElector

    # Its own small connection pool and no fence: a busy reconciler never delays a renewal.
    return LeaderElector(config, Kube(kubeconfig, pool_size=2))


def _check_tracing(endpoint: str) -> None:
    """An unusable endpoint, or tracing without the SDK: say so before anything starts."""
    from pdserve.tracing.endpoint import EndpointError, parse_endpoint
    from pdserve.tracing.sdk import TracingUnavailable, check_available

    try:
        parse_endpoint(endpoint)
        check_available()
    except (EndpointError, TracingUnavailable) as exc:
        raise SystemExit(f"pdserve operator: --otlp-traces-endpoint: {exc}") from None
