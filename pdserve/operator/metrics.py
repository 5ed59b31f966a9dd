"""Prometheus metrics of the operator, served by ``pdserve operator --metrics-port``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
