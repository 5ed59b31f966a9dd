"""The PDDeployment resource as typed, immutable values: its names, defaults, bounds and dataclasses.

What rendering, rollout planning, validation, the operator and the local mode read. Kept apart from
the one parser that builds these values from untrusted input (:mod:`pdserve.deployment.spec.parse`),
so that a reader of the resource need not read its parser. The defaults and bounds equal the CRD
schema's (``crds/pddeployments.pdserve.io.yaml``); tests/unit/test_deployment_crd.py checks that
through the parser.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve import __version__
from pdserve.deployment.spec.autoscaling import AutoscalingSpec
from pdserve.deployment.spec.multinode import GroupShape, MultiNodeSpec, group_shape
from pdserve.deployment.spec.podtemplate import PodTemplate
from pdserve.deployment.spec.readers import SecretKeyRef
from pdserve.deployment.spec.storage import ModelCache
from pdserve.deployment.spec.tracing import TracingSpec
from pdserve.kv import DEFAULT, KVConnector, by_crd, crd_names
from pdserve.routing import Connector, Role

__all__ = ["GroupShape", "ModelCache", "MultiNodeSpec", "SecretKeyRef", "TracingSpec"]

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

# Defaults; equal to the CRD schema's (tests/unit/test_deployment_crd.py checks it).
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
