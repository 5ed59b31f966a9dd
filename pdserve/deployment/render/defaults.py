"""Engine and router pod defaults a platform team expects, each one overridable.

* **Requests:** an engine container without a CPU or memory request (or limit) of its own,
  after the role's ``resources`` and its template are merged, requests
  :data:`CPU_PER_GPU` CPUs and :data:`MEMORY_PER_GPU` of memory per GPU (the simulator a little).
  vLLM reads the weights through host memory while loading (a 70B bf16 checkpoint is 141 GB:
  32Gi x 8 GPUs leaves room), and its API server, tokenizer and one engine core per DP rank
  need CPUs. Set either in the role's ``resources`` or the template to replace it; a limit
  without a request also turns the default off (Kubernetes then requests the limit).
* **No API token:** ``automountServiceAccountToken: false``: an engine never calls the API.
* **Non-root where the image allows:** the simulator's image (pdserve's) runs as user 10001, so
  its pods set ``runAsNonRoot``; the official vLLM image runs as root (vLLM's Docker guide), so
  its pods only forbid privilege escalation. A template can set ``runAsUser`` for an image that
  allows it.
* **Startup:** the startup probe allows ``startupTimeoutSeconds`` (default 3600: a 70B
  checkpoint downloaded from the Hub at 100 MB/s takes about 25 minutes, then loading and CUDA
  graph capture) before the liveness probe may restart the pod; readiness and liveness probes
  have timeouts of their own.
* **Clean shutdown:** engine and router pods sleep in a ``preStop`` hook before their process
  gets SIGTERM (:data:`ENGINE_PRESTOP_SECONDS`, :data:`ROUTER_PRESTOP_SECONDS`), and their
  ``terminationGracePeriodSeconds`` covers that sleep plus the time in-flight requests need.
* **One router command line** for both placements (:func:`router_args`): the router Deployment
  and the decode sidecar watch the same ConfigMap with the same grace period and tuning.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pdserve.deployment.render.tracing import router_tracing_args

if TYPE_CHECKING:
    from pdserve.deployment.spec.pddeployment import PDDeploymentSpec

CPU_PER_GPU = 4
MEMORY_PER_GPU_GI = 32
SIM_REQUESTS = {"cpu": "100m", "memory": "128Mi"}
STARTUP_PERIOD_SECONDS = 10

#: How long an engine pod that is being deleted keeps serving before its process gets SIGTERM.
#: A pod deleted outside a rollout (by hand, an eviction) must first leave every router's
#: table: the operator sees the deletionTimestamp on its pod watch and writes a table without
#: the pod in one light pass (debounce 50 ms plus one ConfigMap write), and each router's watch
#: delivers the new table in well under a second (bench/results/routing-lag-latest.md measures
#: it from pod NotReady to served by every router). Five seconds covers
#: that with room for a busy API server; in-flight requests keep running meanwhile and no new
#: one arrives.
ENGINE_PRESTOP_SECONDS = 5
#: What an engine's in-flight requests get after SIGTERM: a long generation runs for minutes
#: (the same bound as the router's stream grace).
ENGINE_SHUTDOWN_SECONDS = 120
ENGINE_TERMINATION_GRACE_SECONDS = ENGINE_PRESTOP_SECONDS + ENGINE_SHUTDOWN_SECONDS

#: A router pod being deleted sleeps this long before SIGTERM, so the endpoints controller and
#: every kube-proxy or load balancer drop it from the Service first (the proxy also turns /ready
#: 503 at SIGTERM).
ROUTER_PRESTOP_SECONDS = 5
#: ``pdserve proxy --shutdown-grace-seconds``: after SIGTERM, in-flight streams get this long.
ROUTER_SHUTDOWN_GRACE_SECONDS = 120
#: The sleep, the stream grace, and a few seconds for the proxy to close its connections.
ROUTER_TERMINATION_GRACE_SECONDS = ROUTER_PRESTOP_SECONDS + ROUTER_SHUTDOWN_GRACE_SECONDS + 5


def default_requests(gpus: int, sim: bool) -> dict[str, str]:
    if sim:
        return dict(SIM_REQUESTS)
    per = max(gpus, 1)
    return {"cpu": str(CPU_PER_GPU * per), "memory": f"{MEMORY_PER_GPU_GI * per}Gi"}


def with_default_requests(container: dict[str, Any], defaults: dict[str, str]) -> dict[str, Any]:
    """``container`` with a request for each default resource that has neither request nor limit."""
    resources = container.setdefault("resources", {})
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    missing = {k: v for k, v in defaults.items() if k not in requests and k not in limits}
    if missing:
        resources["requests"] = {**requests, **missing}
    return container


def startup_failure_threshold(timeout_seconds: int) -> int:
    return max(1, math.ceil(timeout_seconds / STARTUP_PERIOD_SECONDS))


def engine_security_context(sim: bool) -> dict[str, Any]:
    """The pod-level securityContext; the simulator's image runs as a non-root user."""
    return {"runAsNonRoot": True} if sim else {}


def router_args(spec: PDDeploymentSpec, configmap: str, port: int) -> list[str]:
    """``pdserve proxy``'s flags in a router container: the routing ConfigMap watched through the
    API server (a new table is served within a second of being written; a mounted ConfigMap would
    follow only on the kubelet's sync period), its grace period, its port, spec.router's tuning
    (the policy flags: RouterSpec.policy_args) and spec.tracing's endpoint (render/tracing.py)."""
    router = spec.router
    return [
        "proxy",
        "--routing-configmap",
        f"$(POD_NAMESPACE)/{configmap}",
        "--shutdown-grace-seconds",
        str(ROUTER_SHUTDOWN_GRACE_SECONDS),
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        *router.policy_args(),
        "--backlog",
        str(router.backlog),
        "--workers",
        str(router.workers),
        *router_tracing_args(spec),
    ]
