"""Prometheus metrics of the operator, served by ``pdserve operator --metrics-port``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from pdserve.deployment.plan.autoscale import Decision

RECONCILES = Counter(
    "pdserve_operator_reconciles_total",
    "Reconciles run, by result (ok, invalid, error).",
    ["result"],
)
RECONCILE_ERRORS = Counter(
    "pdserve_operator_reconcile_errors_total",
    "Reconciles that failed with an API or unexpected error.",
)
RECONCILE_SECONDS = Histogram(
    "pdserve_operator_reconcile_duration_seconds",
    "Wall time of one reconcile of one PDDeployment.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ROUTING_WRITES = Counter(
    "pdserve_operator_routing_table_writes_total",
    "Writes of a routing ConfigMap (only when its content changed).",
)
REQUESTS_COALESCED = Counter(
    "pdserve_operator_requests_coalesced_total",
    "Reconcile requests folded into one already scheduled for the same PDDeployment.",
)
OBJECT_CHANGES = Counter(
    "pdserve_operator_object_changes_total",
    "Objects created, updated or deleted by the operator, by kind and action.",
    ["kind", "action"],
)
API_REQUESTS = Histogram(
    "pdserve_operator_api_request_seconds",
    "Requests sent to the Kubernetes API server (Events included) and their latency, by HTTP method.",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
DRAINS = Counter(
    "pdserve_operator_drains_total",
    "Drains ended, by what ended them (routers-idle, timeout, no-routers).",
    ["reason"],
)
ROUTER_QUERIES = Counter(
    "pdserve_operator_router_queries_total",
    "GET /routing/served sent to router pods, by outcome (answered, error).",
    ["outcome"],
)
NODE_LOSS_REPLACEMENTS = Counter(
    "pdserve_operator_node_loss_replacements_total",
    "Instance pods deleted and replaced because their node was NotReady past rollout.nodeLossSeconds.",
)
GROUP_REPLACEMENTS = Counter(
    "pdserve_operator_group_replacements_total",
    "Multi-node instances deleted whole and replaced: a member failed or left, or the gang timed out.",
)
LEADER = Gauge(
    "pdserve_operator_leader",
    "1 while this replica holds the leader lease (and reconciles), 0 while it follows.",
    ["identity"],
)
LEADER_TRANSITIONS = Counter(
    "pdserve_operator_leader_transitions_total",
    "Changes of the leader lease's holder seen by this replica (its own takeovers included).",
)
FENCED_WRITES = Counter(
    "pdserve_operator_fenced_writes_total",
    "Writes refused before being sent because this replica did not hold a fresh leader lease.",
)

# --- the autoscaler (spec.autoscaling): its decisions, with the figures they were made on ---------

AUTOSCALER_DECISIONS = Counter(
    "pdserve_operator_autoscaler_decisions_total",
    "Autoscaler decisions, by result (scaled, unchanged, no_signal: no router answered).",
    ["result"],
)
AUTOSCALER_SCALE_EVENTS = Counter(
    "pdserve_operator_autoscaler_scale_events_total",
    "Counts the autoscaler changed, by deployment, role and direction (up, down).",
    ["namespace", "deployment", "role", "direction"],
)
AUTOSCALER_DESIRED = Gauge(
    "pdserve_operator_autoscaler_desired_instances",
    "Instances the autoscaler wants, by deployment and role.",
    ["namespace", "deployment", "role"],
)
AUTOSCALER_RECOMMENDED = Gauge(
    "pdserve_operator_autoscaler_recommended_instances",
    "The last decision's recommendation before stabilisation, step limits, holds and the ratio.",
    ["namespace", "deployment", "role"],
)
AUTOSCALER_RATIO = Gauge(
    "pdserve_operator_autoscaler_objective_ratio",
    "The role's measured percentile over its objective (prefill: TTFT, decode: ITL); absent with too "
    "few requests.",
    ["namespace", "deployment", "role"],
)
AUTOSCALER_LATENCY = Gauge(
    "pdserve_operator_autoscaler_latency_seconds",
    "The objectives' percentile of TTFT and ITL over the window, as the routers measured them.",
    ["namespace", "deployment", "objective"],
)
AUTOSCALER_LIMITED = Gauge(
    "pdserve_operator_autoscaler_limited",
    "1 while the last decision was held back (TooManyInstances, TooFewInstances, InsufficientResources).",
    ["namespace", "deployment", "role", "reason"],
)
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
