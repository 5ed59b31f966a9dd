"""MooncakeConnector: the prefill pushes the KV into the decode over the Mooncake transfer engine.

Read from vLLM 0.32's source (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/
mooncake_connector.py`` and ``mooncake_utils.py``, ``vllm/v1/engine/core.py``, ``vllm/envs.py``):

Names
    ``MooncakeConnector`` in the CRD, ``mooncake`` in the routing table; no transfer modes.
``--kv-transfer-config``
    ``kv_role`` kv_producer (prefill) / kv_consumer (decode) (``kv_both`` would make an instance
    both). ``kv_connector_extra_config`` keys vLLM reads: ``mooncake_protocol`` (``rdma`` by
    default; ``tcp`` runs without RDMA NICs), ``device_name`` (the RDMA devices), ``num_workers``
    (sender threads, 10). ``bootstrap_server_address`` would move every prefill's registration to
    one external server; pdserve refuses it, because its router names each prefill's own.
    pdserve renders ``engine_id``: vLLM's default is a random uuid per start, which no router
    could know. With data parallelism vLLM appends ``_dp<global rank>`` per engine
    (``core.py``), so the engine of global DP rank ``r`` of instance ``I`` is ``I_dp<r>`` (``I``
    at DP1); every pod of a multi-node instance renders the instance's name.
Pod
    The prefill's rank 0 (TP 0, PP 0; one per node's API server under hybrid load balancing)
    runs a bootstrap HTTP server on ``0.0.0.0:$VLLM_MOONCAKE_BOOTSTRAP_PORT`` (default 8998)
    where each worker registers the ZMQ address it listens on (``/register``) and the decode
    looks the engine up (``/query``: per DP rank, the engine id and each TP/PP rank's address).
    pdserve sets the port to 8998 explicitly and declares it (``mc-bootstrap``) on prefill pods.
    The workers' ZMQ side channels and the transfer engine's RPC port are random ports on the
    address in ``VLLM_HOST_IP`` (``get_ip()``; set to the pod IP): they cannot be declared, so a
    NetworkPolicy must let prefill and decode pods reach each other on any port. The transfer
    engine registers the KV cache for RDMA: ``IPC_LOCK``, as for NIXL.
Routing table
    Prefill instances (and each node's endpoint under hybrid load balancing) carry ``kvAddress``
    ``http://<ip>:8998``, the bootstrap server; decode instances carry none.
``kv_transfer_params``
    Prefill leg: ``{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}``
    (without ``transfer_id`` vLLM logs "Missing transfer_id" and never sends the KV). vLLM 0.32's
    prefill answers **no** ``kv_transfer_params`` (``request_finished`` returns None); it holds
    the blocks for up to ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (480 s) until a decode asks for
    transfer ``T``. Decode leg: ``{"do_remote_decode": false, "do_remote_prefill": true,
    "transfer_id": T, "remote_engine_id": "I_dp<r>", "remote_bootstrap_addr": "http://<ip>:8998"}``;
    all three are required (``update_state_after_alloc``), else vLLM logs "Got invalid
    KVTransferParams" and the decode never gets the KV. The decode queries the bootstrap server
    once per address, asks each of the prefill engine's workers for transfer ``T``, and the
    prefill writes the blocks into the decode's memory (waiting for its prefill to finish if the
    decode came first). An engine id the bootstrap server does not know fails the decode's load.
Flow
    pdserve sends the legs one after the other, as for NIXL: a decode is sent only once its
    prefill succeeded, so a failed prefill never leaves a decode waiting out the 480 s timeout.
    The handoff names the prefill and the transfer, not a decode: a decode that could not be
    reached is replaced by another with the same parameters while the prefill holds the KV.
Request ids
    Each leg its own (``<stem>-p<n>``, ``<stem>-d<n>``); the transfer id is the prefill leg's id,
    unique per prefill, so a replacement decode names the same transfer.
Observed on real vLLM (0.32.0+cpu, torch 2.13.0, mooncake-transfer-engine-non-cuda 0.3.13.post1, a
2-core machine without GPUs; ``make e2e-vllm``'s Mooncake case)
    The transfer engine itself starts over TCP (``TransferEngine.initialize(host, "P2PHANDSHAKE",
    "tcp", "")`` returns 0, RPC on a random port), but its native library needs
    ``libibverbs.so.1`` and libnl even for TCP. vLLM then logs "MooncakeConnector setting KV cache
    layout to LBHNC" and each engine dies at start in ``MooncakeConnectorWorker.__init__``:
    ``torch.accelerator.current_device_index()`` raises "Found no NVIDIA driver on your system" (the
    CUDA torch wheel on a machine without a driver). So no real exchange could be recorded here;
    the wire format above is read from the source and is what the simulator plays
    (tests/unit/test_kv_route.py, test_kv_simulate.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pdserve.kv.base import KVConnector, Names
from pdserve.kv.checks import DECODE, PREFILL, FieldCheck, field_problems, is_true, nonempty_str, remote_flags
from pdserve.kv.render import IPC_LOCK, ExtraProblem, LocalRun, Pair, PodKV, Render, Rule, container_port
from pdserve.kv.route import HandoffParams, LegIds, LegPlan, Peer, SerialRoute, leg_id, prefill_only
from pdserve.kv.simulate import PullNotice, SimPrefill, Simulate, rank_after

NAMES = Names(crd="MooncakeConnector", table="mooncake")

#: vLLM's default VLLM_MOONCAKE_BOOTSTRAP_PORT (vllm/envs.py), set explicitly so the router knows it.
BOOTSTRAP_PORT = 8998
PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
HOST_ENV = "VLLM_HOST_IP"


# --- kv_transfer_params ---------------------------------------------------------------------------


def engine_id(instance: str, dp_size: int, rank: int) -> str:
    """vLLM's engine id of one DP engine of an instance rendered with ``engine_id`` = its name."""
    return f"{instance}_dp{rank}" if dp_size > 1 else instance


