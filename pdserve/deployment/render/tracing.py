"""What ``spec.tracing`` renders: the router's and the engines' flags and variables. Pure.

* the router (its Deployment and the decode sidecar): ``--otlp-traces-endpoint`` and
  ``--trace-sampling-ratio``;
* the engines: ``--otlp-traces-endpoint`` as vLLM 0.32 reads it and
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` to match the URL (pdserve.tracing.endpoint.vllm_settings),
  ``--collect-detailed-traces`` when asked, and the SDK's ``parentbased_traceidratio`` sampler at
  the spec's ratio: a leg follows the router's decision (its traceparent says sampled or not), a
  request sent to an engine directly is sampled at the same ratio;
* every container: ``OTEL_SERVICE_NAME`` (``<name>-router``, ``<name>-prefill``,
  ``<name>-decode``) and ``OTEL_RESOURCE_ATTRIBUTES`` with its namespace, pod and deployment.

The variables are defaults: a role's ``env`` (rendered after them) overrides any of them.
"""

from __future__ import annotations

from typing import Any

from pdserve.deployment.spec.pddeployment import PDDeployment, PDDeploymentSpec
from pdserve.routing import Role
from pdserve.tracing.endpoint import vllm_settings

#: The engine flags spec.tracing renders (validate.py refuses them in a role's args then).
ENGINE_FLAGS = ("--otlp-traces-endpoint", "--collect-detailed-traces")
#: The router flags it renders.
ROUTER_FLAGS = ("--otlp-traces-endpoint", "--trace-sampling-ratio")


def router_tracing_args(spec: PDDeploymentSpec) -> list[str]:
    tracing = spec.tracing
    if tracing is None:
        return []
    return [
        "--otlp-traces-endpoint",
        tracing.endpoint,
        "--trace-sampling-ratio",
        f"{tracing.sampling_ratio:g}",
    ]


def engine_tracing_args(spec: PDDeploymentSpec) -> list[str]:
    tracing = spec.tracing
    if tracing is None:
        return []
    url, _ = vllm_settings(tracing.otlp)
    args = ["--otlp-traces-endpoint", url]
    if tracing.collect_detailed_traces:
        args += ["--collect-detailed-traces", *tracing.collect_detailed_traces]
    return args


def engine_tracing_env(pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
    tracing = pdd.spec.tracing
    if tracing is None:
        return []
    _, variables = vllm_settings(tracing.otlp)
    env = [_value(name, value) for name, value in variables.items()]
    env += [
        _value("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        _value("OTEL_TRACES_SAMPLER_ARG", f"{tracing.sampling_ratio:g}"),
    ]
    return env + service_env(pdd, role.value, pod_refs=True)


def router_tracing_env(pdd: PDDeployment, define_pod_name: bool) -> list[dict[str, Any]]:
    """For a router container that has POD_NAMESPACE (and POD_NAME unless ``define_pod_name``)."""
    if pdd.spec.tracing is None:
        return []
    own = [_field("POD_NAME", "metadata.name")] if define_pod_name else []
    return own + service_env(pdd, "router", pod_refs=False)


def service_env(pdd: PDDeployment, component: str, pod_refs: bool) -> list[dict[str, Any]]:
    """The service name and resource of one container; ``pod_refs``: also define POD_NAMESPACE
    and POD_NAME from the downward API (the attributes refer to them, Kubernetes expands them)."""
    refs = (
        [_field("POD_NAMESPACE", "metadata.namespace"), _field("POD_NAME", "metadata.name")]
        if pod_refs
        else []
    )
    attributes = f"k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),pdserve.deployment={pdd.name}"
    return [
        *refs,
        _value("OTEL_SERVICE_NAME", f"{pdd.name}-{component}"),
        _value("OTEL_RESOURCE_ATTRIBUTES", attributes),
    ]


def _value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
