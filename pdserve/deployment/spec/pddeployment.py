"""The PDDeployment resource as typed, immutable values, and its one parser.

The operator parses objects it reads from the API server; the local mode and ``pdserve render``
parse YAML files that no API server has checked. So :func:`parse_spec` applies every default
and check the CRD schema (``crds/pddeployments.pdserve.io.yaml``) applies, CEL rules included,
and names the offending field in its error, e.g.
``spec.prefill.dataParallel: expected an integer >= 1, got "8" (string)``.
A unit test walks the CRD's defaults and checks they equal the ones here.

Rules the schema cannot express (a node's GPU count, flags that pdserve owns) live in
:mod:`pdserve.deployment.validate`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve import __version__
from pdserve.deployment.spec.autoscaling import AutoscalingSpec, parse_autoscaling
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
    GroupShape,
    MultiNodeSpec,
    group_shape,
)
from pdserve.deployment.spec.podtemplate import PodTemplate, parse_template
from pdserve.deployment.spec.readers import SecretKeyRef, SpecError, read_secret_ref
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
from pdserve.deployment.spec.storage import ModelCache, parse_model, parse_model_cache
from pdserve.deployment.spec.tracing import TracingSpec, parse_tracing
from pdserve.kv import DEFAULT, KVConnector, by_crd, crd_names, with_modes
from pdserve.routing import Connector, Role
from pdserve.wire import vllm

__all__ = ["GroupShape", "ModelCache", "MultiNodeSpec", "SecretKeyRef", "SpecError", "TracingSpec"]

GROUP = "pdserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PDDeployment"
PLURAL = "pddeployments"

ENGINES = ("vllm", "sim")
CONNECTORS = crd_names()
POLICIES = ("flat-interleaved", "least-outstanding")
#: What spec.router.prefillPolicy may name (absent: the prefill slots follow ``policy``).
PREFILL_POLICIES = ("flat-interleaved", "prefix-affinity")
PREFIX_AFFINITY = "prefix-affinity"
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
#: Where the router runs: its own Deployment in front of the engines, or a container in every
#: decode pod (pdserve.routing.sidecar).
PLACEMENT_DEPLOYMENT = "deployment"
PLACEMENT_DECODE_SIDECAR = "decode-sidecar"
PLACEMENTS = (PLACEMENT_DEPLOYMENT, PLACEMENT_DECODE_SIDECAR)

#: Every engine (vLLM or the simulator) listens here, in its own pod.
ENGINE_PORT = 8000
#: The pdserve image of this version: the router's, and the simulator's when ``image`` is "".
DEFAULT_IMAGE = f"ghcr.io/pdserve/pdserve:{__version__}"

#: Longest PDDeployment name: Service names (``<name>-engines``) and label values have 63 characters.
MAX_NAME_LENGTH = 50
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-._a-zA-Z0-9]+$")

# Defaults; equal to the CRD schema's (tests/unit/test_deployment_spec.py checks it).
DEFAULT_ENGINE = "vllm"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_CONNECTOR = DEFAULT.names.crd
DEFAULT_ROUTER_REPLICAS = 1
DEFAULT_POLICY = "flat-interleaved"
DEFAULT_BACKLOG = 4096
#: Router worker processes; 0 asks the proxy for the CPUs available to its container.
DEFAULT_ROUTER_WORKERS = 2
MAX_ROUTER_WORKERS = 64
DEFAULT_ROUTER_PORT = 8000
DEFAULT_ADMIN_PORT = 9000
DEFAULT_SERVICE_TYPE = "ClusterIP"
DEFAULT_MAX_UNAVAILABLE = 1
DEFAULT_MAX_SURGE = 1
DEFAULT_DRAIN_SECONDS = 30
#: Like the taint-based eviction's default tolerationSeconds for node.kubernetes.io/unreachable.
DEFAULT_NODE_LOSS_SECONDS = 300
#: Instances of a role a voluntary disruption (a node drain's evictions) may take at once.
DEFAULT_DISRUPTION_MAX_UNAVAILABLE = 1
#: /dev/shm of an engine pod (a memory-backed emptyDir). vLLM's Kubernetes guide gives 2Gi to a
#: one-GPU pod and 8Gi to its ROCm example; NCCL's SHM transport and vLLM's shared-memory queues
#: grow with the ranks of an instance. It counts against the pod's memory limit when used.
DEFAULT_SHM_SIZE = "8Gi"
#: Seconds the startup probe allows a vLLM engine to load its model (render/defaults.py).
DEFAULT_STARTUP_TIMEOUT = 3600
MAX_STARTUP_TIMEOUT = 86400
_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")

# Bounds; equal to the CRD schema's.
MAX_INSTANCES = 1024
MAX_PARALLEL = 64
MAX_ROUTER_REPLICAS = 64
MAX_BACKLOG = 1_000_000
MAX_DRAIN_SECONDS = 3600
MAX_NODE_LOSS_SECONDS = 86400


@dataclass(frozen=True)
class KVTransferSpec:
    connector: str  # a pdserve.kv connector's CRD name
    transfer_mode: str | None = None  # one of its modes, for a connector that takes one
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kv(self) -> KVConnector:
        """What pdserve knows of the connector (pdserve.kv)."""
        return by_crd(self.connector)

    @property
    def routing_connector(self) -> Connector:
        """The connector as the routing table (and so the proxy) names it."""
        return Connector(self.kv.names.table, self.transfer_mode)


@dataclass(frozen=True)
class DisruptionBudgetSpec:
    """How many of a role's instances evictions (``kubectl drain``) may take down at once.

    ``max_unavailable`` is an integer or a percentage string ("25%") of the role's instances,
    rounded up as Kubernetes rounds a PodDisruptionBudget's maxUnavailable.
    """

    max_unavailable: int | str = DEFAULT_DISRUPTION_MAX_UNAVAILABLE

    def allowed(self, instances: int) -> int:
        """Instances of ``instances`` that may be unavailable, never more than there are."""
        value = self.max_unavailable
        if isinstance(value, str):
            value = -(-int(value[:-1]) * instances // 100)  # ceil, like Kubernetes
        return min(value, instances)


@dataclass(frozen=True)
class RoleSpec:
    """One role's instances; each instance is one ``vllm serve`` of DP x TP x PP GPUs, one pod, or
    a group of pods when it is larger than ``gpusPerNode`` (multinode.py)."""

    instances: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    expert_parallel: bool = False
    pipeline_parallel: int = 1
    #: Overrides ``spec.gpusPerNode`` for this role; None: the spec's.
    gpus_per_node: int | None = None
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    #: Merged onto the rendered pod last (podtemplate.py); fields pdserve owns are refused.
    template: PodTemplate = field(default_factory=PodTemplate)
    shm_size: str = DEFAULT_SHM_SIZE
    startup_timeout_seconds: int = DEFAULT_STARTUP_TIMEOUT
    #: Rendered as the role's PodDisruptionBudget (render/static_objects.py); the operator's own
    #: deletes ignore it.
    disruption_budget: DisruptionBudgetSpec = field(default_factory=DisruptionBudgetSpec)

    @property
    def gpus_per_instance(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def slots(self) -> int:
        """Routable (instance, DP rank) pairs when every instance is up."""
        return self.instances * self.data_parallel


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = DEFAULT_ROUTER_REPLICAS
    image: str = ""  # "" means the pdserve image of this version
    policy: str = DEFAULT_POLICY
    #: The prefill slots' policy; None: ``policy``'s (the decode keeps ``policy``'s either way).
    prefill_policy: str | None = None
    backlog: int = DEFAULT_BACKLOG
    workers: int = DEFAULT_ROUTER_WORKERS
    port: int = DEFAULT_ROUTER_PORT
    service_type: str = DEFAULT_SERVICE_TYPE
    template: PodTemplate = field(default_factory=PodTemplate)
    # Router security: the clients' key, and the port of /metrics, /debug/* and profiling.
    admin_port: int = DEFAULT_ADMIN_PORT
    api_key_secret_ref: SecretKeyRef | None = None
    placement: str = PLACEMENT_DEPLOYMENT

    @property
    def decode_sidecar(self) -> bool:
        """The router runs in every decode pod: no router Deployment, the Service selects decodes."""
        return self.placement == PLACEMENT_DECODE_SIDECAR

    def policy_args(self) -> list[str]:
        """The router's policy flags. Several routers (replicas, or a sidecar per decode pod) with
        prefix-affinity send prompts that match nothing by rendezvous hashing, so that they agree on
        where a new prefix goes without talking (pdserve.proxy.policies.prefix_affinity); one
        router keeps the flat interleave's exact shares for them."""
        args = ["--policy", self.policy]
        if self.prefill_policy is not None:
            args += ["--prefill-policy", self.prefill_policy]
            if self.prefill_policy == PREFIX_AFFINITY and (self.decode_sidecar or self.replicas > 1):
                args += ["--prefix-unmatched", "rendezvous"]
        return args


