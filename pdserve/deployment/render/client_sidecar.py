"""The router as a sidecar of a client application (``pdserve render sidecar FILE``).

An application that calls the model can run ``pdserve proxy`` in its own pod and send its
requests to ``http://127.0.0.1:<port>``: no shared router in the path, one hop less. What that
pod needs, rendered from the operator's own router pieces (no second copy of them):

* the ``router`` container of the router Deployment
  (:func:`pdserve.deployment.render.router.router_deployment`: image, flags, keys,
  ``spec.router.template``'s router container), with its client port on
  127.0.0.1 (only the application reaches it) and its admin port (probes, metrics, ``/debug``)
  on the pod's address (``--admin-host 0.0.0.0``): the kubelet probes the admin port;
* the routing ConfigMap ``NAME-routing`` watched through the API server, in the PDDeployment's
  namespace (``$(POD_NAMESPACE)`` when the application runs there too);
* the API token for that watch as a projected volume mounted into the ``router`` container only
  (:func:`pdserve.deployment.render.decode_sidecar.token_volume`, what the decode sidecar
  gets), so the pod can keep ``automountServiceAccountToken: false`` and the application holds
  no API credentials;
* RBAC: a Role in the PDDeployment's namespace that reads that one ConfigMap (the rules of the
  router's own Role) and a RoleBinding for the application's ServiceAccount, plus that
  ServiceAccount.

The names are fixed so that the chart's ``clientSidecars`` value renders the same objects:
Role ``NAME-routing-reader``, RoleBinding ``NAME-routing-reader-ACCOUNT`` (names.py).
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.deployment.render.decode_sidecar import SIDECAR_PORT, TOKEN_PATH, TOKEN_VOLUME, token_volume
from pdserve.deployment.render.names import (
    client_account_name,
    client_binding_name,
    client_role_name,
    namespaced,
    routing_configmap_name,
)
from pdserve.deployment.render.router import router_deployment, routing_reader_rbac
from pdserve.deployment.render.security import ADMIN_PORT_NAME
from pdserve.deployment.spec.owned import ROUTER_CONTAINER
from pdserve.deployment.spec.pddeployment import PDDeployment

LOCALHOST = "127.0.0.1"
#: Labels of the client RBAC objects; not the operator's (it neither owns nor prunes them).
PART_OF = "app.kubernetes.io/part-of"


def client_router_container(
    pdd: PDDeployment, namespace: str | None = None, port: int = SIDECAR_PORT, admin_port: int | None = None
) -> dict[str, Any]:
    """The router Deployment's container, moved next to an application in ``namespace``
    (default: the PDDeployment's): API on 127.0.0.1:``port``, probes on the admin port."""
    pod = router_deployment(pdd)["spec"]["template"]["spec"]
    container: dict[str, Any] = copy.deepcopy(
        next(c for c in pod["containers"] if c["name"] == ROUTER_CONTAINER)
    )
    admin = pdd.spec.router.admin_port if admin_port is None else admin_port
    configmap = routing_configmap_name(pdd)
    same_namespace = namespace is None or namespace == pdd.namespace
    source = f"$(POD_NAMESPACE)/{configmap}" if same_namespace else f"{pdd.namespace}/{configmap}"
    args = list(container["args"])
    for flag, value in (
        ("--routing-configmap", source),
        ("--host", LOCALHOST),
        ("--port", str(port)),
        ("--admin-port", str(admin)),
    ):
        args[args.index(flag) + 1] = value
    container["args"] = [*args, "--admin-host", "0.0.0.0"]
    # Only the admin port is reachable from outside the pod: the kubelet probes it.
    container["ports"] = [{"name": ADMIN_PORT_NAME, "containerPort": admin, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe"):
        if probe in container:
            container[probe]["httpGet"]["port"] = ADMIN_PORT_NAME
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_PATH, "readOnly": True},
    ]
    # The router Deployment sets runAsNonRoot on its pod; an application's pod is not ours to set.
    container["securityContext"] = {"runAsNonRoot": True, **container.get("securityContext", {})}
    return container


def client_pod_patch(
    pdd: PDDeployment,
    account: str | None = None,
    namespace: str | None = None,
    port: int = SIDECAR_PORT,
    admin_port: int | None = None,
) -> dict[str, Any]:
    """What to add to an application's Deployment, as a strategic merge patch (containers and
    volumes merge by name): ``kubectl patch deployment APP --patch-file FILE``."""
    return {
        "spec": {
            "template": {
                "spec": {
                    "serviceAccountName": account or client_account_name(pdd),
                    # The router container mounts its own token; the application gets none.
                    "automountServiceAccountToken": False,
                    "containers": [client_router_container(pdd, namespace, port, admin_port)],
                    "volumes": [token_volume()],
                }
            }
        }
    }


def _client_labels(pdd: PDDeployment) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/component": "client-sidecar",
        PART_OF: pdd.name,
    }


def client_rbac(
    pdd: PDDeployment, account: str | None = None, namespace: str | None = None
) -> list[dict[str, Any]]:
    """The ServiceAccount (in the application's ``namespace``), and in the PDDeployment's
    namespace the Role that reads the routing ConfigMap and its RoleBinding to that account."""
    account = account or client_account_name(pdd)
    app_namespace = namespace or pdd.namespace
    role = client_role_name(pdd)

    def meta(name: str, namespace: str) -> dict[str, Any]:
        return {"name": name, **namespaced(namespace), "labels": _client_labels(pdd)}

    # The rules are the router's own: get/list/watch on NAME-routing.
    return routing_reader_rbac(
        routing_configmap_name(pdd),
        account=meta(account, app_namespace),
        role=meta(role, pdd.namespace),
        binding=meta(client_binding_name(pdd, account), pdd.namespace),
    )
