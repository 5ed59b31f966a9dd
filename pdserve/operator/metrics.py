"""Prometheus metrics of the operator, served by ``pdserve operator --metrics-port``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from pdserve.wire.prometheus import Family, register

if TYPE_CHECKING:
    from pdserve.deployment.plan.autoscale import Decision

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_ROLE = ("namespace", "deployment", "role")

#: The operator's families, by the name of the module attribute that counts them.
FAMILIES: dict[str, Family] = {
    "RECONCILES": Family(
        "pdserve_operator_reconciles",
        "counter",
        "Reconciles run, by result (ok, invalid, error).",
        ("result",),
    ),
    "RECONCILE_ERRORS": Family(
        "pdserve_operator_reconcile_errors",
        "counter",
        "Reconciles that failed with an API or unexpected error.",
    ),
    "RECONCILE_SECONDS": Family(
        "pdserve_operator_reconcile_duration_seconds",
        "histogram",
        "Wall time of one reconcile of one PDDeployment.",
        buckets=_SECONDS,
    ),
    "ROUTING_WRITES": Family(
        "pdserve_operator_routing_table_writes",
        "counter",
        "Writes of a routing ConfigMap (only when its content changed).",
    ),
    "REQUESTS_COALESCED": Family(
        "pdserve_operator_requests_coalesced",
        "counter",
        "Reconcile requests folded into one already scheduled for the same PDDeployment.",
    ),
    "OBJECT_CHANGES": Family(
        "pdserve_operator_object_changes",
        "counter",
        "Objects created, updated or deleted by the operator, by kind and action.",
        ("kind", "action"),
    ),
    "API_REQUESTS": Family(
        "pdserve_operator_api_request_seconds",
        "histogram",
        "Requests sent to the Kubernetes API server (Events included) and their latency, by HTTP method.",
        ("method",),
        buckets=_SECONDS,
    ),
    "DRAINS": Family(
        "pdserve_operator_drains",
        "counter",
        "Drains ended, by what ended them (routers-idle, timeout, no-routers).",
        ("reason",),
    ),
    "ROUTER_QUERIES": Family(
        "pdserve_operator_router_queries",
        "counter",
        "GET /routing/served sent to router pods, by outcome (answered, error).",
        ("outcome",),
    ),
    "NODE_LOSS_REPLACEMENTS": Family(
        "pdserve_operator_node_loss_replacements",
        "counter",
        "Instance pods deleted and replaced because their node was NotReady past rollout.nodeLossSeconds.",
    ),
    "GROUP_REPLACEMENTS": Family(
        "pdserve_operator_group_replacements",
        "counter",
        "Multi-node instances deleted whole and replaced: a member failed or left, or the gang timed out.",
    ),
    "LEADER": Family(
        "pdserve_operator_leader",
        "gauge",
        "1 while this replica holds the leader lease (and reconciles), 0 while it follows.",
        ("identity",),
    ),
    "LEADER_TRANSITIONS": Family(
        "pdserve_operator_leader_transitions",
        "counter",
        "Changes of the leader lease's holder seen by this replica (its own takeovers included).",
    ),
    "FENCED_WRITES": Family(
        "pdserve_operator_fenced_writes",
        "counter",
        "Writes refused before being sent because this replica did not hold a fresh leader lease.",
    ),
    # the autoscaler (spec.autoscaling): its decisions, with the figures they were made on
    "AUTOSCALER_DECISIONS": Family(
        "pdserve_operator_autoscaler_decisions",
        "counter",
        "Autoscaler decisions, by result (scaled, unchanged, no_signal: no router answered).",
        ("result",),
    ),
    "AUTOSCALER_SCALE_EVENTS": Family(
        "pdserve_operator_autoscaler_scale_events",
        "counter",
        "Counts the autoscaler changed, by deployment, role and direction (up, down).",
        (*_ROLE, "direction"),
    ),
    "AUTOSCALER_DESIRED": Family(
        "pdserve_operator_autoscaler_desired_instances",
        "gauge",
        "Instances the autoscaler wants, by deployment and role.",
        _ROLE,
    ),
    "AUTOSCALER_RECOMMENDED": Family(
        "pdserve_operator_autoscaler_recommended_instances",
        "gauge",
        "The last decision's recommendation before stabilisation, step limits, holds and the ratio.",
        _ROLE,
    ),
    "AUTOSCALER_RATIO": Family(
        "pdserve_operator_autoscaler_objective_ratio",
        "gauge",
        "The role's measured percentile over its objective (prefill: TTFT, decode: ITL); absent with too "
        "few requests.",
        _ROLE,
    ),
    "AUTOSCALER_LATENCY": Family(
        "pdserve_operator_autoscaler_latency_seconds",
        "gauge",
        "The objectives' percentile of TTFT and ITL over the window, as the routers measured them.",
        ("namespace", "deployment", "objective"),
    ),
    "AUTOSCALER_LIMITED": Family(
        "pdserve_operator_autoscaler_limited",
        "gauge",
        "1 while the last decision was held back (TooManyInstances, TooFewInstances, InsufficientResources).",
        (*_ROLE, "reason"),
    ),
}
# Typed module constants for the callers (metrics.RECONCILES...); FAMILIES says what each is.
_METRICS = register(FAMILIES, REGISTRY)
RECONCILES: Counter = _METRICS["RECONCILES"]
RECONCILE_ERRORS: Counter = _METRICS["RECONCILE_ERRORS"]
RECONCILE_SECONDS: Histogram = _METRICS["RECONCILE_SECONDS"]
ROUTING_WRITES: Counter = _METRICS["ROUTING_WRITES"]
REQUESTS_COALESCED: Counter = _METRICS["REQUESTS_COALESCED"]
OBJECT_CHANGES: Counter = _METRICS["OBJECT_CHANGES"]
API_REQUESTS: Histogram = _METRICS["API_REQUESTS"]
DRAINS: Counter = _METRICS["DRAINS"]
ROUTER_QUERIES: Counter = _METRICS["ROUTER_QUERIES"]
NODE_LOSS_REPLACEMENTS: Counter = _METRICS["NODE_LOSS_REPLACEMENTS"]
GROUP_REPLACEMENTS: Counter = _METRICS["GROUP_REPLACEMENTS"]
LEADER: Gauge = _METRICS["LEADER"]
LEADER_TRANSITIONS: Counter = _METRICS["LEADER_TRANSITIONS"]
FENCED_WRITES: Counter = _METRICS["FENCED_WRITES"]
AUTOSCALER_DECISIONS: Counter = _METRICS["AUTOSCALER_DECISIONS"]
AUTOSCALER_SCALE_EVENTS: Counter = _METRICS["AUTOSCALER_SCALE_EVENTS"]
AUTOSCALER_DESIRED: Gauge = _METRICS["AUTOSCALER_DESIRED"]
AUTOSCALER_RECOMMENDED: Gauge = _METRICS["AUTOSCALER_RECOMMENDED"]
AUTOSCALER_RATIO: Gauge = _METRICS["AUTOSCALER_RATIO"]
AUTOSCALER_LATENCY: Gauge = _METRICS["AUTOSCALER_LATENCY"]
AUTOSCALER_LIMITED: Gauge = _METRICS["AUTOSCALER_LIMITED"]
_AUTOSCALED: dict[tuple[str, str], set[tuple[Gauge, tuple[str, ...]]]] = {}


def record_decision(namespace: str, deployment: str, decision: Decision, known: bool) -> None:
    """One decision's figures; series it no longer has (a ratio without samples, a lifted limit) go."""
    result = "no_signal" if not known else "scaled" if decision.changed else "unchanged"
    AUTOSCALER_DECISIONS.labels(result).inc()
    now: set[tuple[Gauge, tuple[str, ...]]] = set()

    def put(gauge: Gauge, labels: tuple[str, ...], value: float) -> None:
        gauge.labels(*labels).set(value)
        now.add((gauge, labels))

    for role in ("prefill", "decode"):
        d = decision.role(role)
        put(AUTOSCALER_DESIRED, (namespace, deployment, role), d.after)
        put(AUTOSCALER_RECOMMENDED, (namespace, deployment, role), d.recommendation)
        if d.ratio is not None:
            put(AUTOSCALER_RATIO, (namespace, deployment, role), d.ratio)
        if d.after != d.before:
            direction = "up" if d.after > d.before else "down"
            AUTOSCALER_SCALE_EVENTS.labels(namespace, deployment, role, direction).inc()
    for objective, key in (("ttft", "ttft_ms"), ("itl", "itl_ms")):
        value = decision.measured[key]
        if value is not None:
            put(AUTOSCALER_LATENCY, (namespace, deployment, objective), value / 1000)
    for limit in decision.limits:
        put(AUTOSCALER_LIMITED, (namespace, deployment, limit.role, limit.reason), 1)
    for gauge, labels in _AUTOSCALED.get((namespace, deployment), set()) - now:
        gauge.remove(*labels)
    _AUTOSCALED[(namespace, deployment)] = now


def forget_autoscaler(namespace: str, deployment: str) -> None:
    """The deployment is gone, or autoscaling was turned off: its series go."""
    for gauge, labels in _AUTOSCALED.pop((namespace, deployment), set()):
        gauge.remove(*labels)
