"""How many pods one instance spans, and what each pod of the group runs (pure shape math).

An instance is ``dataParallel`` ranks of ``tensorParallel x pipelineParallel`` GPUs each. With a
known ``gpusPerNode`` it becomes a *group* of pods, one per node:

* everything fits a node: one pod, exactly as before multi-node instances existed;
* a rank fits a node: ``dp_local = gpusPerNode // (TP x PP)`` ranks per pod and
  ``dataParallel / dp_local`` pods (vLLM's multi-node data parallelism: ``--data-parallel-size-local``,
  ``--data-parallel-start-rank``, one ``--data-parallel-address``/``--data-parallel-rpc-port``);
* a rank is larger than a node: ``dataParallel`` 1, ``TP x PP / gpusPerNode`` pods of
  ``gpusPerNode`` GPUs (vLLM's multi-node TP/PP: ``--nnodes``, ``--node-rank``, ``--master-addr``).

Checks vLLM 0.32 itself makes that concern the shape, and where (read from its source):

* ``vllm/engine/arg_utils.py`` ``create_engine_config``: with ``--nnodes > 1`` the world size
  (DP x TP x PP) must be divisible by ``--nnodes`` and ``--node-rank`` within ``[0, nnodes)``;
  ``--data-parallel-hybrid-lb`` is refused in headless mode (an assertion), and a node given
  ``--data-parallel-start-rank`` without ``--headless`` is switched to hybrid LB: so the leader of
  a ``leader`` group gets no start rank, and headless pods never get ``--data-parallel-hybrid-lb``;
  hybrid LB with one local rank becomes external LB (each node's API server then serves one rank).
* ``vllm/config/parallel.py`` ``ParallelConfig``: ``data_parallel_size_local <=
  data_parallel_size``; the multiproc executor asserts ``world_size % nnodes_within_dp == 0``
  (``vllm/v1/executor/multiproc_executor.py``).
* ``vllm/entrypoints/cli/serve.py``: ``--headless`` runs no API server (``api_server_count`` 0),
  so headless pods have nothing to probe over HTTP; with hybrid LB each node's API server
  manages only its local engines (``vllm/v1/engine/core_client.py``: ``engine_ranks_managed``
  is ``dp_local`` ranks from the start rank) and ``X-data-parallel-rank`` is checked against
  ``[0, dp_local)`` (``vllm/v1/engine/input_processor.py``).

pdserve adds its own, stricter rules (every pod of a group runs the same number of ranks and
GPUs; a rank larger than a node holds whole nodes and is the only rank; tensor parallelism
across nodes needs pipeline parallelism): :data:`SHAPE_RULES` lists them for docs/reference.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.deployment.spec.readers import SpecError

BACKEND_PODS = "pods"
BACKEND_LWS = "lws"
BACKENDS = (BACKEND_PODS, BACKEND_LWS)
#: vLLM hybrid LB: one API server per node for its local ranks (``--data-parallel-hybrid-lb``).
API_PER_NODE = "perNode"
#: The leader's API server dispatches to every rank; the other nodes run ``--headless``.
API_LEADER = "leader"
API_SERVERS = (API_PER_NODE, API_LEADER)

DEFAULT_BACKEND = BACKEND_PODS
DEFAULT_API_SERVERS = API_PER_NODE
DEFAULT_GANG_TIMEOUT_SECONDS = 600
MIN_GANG_TIMEOUT_SECONDS = 10
MAX_GANG_TIMEOUT_SECONDS = 86400
#: The data-parallel RPC port every node of a group shares (vLLM's default is 29550); for a rank
#: spanning nodes it is the torch.distributed master port instead.
DEFAULT_RPC_PORT = 13345
MAX_GPUS_PER_NODE = 64

#: (id, constraint, source) of every shape rule, in the order docs/reference.md lists them.
SHAPE_RULES: tuple[tuple[str, str, str], ...] = (
    (
        "dp-divides-nodes",
        "a rank fits a node but the instance does not: dataParallel is a multiple of "
        "gpusPerNode // (tensorParallel x pipelineParallel), the ranks one pod holds",
        "pdserve: every pod of a group runs the same --data-parallel-size-local",
    ),
    (
        "rank-spans-nodes-dp1",
        "a rank (tensorParallel x pipelineParallel) larger than gpusPerNode: dataParallel is 1",
        "pdserve: such a group is one vLLM --nnodes world",
    ),
    (
        "tp-within-node",
        "tensorParallel larger than gpusPerNode needs pipelineParallel > 1",
        "pdserve: tensor parallelism across nodes without pipeline stages runs every all-reduce "
        "over the network",
    ),
    (
        "rank-whole-nodes",
        "a rank larger than gpusPerNode is a multiple of it (whole nodes)",
        "vllm/engine/arg_utils.py: --nnodes must divide the world size; pdserve gives each node all "
        "of its GPUs",
    ),
)


@dataclass(frozen=True)
class MultiNodeSpec:
    """``spec.multiNode``: how a group's pods are created and how its ranks are served."""

    backend: str = DEFAULT_BACKEND
    api_servers: str = DEFAULT_API_SERVERS
    gang_timeout_seconds: int = DEFAULT_GANG_TIMEOUT_SECONDS
    rpc_port: int = DEFAULT_RPC_PORT