def bootstrap_address(host: str, port: int = BOOTSTRAP_PORT) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def prefill_params(transfer_id: str) -> dict[str, Any]:
    return {**remote_flags(PREFILL), "transfer_id": transfer_id}


def decode_params(transfer_id: str, remote_engine_id: str, bootstrap: str) -> dict[str, Any]:
    return {
        **remote_flags(DECODE),
        "transfer_id": transfer_id,
        "remote_engine_id": remote_engine_id,
        "remote_bootstrap_addr": bootstrap,
    }


def _http_address(value: object) -> bool:
    """``http://host:port``, as vLLM appends ``/query`` to it."""
    if not isinstance(value, str):
        return False
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None and not parts.path


HANDOFF_CHECKS: tuple[FieldCheck, ...] = (
    ("do_remote_prefill", is_true),
    ("transfer_id", nonempty_str),
    ("remote_engine_id", nonempty_str),
    ("remote_bootstrap_addr", _http_address),
)


def handoff_problems(params: object) -> list[str]:
    """Problems with a Mooncake decode request's ``kv_transfer_params``."""
    return field_problems(params, HANDOFF_CHECKS)


# --- render ---------------------------------------------------------------------------------------


class _SameBlockSize:
    rule = Rule(
        "mooncake-block-size",
        "prefill.args --block-size, decode.args --block-size",
        "MooncakeConnector: when both roles set --block-size, they set the same",
        "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py "
        "_validate_asymmetric_region_lengths (a block is copied to one block: region lengths must match)",
    )

    def problems(self, pair: Pair) -> list[str]:
        p, d = pair.prefill.flag("--block-size"), pair.decode.flag("--block-size")
        if p is None or d is None or p == d:
            return []
        return [
            f"spec.prefill.args, spec.decode.args: --block-size {p} on prefill and {d} on decode; with "
            "MooncakeConnector both roles must use the same block size"
        ]


SAME_BLOCK_SIZE = _SameBlockSize()