@dataclass(frozen=True)
class RolloutSpec:
    max_unavailable: int = DEFAULT_MAX_UNAVAILABLE
    max_surge: int = DEFAULT_MAX_SURGE
    drain_seconds: int = DEFAULT_DRAIN_SECONDS
    node_loss_seconds: int = DEFAULT_NODE_LOSS_SECONDS


@dataclass(frozen=True)
class PDDeploymentSpec:
    model: str
    served_model_name: str  # the model name clients send; ``model`` when the spec leaves it out
    image: str  # "" is allowed only for engine "sim" (the router image is used)
    engine: str
    gpu_resource: str
    kv_transfer: KVTransferSpec
    prefill: RoleSpec
    decode: RoleSpec
    router: RouterSpec = RouterSpec()
    rollout: RolloutSpec = RolloutSpec()
    # Model storage and credentials (storage.py); engine vllm only.
    model_cache: ModelCache | None = None
    hf_token_secret_ref: SecretKeyRef | None = None
    #: The engines' VLLM_API_KEY, which the router sends them.
    engine_api_key_secret_ref: SecretKeyRef | None = None
    #: GPUs of one node; None: unknown here (the operator reads the nodes; render: one pod per instance).
    gpus_per_node: int | None = None
    multi_node: MultiNodeSpec = field(default_factory=MultiNodeSpec)
    #: None: the instance counts are the spec's; else the autoscaler's, ``instances`` the start.
    autoscaling: AutoscalingSpec | None = None
    #: OpenTelemetry traces of the router and the engines (spec/tracing.py); None: off.
    tracing: TracingSpec | None = None

    @property
    def engine_image(self) -> str:
        """The image engine pods run: ``image``, else the router's, else pdserve's own."""
        return self.image or self.router.image or DEFAULT_IMAGE

    def role(self, role: Role) -> RoleSpec:
        return self.prefill if role is Role.PREFILL else self.decode

    def gpus_per_node_of(self, role: Role) -> int | None:
        """The role's ``gpusPerNode``, else the spec's, else None."""
        own = self.role(role).gpus_per_node
        return own if own is not None else self.gpus_per_node

    def group_shape(self, role: Role) -> GroupShape:
        """The pods one instance of ``role`` spans with this spec's gpusPerNode (multinode.py)."""
        return group_shape(
            self.role(role), self.gpus_per_node_of(role), self.multi_node, f"spec.{role.value}"
        )


@dataclass(frozen=True)
class PDDeployment:
    name: str
    #: "" renders objects without a namespace, for ``kubectl apply -n`` (``pdserve render``).
    namespace: str
    uid: str  # "" for a file that never went through an API server
    generation: int
    spec: PDDeploymentSpec
    labels: Mapping[str, str] = field(default_factory=dict)


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
