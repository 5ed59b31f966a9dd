"""Keys and ports of the router and the engines, rendered from Secret references.

* ``spec.router.apiKeySecretRef``: the router's ``PDSERVE_PROXY_API_KEY`` (clients must send
  ``Authorization: Bearer <key>``; probes stay open).
* ``spec.engineApiKeySecretRef``: the engines' ``VLLM_API_KEY`` (vLLM then requires the key on
  ``/v1/*``; ``/health`` and ``/metrics`` stay open, as in vLLM) and the router's
  ``PDSERVE_BACKEND_API_KEY``, so the router sends it instead of the client's header.
* ``spec.router.adminPort``: ``pdserve proxy --admin-port``, a container port named ``admin``
  serving ``/metrics``, ``/debug/*`` and profiling (pdserve/proxy/serving/ports.py); the client Service
  exposes only the client port.

Every key reaches the container as an environment variable from a ``secretKeyRef``: the kubelet
reads the Secret, the operator never does, and no key is ever a command-line argument (which
``ps`` and the pod spec would show).
"""

from __future__ import annotations

from typing import Any

from pdserve.deployment.spec.owned import Reserved
from pdserve.deployment.spec.pddeployment import PDDeploymentSpec

ADMIN_PORT_NAME = "admin"


def engine_key_env(spec: PDDeploymentSpec) -> list[dict[str, Any]]:
    ref = spec.engine_api_key_secret_ref
    return [] if ref is None else [{"name": "VLLM_API_KEY", "valueFrom": ref.env_source()}]


def router_key_env(spec: PDDeploymentSpec) -> list[dict[str, Any]]:
    env = []
    if spec.router.api_key_secret_ref is not None:
        env.append(
            {"name": "PDSERVE_PROXY_API_KEY", "valueFrom": spec.router.api_key_secret_ref.env_source()}
        )
    if spec.engine_api_key_secret_ref is not None:
        env.append(
            {"name": "PDSERVE_BACKEND_API_KEY", "valueFrom": spec.engine_api_key_secret_ref.env_source()}
        )
    return env


def router_admin_args(spec: PDDeploymentSpec) -> list[str]:
    return ["--admin-port", str(spec.router.admin_port)]


def router_admin_port(spec: PDDeploymentSpec) -> dict[str, Any]:
    return {"name": ADMIN_PORT_NAME, "containerPort": spec.router.admin_port, "protocol": "TCP"}


def engine_reserved_env(spec: PDDeploymentSpec) -> dict[str, str]:
    if spec.engine_api_key_secret_ref is None:
        return {}
    return {"VLLM_API_KEY": "is set by pdserve from spec.engineApiKeySecretRef"}


def router_reserved(spec: PDDeploymentSpec) -> Reserved:
    env = {
        "PDSERVE_PROXY_ADMIN_PORT": "is set by pdserve from spec.router.adminPort",
        "POD_NAMESPACE": "is set by pdserve (the namespace of the routing ConfigMap the router watches)",
    }
    if spec.router.api_key_secret_ref is not None:
        env["PDSERVE_PROXY_API_KEY"] = "is set by pdserve from spec.router.apiKeySecretRef"
    if spec.engine_api_key_secret_ref is not None:
        env["PDSERVE_BACKEND_API_KEY"] = "is set by pdserve from spec.engineApiKeySecretRef"
    return Reserved(env=env)
