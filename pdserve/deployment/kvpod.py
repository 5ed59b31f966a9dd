"""What an engine pod needs for its KV connector: side-channel ports, environment, capabilities.

Read from vLLM's connectors and docs (the version pdserve targets, 0.32):

NixlConnector (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py``)
    The handshake listener of each data-parallel engine binds
    ``VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`` on ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and
    answers for every TP rank of that engine (the request names the TP rank). So one pod of DP
    ``d`` listens on ``d`` consecutive ports from the base; the base may be the same on every pod,
    because each pod has its own IP (docs/features/nixl_connector_usage.md: "using the same port
    number across different hosts is fine"). pdserve sets the base to vLLM's default 5600
    explicitly, sets the host to the pod IP (vLLM's default is ``localhost``, unreachable from the
    peer), and names each port ``nixl-<rank>``. ``UCX_TLS`` and ``UCX_NET_DEVICES`` default to
    ``all`` as vLLM's guide shows; set them per cluster (for example ``rc,cuda_copy,cuda_ipc`` and
    ``mlx5_0:1``) in the role's ``env`` or template.
MoRIIOConnector (``.../moriio/moriio_common.py``, ``moriio_connector.py``)
    The peer dials ``handshake_port + dp_rank * tp_size + tp_rank`` and notifications go to
    ``notify_port`` plus a rank offset, on the address in ``VLLM_HOST_IP`` (the pod IP). pdserve
    declares both ranges, ``DP x TP`` ports each, named ``mori-hs-<n>`` and ``mori-nt-<n>``.
Both
    RDMA memory registration pins the KV cache: the engine container gets the ``IPC_LOCK``
    capability, which lifts ``RLIMIT_MEMLOCK`` for it (mlock(2): a process with CAP_IPC_LOCK may
    lock any amount), so the runtime's default memlock limit (often 64 KiB or 8 MiB) no longer
    caps registration. The RDMA devices themselves come from the cluster's device plugin
    (``rdma/...``, ``nvidia.com/...`` resources in the template's ``resources.limits``).

The simulator (engine ``sim``) opens no side channel and gets none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment.kvconfig import MORIIO, NIXL, moriio_ports
from pdserve.deployment.spec.pddeployment import KVTransferSpec

#: vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT (vllm/envs.py), set explicitly so the ports are known.
NIXL_SIDE_CHANNEL_PORT = 5600
#: vLLM's NIXL guide's transport settings, as defaults a user overrides per cluster.
UCX_DEFAULTS = (("UCX_TLS", "all"), ("UCX_NET_DEVICES", "all"))
IPC_LOCK = "IPC_LOCK"


@dataclass(frozen=True)
class KVPodSettings:
    env: list[dict[str, Any]] = field(default_factory=list)
    ports: list[dict[str, Any]] = field(default_factory=list)
    capabilities: tuple[str, ...] = ()


def kv_pod_settings(
    kv: KVTransferSpec, data_parallel: int, tensor_parallel: int, first_rank: int = 0
) -> KVPodSettings:
    """The env (beyond the pod-IP variables), container ports and capabilities of one engine pod.

    ``data_parallel`` ranks run in the pod from global rank ``first_rank`` (a pod of a multi-node
    group): NIXL's listener is ``base + data_parallel_index``, the global rank
    (``nixl/base_scheduler.py``), while MoRIIO folds the rank to the node-local one
    (``moriio_common.py`` ``fold_local_rank``), so its ports start at the base on every pod.
    """
    if kv.connector == NIXL:
        env = [{"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(NIXL_SIDE_CHANNEL_PORT)}]
        env += [{"name": name, "value": value} for name, value in UCX_DEFAULTS]
        ranks = range(first_rank, first_rank + data_parallel)
        ports = [_port(f"nixl-{rank}", NIXL_SIDE_CHANNEL_PORT + rank) for rank in ranks]
        return KVPodSettings(env, ports, (IPC_LOCK,))
    if kv.connector == MORIIO:
        handshake, notify = moriio_ports(kv)
        ranks = range(data_parallel * tensor_parallel)
        ports = [_port(f"mori-hs-{n}", handshake + n) for n in ranks]
        ports += [_port(f"mori-nt-{n}", notify + n) for n in ranks]
        return KVPodSettings([], ports, (IPC_LOCK,))
    return KVPodSettings()


def _port(name: str, number: int) -> dict[str, Any]:
    return {"name": name, "containerPort": number, "protocol": "TCP"}
