"""The one parser of a PDDeployment: untrusted input in, the values of
:mod:`pdserve.deployment.spec.pddeployment` out, or a :class:`SpecError` that names the field.

The operator parses objects it reads from the API server; the local mode and ``pdserve render``
parse YAML files that no API server has checked. So :func:`parse_spec` applies every default
and check the CRD schema (``crds/pddeployments.pdserve.io.yaml``) applies, CEL rules included,
and names the offending field in its error, e.g.
``spec.prefill.dataParallel: expected an integer >= 1, got "8" (string)``.
A unit test walks the CRD's defaults and checks the parser applies the same.

Kept apart from the values it builds: they are read everywhere, while input enters only here.

Rules the schema cannot express (a node's GPU count, flags that pdserve owns) live in
:mod:`pdserve.deployment.validate`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pdserve.deployment.spec.autoscaling import parse_autoscaling
from pdserve.deployment.spec.multinode import (
    API_SERVERS,
    BACKENDS,
    DEFAULT_API_SERVERS,
    DEFAULT_BACKEND,
    DEFAULT_GANG_TIMEOUT_SECONDS,
    DEFAULT_RPC_PORT,
    MAX_GANG_TIMEOUT_SECONDS,
    MAX_GPUS_PER_NODE,
    MIN_GANG_TIMEOUT_SECONDS,
    MultiNodeSpec,
)
from pdserve.deployment.spec.pddeployment import (
    API_VERSION,
    CONNECTORS,
    DEFAULT_ADMIN_PORT,
    DEFAULT_BACKLOG,
    DEFAULT_CONNECTOR,
    DEFAULT_DISRUPTION_MAX_UNAVAILABLE,
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_ENGINE,
    DEFAULT_GPU_RESOURCE,
    DEFAULT_MAX_SURGE,
    DEFAULT_MAX_UNAVAILABLE,
    DEFAULT_NODE_LOSS_SECONDS,
    DEFAULT_POLICY,
    DEFAULT_ROUTER_PORT,
    DEFAULT_ROUTER_REPLICAS,
    DEFAULT_ROUTER_WORKERS,
    DEFAULT_SERVICE_TYPE,
    DEFAULT_SHM_SIZE,
    DEFAULT_STARTUP_TIMEOUT,
    ENGINE_PORT,
    ENGINES,
    KIND,
    MAX_BACKLOG,
    MAX_DRAIN_SECONDS,
    MAX_INSTANCES,
    MAX_NAME_LENGTH,
    MAX_NODE_LOSS_SECONDS,
    MAX_PARALLEL,
    MAX_ROUTER_REPLICAS,
    MAX_ROUTER_WORKERS,
    MAX_STARTUP_TIMEOUT,
    PLACEMENT_DEPLOYMENT,
    PLACEMENTS,
    POLICIES,
    PREFILL_POLICIES,
    SERVICE_TYPES,
    DisruptionBudgetSpec,
    KVTransferSpec,
    PDDeployment,
    PDDeploymentSpec,
    RoleSpec,
    RolloutSpec,
    RouterSpec,
)
from pdserve.deployment.spec.podtemplate import parse_template
from pdserve.deployment.spec.readers import SpecError, read_secret_ref
from pdserve.deployment.spec.readers import no_unknown as _no_unknown
from pdserve.deployment.spec.readers import plain as _plain
from pdserve.deployment.spec.readers import read_boolean as _boolean
from pdserve.deployment.spec.readers import read_choice as _choice
from pdserve.deployment.spec.readers import read_env_list as _env_list
from pdserve.deployment.spec.readers import read_integer as _integer
from pdserve.deployment.spec.readers import read_object as _object
from pdserve.deployment.spec.readers import read_object_list as _object_list
from pdserve.deployment.spec.readers import read_string as _string
from pdserve.deployment.spec.readers import read_string_list as _string_list
from pdserve.deployment.spec.readers import read_string_map as _string_map
from pdserve.deployment.spec.readers import show as _show
from pdserve.deployment.spec.storage import parse_model, parse_model_cache
from pdserve.deployment.spec.tracing import parse_tracing
from pdserve.kv import by_crd, with_modes
from pdserve.routing import Role
from pdserve.wire import vllm

# SpecError is readers.py's, exported here too: the error these parsers raise, caught by their callers.
__all__ = ["SpecError", "load_manifest", "load_manifest_file", "parse_pddeployment", "parse_spec"]

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-._a-zA-Z0-9]+$")
_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


# --- entry points ------------------------------------------------------------------------------


def load_manifest_file(path: str | Path) -> PDDeployment:
    """Read a YAML file holding one PDDeployment (blank documents are ignored)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(file), "no such file") from None
    except IsADirectoryError:
        raise SpecError(str(file), "is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(file), f"cannot read: {exc}") from exc
    return load_manifest(text, source=str(file))


def load_manifest(text: str, source: str = "<manifest>") -> PDDeployment:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(source, f"not valid YAML: {where}{problem}") from exc
    if len(docs) != 1:
        raise SpecError(source, f"expected exactly one PDDeployment document, found {len(docs)}")
    return parse_pddeployment(docs[0])


def parse_pddeployment(obj: Mapping[str, Any] | object) -> PDDeployment:
    """A full Kubernetes object (apiVersion, kind, metadata, spec) with the CRD's defaults applied."""
    doc = _object(obj, "")
    api_version = doc.get("apiVersion")
    if api_version != API_VERSION:
        raise SpecError("apiVersion", f'expected "{API_VERSION}", got {_show(api_version)}')
    kind = doc.get("kind")
    if kind != KIND:
        raise SpecError("kind", f'expected "{KIND}", got {_show(kind)}')
    meta = _object(doc.get("metadata"), "metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", f"required: a name such as my-model, got {_show(name)}")
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.match(name):
        raise SpecError(
            "metadata.name",
            f"must be at most {MAX_NAME_LENGTH} characters of lowercase letters, digits and '-', "
            f"starting with a letter and ending with a letter or digit, got {_show(name)}",
        )
    namespace = meta.get("namespace", "default")
    if not isinstance(namespace, str) or len(namespace) > 63 or not _DNS_1123.match(namespace):
        raise SpecError("metadata.namespace", f"expected a namespace name, got {_show(namespace)}")
    uid = meta.get("uid", "")
    if not isinstance(uid, str):
        raise SpecError("metadata.uid", f"expected a string, got {_show(uid)}")
    generation = meta.get("generation", 0)
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise SpecError("metadata.generation", f"expected an integer >= 0, got {_show(generation)}")
    labels = _string_map(meta, "labels", "metadata")
    spec = parse_spec(doc.get("spec"))
    return PDDeployment(name, namespace, uid, generation, spec, labels)


def parse_spec(spec: Mapping[str, Any] | object) -> PDDeploymentSpec:
    path = "spec"
    doc = _object(spec, path)
    _no_unknown(
        doc,
        path,
        (
            "model",
            "servedModelName",
            "image",
            "engine",
            "gpuResource",
            "kvTransfer",
            "prefill",
            "decode",
            "router",
            "rollout",
            "modelCache",
            "hfTokenSecretRef",
            "engineApiKeySecretRef",
            "gpusPerNode",
            "multiNode",
            "autoscaling",
            "tracing",
        ),
    )
    model = parse_model(_string(doc, "model", path, required=True), f"{path}.model")
    served = _string(doc, "servedModelName", path, default="") or model
    image = _string(doc, "image", path, default="")
    engine = _choice(doc, "engine", path, ENGINES, DEFAULT_ENGINE)
    if engine == "vllm" and not image:
        raise SpecError(f"{path}.image", f"required when engine is vllm (for example {vllm.IMAGE})")
    gpu_resource = _string(doc, "gpuResource", path, default=DEFAULT_GPU_RESOURCE)
    if not _RESOURCE_NAME.match(gpu_resource):
        raise SpecError(
            f"{path}.gpuResource",
            f"expected an extended resource name such as amd.com/gpu, got {_show(gpu_resource)}",
        )
    kv = _parse_kv_transfer(doc.get("kvTransfer", {}), f"{path}.kvTransfer")
    prefill = _parse_role(doc.get("prefill", {}), f"{path}.prefill")
    decode = _parse_role(doc.get("decode", {}), f"{path}.decode")
    router = _parse_router(doc.get("router", {}), f"{path}.router")
    rollout = _parse_rollout(doc.get("rollout", {}), f"{path}.rollout")
    gpus_per_node = _optional_integer(doc, "gpusPerNode", path, 1, MAX_GPUS_PER_NODE)
    multi_node = _parse_multi_node(doc.get("multiNode", {}), f"{path}.multiNode")
    parsed = PDDeploymentSpec(
        model,
        served,
        image,
        engine,
        gpu_resource,
        kv,
        prefill,
        decode,
        router,
        rollout,
        model_cache=parse_model_cache(doc.get("modelCache"), f"{path}.modelCache"),
        hf_token_secret_ref=read_secret_ref(doc.get("hfTokenSecretRef"), f"{path}.hfTokenSecretRef"),
        engine_api_key_secret_ref=read_secret_ref(
            doc.get("engineApiKeySecretRef"), f"{path}.engineApiKeySecretRef"
        ),
        gpus_per_node=gpus_per_node,
        multi_node=multi_node,
        autoscaling=parse_autoscaling(doc.get("autoscaling"), f"{path}.autoscaling"),
        tracing=parse_tracing(doc.get("tracing"), f"{path}.tracing"),
    )
    for role in (Role.PREFILL, Role.DECODE):  # shapes that cannot be split over nodes of gpusPerNode
        parsed.group_shape(role)
    return parsed


# --- sections ----------------------------------------------------------------------------------


def _parse_kv_transfer(value: object, path: str) -> KVTransferSpec:
    doc = _object(value, path)
    _no_unknown(doc, path, ("connector", "transferMode", "extraConfig"))
    connector = _choice(doc, "connector", path, CONNECTORS, DEFAULT_CONNECTOR)
    modes = by_crd(connector).names.modes
    mode: str | None = None
    extra = _plain(_object(doc.get("extraConfig", {}), f"{path}.extraConfig"), f"{path}.extraConfig")
    if modes:
        if doc.get("transferMode") is None:
            raise SpecError(
                f"{path}.transferMode", f"required with connector {connector} ({' or '.join(modes)})"
            )
        mode = _choice(doc, "transferMode", path, modes, None)
    elif doc.get("transferMode") is not None:
        takers = ", ".join(c.names.crd for c in with_modes())
        raise SpecError(f"{path}.transferMode", f"only valid with connector {takers}, not {connector}")
    for problem in by_crd(connector).render.spec_problems(mode, extra):
        got = f", got {_show(problem.got[0])}" if problem.got else ""
        raise SpecError(f"{path}.extraConfig.{problem.key}", problem.reason + got)
    return KVTransferSpec(connector, mode, extra)


_ROLE_FIELDS = (
    "instances",
    "dataParallel",
    "tensorParallel",
    "expertParallel",
    "pipelineParallel",
    "gpusPerNode",
    "args",
    "env",
    "resources",
    "nodeSelector",
    "tolerations",
    "affinity",
    "template",
    "shmSize",
    "startupTimeoutSeconds",
    "disruptionBudget",
)


def _parse_role(value: object, path: str) -> RoleSpec:
    doc = _object(value, path)
    _no_unknown(doc, path, _ROLE_FIELDS)
    instances = _integer(doc, "instances", path, 1, 0, MAX_INSTANCES)
    dp = _integer(doc, "dataParallel", path, 1, 1, MAX_PARALLEL)
    tp = _integer(doc, "tensorParallel", path, 1, 1, MAX_PARALLEL)
    ep = _boolean(doc, "expertParallel", path, False)
    if ep and dp * tp == 1:
        raise SpecError(
            f"{path}.expertParallel",
            "needs more than one GPU per instance (dataParallel x tensorParallel > 1)",
        )
    pp = _integer(doc, "pipelineParallel", path, 1, 1, MAX_PARALLEL)
    gpus_per_node = _optional_integer(doc, "gpusPerNode", path, 1, MAX_GPUS_PER_NODE)
    args = _string_list(doc, "args", path)
    env = _env_list(doc, "env", path)
    resources = _object(doc.get("resources", {}), f"{path}.resources")
    node_selector = _string_map(doc, "nodeSelector", path)
    tolerations = _object_list(doc, "tolerations", path)
    affinity = _object(doc.get("affinity", {}), f"{path}.affinity")
    return RoleSpec(
        instances=instances,
        data_parallel=dp,
        tensor_parallel=tp,
        expert_parallel=ep,
        pipeline_parallel=pp,
        gpus_per_node=gpus_per_node,
        args=args,
        env=env,
        resources=_plain(resources, f"{path}.resources"),
        node_selector=node_selector,
        tolerations=tolerations,
        affinity=_plain(affinity, f"{path}.affinity"),
        template=parse_template(doc.get("template"), f"{path}.template"),
        shm_size=_quantity(doc, "shmSize", path, DEFAULT_SHM_SIZE),
        startup_timeout_seconds=_integer(
            doc, "startupTimeoutSeconds", path, DEFAULT_STARTUP_TIMEOUT, 10, MAX_STARTUP_TIMEOUT
        ),
        disruption_budget=_parse_disruption_budget(
            doc.get("disruptionBudget", {}), f"{path}.disruptionBudget"
        ),
    )


def _parse_disruption_budget(value: object, path: str) -> DisruptionBudgetSpec:
    doc = _object(value, path)
    _no_unknown(doc, path, ("maxUnavailable",))
    raw = doc.get("maxUnavailable", DEFAULT_DISRUPTION_MAX_UNAVAILABLE)
    where = f"{path}.maxUnavailable"
    if isinstance(raw, str):
        if not _PERCENT.match(raw):
            raise SpecError(
                where, f'expected an integer or a percentage from "0%" to "100%", got {_show(raw)}'
            )
        return DisruptionBudgetSpec(raw)
    return DisruptionBudgetSpec(
        _integer(doc, "maxUnavailable", path, DEFAULT_DISRUPTION_MAX_UNAVAILABLE, 0, MAX_INSTANCES)
    )


def _optional_integer(doc: Mapping[str, Any], key: str, path: str, minimum: int, maximum: int) -> int | None:
    return None if doc.get(key) is None else _integer(doc, key, path, minimum, minimum, maximum)


def _parse_multi_node(value: object, path: str) -> MultiNodeSpec:
    doc = _object(value, path)
    _no_unknown(doc, path, ("backend", "apiServers", "gangTimeoutSeconds", "rpcPort"))
    rpc_port = _integer(doc, "rpcPort", path, DEFAULT_RPC_PORT, 1, 65535)
    if rpc_port == ENGINE_PORT:
        raise SpecError(f"{path}.rpcPort", f"must differ from the engines' HTTP port {ENGINE_PORT}")
    return MultiNodeSpec(
        backend=_choice(doc, "backend", path, BACKENDS, DEFAULT_BACKEND),
        api_servers=_choice(doc, "apiServers", path, API_SERVERS, DEFAULT_API_SERVERS),
        gang_timeout_seconds=_integer(
            doc,
            "gangTimeoutSeconds",
            path,
            DEFAULT_GANG_TIMEOUT_SECONDS,
            MIN_GANG_TIMEOUT_SECONDS,
            MAX_GANG_TIMEOUT_SECONDS,
        ),
        rpc_port=rpc_port,
    )


def _quantity(doc: Mapping[str, Any], key: str, path: str, default: str) -> str:
    value = _string(doc, key, path, default=default)
    if not _QUANTITY.match(value):
        raise SpecError(f"{path}.{key}", f"expected a quantity such as 8Gi or 512Mi, got {_show(value)}")
    return value


def _parse_router(value: object, path: str) -> RouterSpec:
    doc = _object(value, path)
    known = ("replicas", "image", "policy", "backlog", "workers", "port", "serviceType", "template")
    _no_unknown(doc, path, (*known, "adminPort", "apiKeySecretRef", "placement", "prefillPolicy"))
    port = _integer(doc, "port", path, DEFAULT_ROUTER_PORT, 1, 65535)
    admin_port = _integer(doc, "adminPort", path, DEFAULT_ADMIN_PORT, 1, 65535)
    if admin_port == port:
        raise SpecError(f"{path}.adminPort", f"must differ from port ({port}): clients must not reach it")
    return RouterSpec(
        replicas=_integer(doc, "replicas", path, DEFAULT_ROUTER_REPLICAS, 0, MAX_ROUTER_REPLICAS),
        image=_string(doc, "image", path, default=""),
        policy=_choice(doc, "policy", path, POLICIES, DEFAULT_POLICY),
        prefill_policy=(
            _choice(doc, "prefillPolicy", path, PREFILL_POLICIES, None) if "prefillPolicy" in doc else None
        ),
        backlog=_integer(doc, "backlog", path, DEFAULT_BACKLOG, 1, MAX_BACKLOG),
        workers=_integer(doc, "workers", path, DEFAULT_ROUTER_WORKERS, 0, MAX_ROUTER_WORKERS),
        port=port,
        service_type=_choice(doc, "serviceType", path, SERVICE_TYPES, DEFAULT_SERVICE_TYPE),
        template=parse_template(doc.get("template"), f"{path}.template"),
        admin_port=admin_port,
        api_key_secret_ref=read_secret_ref(doc.get("apiKeySecretRef"), f"{path}.apiKeySecretRef"),
        placement=_choice(doc, "placement", path, PLACEMENTS, PLACEMENT_DEPLOYMENT),
    )


def _parse_rollout(value: object, path: str) -> RolloutSpec:
    doc = _object(value, path)
    _no_unknown(doc, path, ("maxUnavailable", "maxSurge", "drainSeconds", "nodeLossSeconds"))
    rollout = RolloutSpec(
        max_unavailable=_integer(doc, "maxUnavailable", path, DEFAULT_MAX_UNAVAILABLE, 0, MAX_INSTANCES),
        max_surge=_integer(doc, "maxSurge", path, DEFAULT_MAX_SURGE, 0, MAX_INSTANCES),
        drain_seconds=_integer(doc, "drainSeconds", path, DEFAULT_DRAIN_SECONDS, 0, MAX_DRAIN_SECONDS),
        node_loss_seconds=_integer(
            doc, "nodeLossSeconds", path, DEFAULT_NODE_LOSS_SECONDS, 0, MAX_NODE_LOSS_SECONDS
        ),
    )
    if rollout.max_surge == 0 and rollout.max_unavailable == 0:
        raise SpecError(
            path, "maxSurge and maxUnavailable cannot both be 0: no instance could ever be replaced"
        )
    return rollout