class MooncakeRender(Render):
    pod_ip_env = (HOST_ENV,)
    owned_env = (
        (
            PORT_ENV,
            f"is set by pdserve to {BOOTSTRAP_PORT} (each prefill's bootstrap server, which the router "
            "names in every decode request)",
        ),
    )
    address_roles = frozenset({PREFILL})
    rules = (SAME_BLOCK_SIZE,)
    sources = (
        (
            "tp-ratio",
            "kv_connector/v1/mooncake/mooncake_connector.py _get_tp_ratio (Mooncake: asserts divisibility)",
        ),
        ("same-cache-dtype", "Mooncake copies raw KV blocks"),
    )
    unchecked = (
        "Mooncake with different prefill and decode tensorParallel needs KV regions whose lengths are "
        "in the TP ratio (`mooncake_connector.py _validate_asymmetric_region_lengths`, at the first "
        "transfer)"
    )
    local = LocalRun(
        port_env=PORT_ENV,
        module="mooncake.engine",
        install="pip install mooncake-transfer-engine (GPUs) or mooncake-transfer-engine-non-cuda (no "
        "GPU; with kvTransfer.extraConfig mooncake_protocol: tcp); its native library needs "
        "libibverbs.so.1 (apt-get install libibverbs1)",
    )

    def spec_problems(self, mode: str | None, extra: Mapping[str, Any]) -> list[ExtraProblem]:
        if "bootstrap_server_address" in extra:
            return [
                ExtraProblem(
                    "bootstrap_server_address",
                    "pdserve's router names each prefill's own bootstrap server; leave it out",
                )
            ]
        return []

    def engine_id(self, instance: str) -> str:
        return instance

    def pod(self, extra: Mapping[str, Any], role: str, dp: int, tp: int, first_rank: int = 0) -> PodKV:
        if role != PREFILL:
            return PodKV([], [], (IPC_LOCK,))
        env = [{"name": PORT_ENV, "value": str(BOOTSTRAP_PORT)}]
        return PodKV(env, [container_port("mc-bootstrap", BOOTSTRAP_PORT)], (IPC_LOCK,))

    def kv_address(
        self, extra: Mapping[str, Any], role: str, host: str, port: int | None = None
    ) -> str | None:
        if role != PREFILL:
            return None
        return bootstrap_address(host, BOOTSTRAP_PORT if port is None else port)

    def local_ports(self, role: str, dp: int, tp: int, base: int) -> tuple[int, ...]:
        return (base,) if role == PREFILL else ()


# --- route ----------------------------------------------------------------------------------------


class MooncakeRoute(SerialRoute):
    name = NAMES.table

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Peer, decode: Peer, uid: str
    ) -> LegIds:
        """The transfer id is the prefill leg's: the decode names the transfer it pulls."""
        prefill_id = leg_id(base, PREFILL, prefill_leg)
        return LegIds(prefill_id, leg_id(base, DECODE, decode_leg), transfer_id=prefill_id)

    def prefill_leg(self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds) -> LegPlan:
        out = prefill_only(body)
        out["kv_transfer_params"] = prefill_params(ids.transfer_id or ids.prefill)
        return LegPlan(out, prefill.rank_header)

    def handoff_problems(self, answer: object) -> list[str]:
        return []  # vLLM 0.32's prefill answers none: the router names the transfer itself

    def decode_leg(
        self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds, handoff: HandoffParams | None
    ) -> LegPlan:
        instance = prefill.instance
        out = dict(body)
        out["kv_transfer_params"] = decode_params(
            ids.transfer_id or ids.prefill,
            engine_id(instance.name, instance.dp_size, prefill.dp_rank),
            prefill.kv_address or "",
        )
        return LegPlan(out, decode.rank_header)


def route(mode: str | None) -> MooncakeRoute:
    return MooncakeRoute()


# --- simulate -------------------------------------------------------------------------------------


class MooncakeSimulate(Simulate):
    host_env = (HOST_ENV,)
    port_env = PORT_ENV
    default_port = BOOTSTRAP_PORT
    holds_kv = True  # until a decode asks for the transfer (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)

    def recognises(self, params: Mapping[str, Any], leg: str) -> int:
        if "remote_bootstrap_addr" in params:
            return 2
        return 1 if leg == PREFILL and "transfer_id" in params else 0

    def prefill_answer(self, prefill: SimPrefill, params: Mapping[str, Any]) -> None:
        """None, as vLLM 0.32: its prefill keeps the blocks for the decode that names the transfer."""
        return None

    def handoff_problems(self, params: Mapping[str, Any]) -> list[str]:
        return handoff_problems(params)

    def hold_key(self, params: Mapping[str, Any], request_id: str) -> str:
        return str(params.get("transfer_id") or request_id)

    def pull_notice(self, params: Mapping[str, Any]) -> PullNotice | None:
        """The decode's transfer request, sent where vLLM's goes: the prefill's bootstrap address."""
        url = params.get("remote_bootstrap_addr")
        if not _http_address(url):
            return None
        return PullNotice(str(url), str(params.get("remote_engine_id")), str(params.get("transfer_id")))

    def engine_rank(self, engine_id: str, instance: str) -> int | None:
        if engine_id == instance:
            return 0
        return rank_after(engine_id, f"{instance}_dp")


CONNECTOR = KVConnector(NAMES, MooncakeRender(), route, MooncakeSimulate())