class RoleShape(Protocol):
    """What :func:`group_shape` reads of a role (``spec.RoleSpec`` has it)."""

    @property
    def data_parallel(self) -> int: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def pipeline_parallel(self) -> int: ...


@dataclass(frozen=True)
class GroupShape:
    """The pods of one instance. Node 0 is the leader; with ``nodes == 1`` it is today's pod."""

    nodes: int  # pods per instance (1 = today's single pod)
    gpus_per_pod: int
    dp_size: int  # global DP ranks of the instance
    dp_local: int  # DP ranks per pod (== dp_size when nodes == 1; 1 when a rank spans nodes)
    api_servers: str  # "perNode" | "leader" (single-node: irrelevant, "leader")
    spans_rank: bool  # a DP rank's TPxPP spans nodes (multi-node TP/PP; dp_size is 1)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def first_rank(self, node: int) -> int:
        """The global DP rank of the pod's first local rank."""
        self._check(node)
        return 0 if self.spans_rank else node * self.dp_local

    def serves_api(self, node: int) -> bool:
        """Whether the pod runs vLLM's API server (else ``--headless``: no HTTP at all)."""
        self._check(node)
        return node == 0 or (self.api_servers == API_PER_NODE and not self.spans_rank)

    def api_ranks(self, node: int) -> range:
        """The global DP ranks the pod's API server serves (empty for a headless pod)."""
        if not self.serves_api(node):
            return range(0)
        if self.api_servers == API_PER_NODE and self.multi_node and not self.spans_rank:
            start = self.first_rank(node)
            return range(start, start + self.dp_local)
        return range(self.dp_size)

    def _check(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} is not in [0, {self.nodes})")


def single_pod(role: RoleShape) -> GroupShape:
    """Today's shape: the whole instance in one pod."""
    rank = role.tensor_parallel * role.pipeline_parallel
    return GroupShape(1, role.data_parallel * rank, role.data_parallel, role.data_parallel, API_LEADER, False)


def group_shape(
    role_spec: RoleShape,
    gpus_per_node: int | None,
    multi_node: MultiNodeSpec,
    path: str = "spec.role",
) -> GroupShape:
    """The group one instance of ``role_spec`` becomes on nodes of ``gpus_per_node`` GPUs.

    ``gpus_per_node`` None (unknown): one pod, as before. Raises :class:`SpecError` naming
    ``<path>.<field>`` for a shape pdserve cannot split over nodes (the rules are
    :data:`SHAPE_RULES`).
    """
    dp, tp, pp = role_spec.data_parallel, role_spec.tensor_parallel, role_spec.pipeline_parallel
    rank = tp * pp
    if gpus_per_node is None or dp * rank <= gpus_per_node:
        return single_pod(role_spec)
    gpn = gpus_per_node
    if gpn < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpn}")
    if rank <= gpn:
        local = gpn // rank
        if dp % local:
            lower = dp // local * local
            options = f"{lower} or {lower + local}" if lower else f"{local}"
            raise SpecError(
                f"{path}.dataParallel",
                f"{dp} ranks of tensorParallel x pipelineParallel = {rank} GPUs do not fill whole nodes "
                f"of gpusPerNode {gpn}: a pod holds {local} ranks, so dataParallel must be a multiple "
                f"of {local} (for example {options}), or set gpusPerNode to a multiple of {rank} that "
                f"divides {dp * rank}",
            )
        return GroupShape(dp // local, local * rank, dp, local, multi_node.api_servers, False)
    if dp != 1:
        raise SpecError(
            f"{path}.dataParallel",
            f"must be 1 when a rank is larger than a node: tensorParallel x pipelineParallel = {rank} "
            f"GPUs > gpusPerNode {gpn}; run {dp} instances instead, or make a rank fit a node",
        )
    if tp > gpn and pp == 1:
        raise SpecError(
            f"{path}.tensorParallel",
            f"{tp} is larger than a node (gpusPerNode {gpn}): tensor parallelism across nodes needs "
            f"pipelineParallel > 1 (for example tensorParallel {gpn}, pipelineParallel "
            f"{-(-tp // gpn)})",
        )
    if rank % gpn:
        raise SpecError(
            f"{path}.tensorParallel",
            f"tensorParallel x pipelineParallel = {rank} GPUs spans nodes, so it must be a multiple "
            f"of gpusPerNode {gpn} (whole nodes; vLLM's --nnodes divides the world size evenly)",
        )
    return GroupShape(rank // gpn, gpn, 1, 1, API_LEADER, True)


def uniform_gpus_per_node(allocatable: list[int] | tuple[int, ...]) -> int | None:
    """The GPUs of every node that has any, when they are all equal; else None."""
    counts = {n for n in allocatable if n > 0}
    return counts.pop() if len(counts) == 1 else None
