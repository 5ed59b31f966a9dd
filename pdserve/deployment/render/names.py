"""What every rendered object is called and labelled, in one place.

The operator finds its objects by these names and labels, the chart's ``clientSidecars``
renders the same client names, and every builder (engine_pod.py, router.py, groups.py, the
sidecars) shares the metadata built here. Names of a PDDeployment ``NAME``:

* Pod ``NAME-<role>-<index>-<suffix>`` per instance, the suffix random and chosen by the
  operator, so a replacement can start while the pod it replaces still exists (surge, a pod
  stuck Terminating on a lost node); the index is the ``pdserve.io/instance`` label.
  ``hostname`` ``<role>-<index>-<suffix>`` + ``subdomain`` give it a DNS name. Rendered without
  a cluster (``pdserve render``, local mode) the suffix is left out.
* headless Service ``NAME-engines``; the router's Deployment, ServiceAccount, Role and
  RoleBinding ``NAME-router``; its Service ``NAME``; ConfigMap ``NAME-routing``;
  PodDisruptionBudgets ``NAME-prefill`` and ``NAME-decode``.
* a client sidecar's (client_sidecar.py): ServiceAccount ``NAME-client`` by default, Role
  ``NAME-routing-reader``, RoleBinding ``NAME-routing-reader-ACCOUNT``.

ownerReferences are left out when the object has no uid (a file rendered without a cluster),
since the API server refuses an empty uid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pdserve.deployment.spec.pddeployment import API_VERSION, KIND, PDDeployment
from pdserve.routing import Role

# Labels.
NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
DEPLOYMENT_LABEL = "pdserve.io/deployment"
ROLE_LABEL = "pdserve.io/role"
INSTANCE_LABEL = "pdserve.io/instance"
TEMPLATE_HASH_LABEL = "pdserve.io/template-hash"
TIER_LABEL = "pdserve.io/tier"  # "engine" on every engine pod: what the headless Service selects
# What an instance pod runs, recorded at creation: during a rollout that changes dataParallel the
# old pods keep serving with their old size, and the routing table must advertise that one.
DP_SIZE_ANNOTATION = "pdserve.io/dp-size"
TP_SIZE_ANNOTATION = "pdserve.io/tp-size"
# Likewise the pairing revision (pdserve.deployment.plan.revision): old pods keep theirs until replaced.
REVISION_ANNOTATION = "pdserve.io/revision"
# Pods of a multi-node instance (a group; only on those): the leader's pod name (pods backend) or
# the LeaderWorkerSet's name, the pod's node index in the group (0 = leader), and the group's size.
GROUP_LABEL = "pdserve.io/group"
GROUP_NODE_LABEL = "pdserve.io/group-node"
GROUP_SIZE_ANNOTATION = "pdserve.io/group-size"
#: On a group's leader once the operator created its workers: a worker missing after that is lost.
GROUP_FORMED_ANNOTATION = "pdserve.io/group-formed"
MANAGER = "pdserve-operator"


# --- names ------------------------------------------------------------------------------------


def instance_name(pdd: PDDeployment, role: Role, index: int, suffix: str = "") -> str:
    """``<name>-<role>-<index>``, plus ``-<suffix>`` for a pod the operator creates."""
    return f"{pdd.name}-{role.value}-{index}" + (f"-{suffix}" if suffix else "")


def instance_hostname(role: Role, index: int, suffix: str = "") -> str:
    """A DNS label (63 characters at most) under the ``<name>-engines`` subdomain."""
    return f"{role.value}-{index}" + (f"-{suffix}" if suffix else "")


def is_instance_name(pdd: PDDeployment, role: Role, index: int, name: str) -> bool:
    """Whether ``name`` is one of :func:`instance_name`'s, for any suffix."""
    base = instance_name(pdd, role, index)
    return name == base or (name.startswith(base + "-") and "-" not in name[len(base) + 1 :])


def _suffixed(suffix: str) -> Callable[[PDDeployment], str]:
    """The name ``<name>-<suffix>`` of one of the deployment's objects."""

    def name(pdd: PDDeployment) -> str:
        return f"{pdd.name}-{suffix}"

    return name


#: The headless Service whose subdomain names the engine pods.
engine_service_name = _suffixed("engines")
#: The router's Deployment.
router_name = _suffixed("router")
#: The routing table's ConfigMap.
routing_configmap_name = _suffixed("routing")
#: The router's ServiceAccount, Role and RoleBinding share this name.
router_account_name = _suffixed("router")
#: The default ServiceAccount of a client application (``--service-account``).
client_account_name = _suffixed("client")
#: The Role that lets a client sidecar read the routing ConfigMap (client_sidecar.py).
client_role_name = _suffixed("routing-reader")


def disruption_budget_name(pdd: PDDeployment, role: Role) -> str:
    return f"{pdd.name}-{role.value}"


def client_binding_name(pdd: PDDeployment, account: str) -> str:
    return f"{client_role_name(pdd)}-{account}"


def labels(pdd: PDDeployment, component: str) -> dict[str, str]:
    """Labels of every object: ``component`` is prefill, decode, router or routing."""
    return {
        NAME: "pdserve",
        INSTANCE: pdd.name,
        COMPONENT: component,
        MANAGED_BY: MANAGER,
        DEPLOYMENT_LABEL: pdd.name,
    }


def role_selector(pdd: PDDeployment, role: Role) -> dict[str, str]:
    """Matches the pods of one role: the scale subresource's ``status.<role>.selector``."""
    return {DEPLOYMENT_LABEL: pdd.name, ROLE_LABEL: role.value}


def selector_string(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items())


def owner_reference(pdd: PDDeployment) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pdd.name,
        "uid": pdd.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def namespaced(namespace: str) -> dict[str, str]:
    """``{"namespace": ...}``, or nothing for "" (the namespace ``kubectl apply -n`` gives). A
    ServiceAccount subject of a RoleBinding without one is the binding's own (RBAC's rule)."""
    return {"namespace": namespace} if namespace else {}


def object_metadata(pdd: PDDeployment, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **namespaced(pdd.namespace), "labels": labels(pdd, component)}
    if pdd.uid:
        meta["ownerReferences"] = [owner_reference(pdd)]
    return meta
