"""The router's own objects: its Deployment running ``pdserve proxy``, its client Service, and
the RBAC with which it watches the routing ConfigMap.

The router pods watch ``NAME-routing`` through the API server as ServiceAccount
``NAME-router``, whose Role ``NAME-router`` (bound by RoleBinding ``NAME-router``) grants
get/list/watch on that one ConfigMap (``resourceNames``) and nothing else. A router template
may not set ``serviceAccountName`` (spec/owned.py), so the account is always this one. With
``spec.router.placement: decode-sidecar`` there is no Deployment: a ``router`` container in
every decode pod (decode_sidecar.py), and the Service selects the decode pods. A client
sidecar (client_sidecar.py) reuses the Deployment's container and the RBAC rules from here.
"""

from __future__ import annotations

from typing import Any

from pdserve.deployment.render.decode_sidecar import SIDECAR_PORT_NAME
from pdserve.deployment.render.defaults import (
    ROUTER_PRESTOP_SECONDS,
    ROUTER_TERMINATION_GRACE_SECONDS,
    router_args,
)
from pdserve.deployment.render.names import (
    COMPONENT,
    DEPLOYMENT_LABEL,
    labels,
    namespaced,
    object_metadata,
    role_selector,
    router_account_name,
    router_name,
    routing_configmap_name,
    selector_string,
)
from pdserve.deployment.render.security import router_admin_args, router_admin_port, router_key_env
from pdserve.deployment.render.tracing import router_tracing_env
from pdserve.deployment.spec.pddeployment import DEFAULT_IMAGE, PDDeployment
from pdserve.deployment.spec.podtemplate import merge_metadata, merge_pod_spec
from pdserve.routing import Role


def router_deployment(pdd: PDDeployment) -> dict[str, Any]:
    """The router Deployment: its admin port and keys (security.py), then ``spec.router.template``."""
    deployment = _router_deployment(pdd)
    pod = deployment["spec"]["template"]
    router = next(c for c in pod["spec"]["containers"] if c["name"] == "router")
    router["args"] += router_admin_args(pdd.spec)
    router["ports"].append(router_admin_port(pdd.spec))
    if router_key_env(pdd.spec):
        router["env"] = router.get("env", []) + router_key_env(pdd.spec)
    # pdserve's own image runs as user 10001 and needs no privilege.
    pod["spec"].setdefault(
        "securityContext", {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    )
    router.setdefault(
        "securityContext", {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    )
    template = pdd.spec.router.template
    pod["metadata"] = merge_metadata(pod["metadata"], template)
    pod["spec"] = merge_pod_spec(pod["spec"], template.spec)
    return deployment


def _router_deployment(pdd: PDDeployment) -> dict[str, Any]:
    router = pdd.spec.router
    selector = {DEPLOYMENT_LABEL: pdd.name, COMPONENT: "router"}
    container = {
        "name": "router",
        "image": router.image or DEFAULT_IMAGE,
        "command": ["pdserve"],
        "args": router_args(pdd.spec, routing_configmap_name(pdd), router.port),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *router_tracing_env(pdd, define_pod_name=True),
        ],
        # Ready only with a table that has a routable slot per role; 503 at once on SIGTERM.
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        # Out of the Service's endpoints before SIGTERM (defaults.ROUTER_PRESTOP_SECONDS).
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SECONDS}}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(pdd, router_name(pdd), "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector},
            # One new router is up before an old one goes: the Service never loses every endpoint.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(pdd, "router")},
                "spec": {
                    "enableServiceLinks": False,
                    # The token is how the router watches its routing ConfigMap.
                    "serviceAccountName": router_account_name(pdd),
                    "automountServiceAccountToken": True,
                    "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_SECONDS,
                    "containers": [container],
                },
            },
        },
    }


def routing_reader_rbac(
    configmap: str, account: dict[str, Any], role: dict[str, Any], binding: dict[str, Any]
) -> list[dict[str, Any]]:
    """A ServiceAccount, a Role that reads only ``configmap`` (by name: the one object a router
    reads) and the RoleBinding of the Role to the account; the arguments are their metadata. The
    router Deployment's account and a client sidecar's get the same rules from here."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": role,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [configmap],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": binding,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["name"]},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": account["name"],
                    **namespaced(account.get("namespace", "")),
                }
            ],
        },
    ]


def router_rbac(pdd: PDDeployment) -> list[dict[str, Any]]:
    """The router's ServiceAccount, Role and RoleBinding (all named ``<name>-router``)."""
    account, role, binding = (object_metadata(pdd, router_account_name(pdd), "router") for _ in range(3))
    return routing_reader_rbac(routing_configmap_name(pdd), account, role, binding)


def router_service(pdd: PDDeployment) -> dict[str, Any]:
    """The client Service: the router pods, or with placement decode-sidecar the decode pods'
    router container (a draining decode pod turns unready first, so it leaves the endpoints)."""
    router = pdd.spec.router
    selector = {DEPLOYMENT_LABEL: pdd.name, COMPONENT: "router"}
    target = "http"
    if router.decode_sidecar:
        selector, target = role_selector(pdd, Role.DECODE), SIDECAR_PORT_NAME
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(pdd, pdd.name, "router"),
        "spec": {
            "type": router.service_type,
            "selector": selector,
            "ports": [{"name": "http", "port": router.port, "targetPort": target, "protocol": "TCP"}],
        },
    }


def router_pod_selector(pdd: PDDeployment) -> str:
    """The pods that run a router (what the operator asks ``/routing/served``), as a label selector."""
    if pdd.spec.router.decode_sidecar:
        return selector_string(role_selector(pdd, Role.DECODE))
    return selector_string({DEPLOYMENT_LABEL: pdd.name, COMPONENT: "router"})
