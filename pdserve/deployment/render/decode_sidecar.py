"""``spec.router.placement: decode-sidecar``: the router as a container of every decode pod.

What the decode pod gets (pure; engine_pod.py puts it into the pod before the decode template is
merged, so the placement is part of the decode template hash and changing it rolls decode):

* a ``router`` container running ``pdserve proxy --local-decode http://$(POD_IP):<engine port>``
  on :data:`SIDECAR_PORT` (the engine has the pod's 8000), with the routing ConfigMap watch, the
  spec's policy, backlog, admin port and keys, the engine's DP size and pairing revision as
  flags, and its pod name and instance index from the downward API (the prefill offset);
* readiness on its ``/ready``: 200 only while the local engine answers ``/health``, the table has
  a routable prefill of the engine's revision, and the operator has not marked the pod draining;
  with the engine's own probe, the pod is Ready only when both are;
* the router's ServiceAccount, with the token mounted into the ``router`` container only: the pod
  keeps ``automountServiceAccountToken: false``, so the engine (which runs model code) holds no
  API credentials. The projected volume is what automount would give (token, CA, namespace).

The client Service ``<name>`` then selects the decode pods' ``router`` port (:func:`service_selector`),
and no router Deployment is rendered.
"""

from __future__ import annotations

from typing import Any

from pdserve.deployment.render.defaults import (
    ROUTER_PRESTOP_SECONDS,
    ROUTER_SHUTDOWN_GRACE_SECONDS,
    router_args,
)
from pdserve.deployment.render.security import router_admin_args, router_admin_port, router_key_env
from pdserve.deployment.render.tracing import router_tracing_env
from pdserve.deployment.spec.owned import ROUTER_CONTAINER
from pdserve.deployment.spec.pddeployment import DEFAULT_IMAGE, ENGINE_PORT, PDDeployment
from pdserve.deployment.spec.podtemplate import merge_pod_spec

#: The sidecar's client port inside a decode pod (the engine listens on ENGINE_PORT).
SIDECAR_PORT = 8200
SIDECAR_PORT_NAME = "proxy"
TOKEN_VOLUME = "router-token"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_SECONDS = 3607  # what the kubelet's automount asks for


def sidecar_container(pdd: PDDeployment, configmap: str, revision: str) -> dict[str, Any]:
    router = pdd.spec.router
    spec = pdd.spec
    container: dict[str, Any] = {
        "name": ROUTER_CONTAINER,
        "image": router.image or DEFAULT_IMAGE,
        "command": ["pdserve"],
        "args": [
            *router_args(spec, configmap, SIDECAR_PORT),
            "--local-decode",
            # The pod's own IP, not localhost: same pod either way, and it also holds where
            # containers share the node's network but bind their pod IP (the test cluster's runner).
            f"http://$(POD_IP):{ENGINE_PORT}",
            "--local-dp-size",
            str(spec.decode.data_parallel),
            "--local-revision",
            revision,
            *router_admin_args(spec),
        ],
        "ports": [
            {"name": SIDECAR_PORT_NAME, "containerPort": SIDECAR_PORT, "protocol": "TCP"},
            router_admin_port(spec),
        ],
        "env": [
            _field("POD_NAMESPACE", "metadata.namespace"),
            _field("POD_NAME", "metadata.name"),
            _field("POD_IP", "status.podIP"),
            _field("PDSERVE_INSTANCE_INDEX", "metadata.labels['pdserve.io/instance']"),
            *router_key_env(spec),
            *router_tracing_env(pdd, define_pod_name=False),
        ],
        # The engine's health, a prefill to pair with, and not draining (pdserve.proxy.admin.readiness).
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": SIDECAR_PORT_NAME},
            "periodSeconds": 2,
            "failureThreshold": 2,
            "timeoutSeconds": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": SIDECAR_PORT_NAME},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SECONDS}}},
        "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": TOKEN_PATH, "readOnly": True}],
        # pdserve's image runs as user 10001 and needs no privilege, whatever the engine's image needs.
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    # spec.router.template's router container (env, resources, ...) applies to the sidecar;
    # everything else of that template is refused with this placement (validate.py).
    tuned = [c for c in router.template.spec.get("containers") or [] if c.get("name") == ROUTER_CONTAINER]
    if tuned:
        merged = merge_pod_spec({"containers": [container]}, {"containers": tuned})
        container = merged["containers"][0]
    return container


def token_volume() -> dict[str, Any]:
    """What ``automountServiceAccountToken`` mounts, as a volume for the router container only."""
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_SECONDS}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]
                    }
                },
            ],
        },
    }


def add_sidecar(pod: dict[str, Any], pdd: PDDeployment, configmap: str, account: str, revision: str) -> None:
    """Put the router into a rendered decode pod spec (before the decode template is merged)."""
    pod["containers"].append(sidecar_container(pdd, configmap, revision))
    pod["volumes"].append(token_volume())
    pod["serviceAccountName"] = account
    pod["automountServiceAccountToken"] = False  # the engine gets no token; the router its own
    pod["terminationGracePeriodSeconds"] = max(
        int(pod.get("terminationGracePeriodSeconds") or 0),
        ROUTER_PRESTOP_SECONDS + ROUTER_SHUTDOWN_GRACE_SECONDS + 5,
    )


def template_problems(pdd: PDDeployment) -> list[str]:
    """With the router in the decode pods, only ``spec.router.template``'s router container applies."""
    if not pdd.spec.router.decode_sidecar:
        return []
    template = pdd.spec.router.template
    where = "spec.router.template"
    why = (
        "with placement decode-sidecar the router runs in the decode pods: only "
        "template.spec.containers[router] applies to it; set pod settings in spec.decode.template"
    )
    found = [f"{where}.metadata: {why}"] if template.labels or template.annotations else []
    found += [f"{where}.spec.{key}: {why}" for key in template.spec if key != "containers"]
    for i, c in enumerate(template.spec.get("containers") or []):
        if c.get("name") != ROUTER_CONTAINER:
            found.append(f"{where}.spec.containers[{i}]: {why}")
    return found


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
