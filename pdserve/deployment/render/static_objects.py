"""The objects that follow from the spec alone, and the set of them the operator applies.

Besides the router's (router.py): the headless Service ``NAME-engines`` that gives each engine
pod its DNS name (not-ready pods included), and one PodDisruptionBudget per role. The pods
(engine_pod.py, groups.py) and the routing ConfigMap (routing_table.py) depend on state and
are rendered apart.
"""

from __future__ import annotations

from typing import Any

from pdserve.deployment.render.names import (
    DEPLOYMENT_LABEL,
    TIER_LABEL,
    disruption_budget_name,
    engine_service_name,
    object_metadata,
    role_selector,
)
from pdserve.deployment.render.router import router_deployment, router_rbac, router_service
from pdserve.deployment.spec.pddeployment import ENGINE_PORT, PDDeployment
from pdserve.routing import Role


def engine_service(pdd: PDDeployment) -> dict[str, Any]:
    """Headless: gives each engine pod a stable DNS name; the router itself routes by pod IP."""
    meta = object_metadata(pdd, engine_service_name(pdd), "engine")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {DEPLOYMENT_LABEL: pdd.name, TIER_LABEL: "engine"},
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def disruption_budget(pdd: PDDeployment, role: Role) -> dict[str, Any]:
    """The role's PodDisruptionBudget: evictions may leave at most maxUnavailable instances not Ready.

    Rendered as an integer ``minAvailable`` (instances minus the allowed count), because for
    ``maxUnavailable`` and percentages the disruption controller reads the expected count from
    the pods' controller's scale subresource, and the PDDeployment's scale is decode's: a
    prefill budget would be computed against decode's instances. An integer minAvailable is
    counted against the pods that exist. ``AlwaysAllow`` lets a drain evict a pod that is
    running but not Ready (crashlooping, or still loading its model), which serves nothing, even
    when the budget is spent, so one broken pod cannot block a node's drain.

    A multi-node role's budget counts pods, not groups: minAvailable is its pods minus the
    allowed instances. Evicting one pod takes its whole group down (vLLM cannot lose a member),
    so each allowed eviction may cost one instance, and maxUnavailable stays a bound on
    instances; two evictions from one group cost one instance but spend two.
    """
    rs = pdd.spec.role(role)
    pods = rs.instances * pdd.spec.group_shape(role).nodes
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_metadata(pdd, disruption_budget_name(pdd, role), role.value),
        "spec": {
            "minAvailable": pods - rs.disruption_budget.allowed(rs.instances),
            "selector": {"matchLabels": role_selector(pdd, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def desired_static_objects(pdd: PDDeployment) -> list[dict[str, Any]]:
    """Objects whose content follows from the spec alone (no pod state): Services, the router's
    account and its read access to the routing ConfigMap, the router, and the roles' disruption
    budgets (also for a role of 0 instances: minAvailable 0 over no pods, so nothing to prune)."""
    router = [] if pdd.spec.router.decode_sidecar else [router_deployment(pdd)]
    return [
        engine_service(pdd),
        router_service(pdd),
        *router_rbac(pdd),
        *router,
        disruption_budget(pdd, Role.PREFILL),
        disruption_budget(pdd, Role.DECODE),
    ]
