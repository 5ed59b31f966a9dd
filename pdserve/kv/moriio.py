"""MoRIIOConnector (AMD MoRI on ROCm): both peers' KV addresses travel in the request id.

Read from vLLM 0.32 (``vllm/distributed/kv_transfer/kv_connector/v1/moriio/``):

Names
    ``MoRIIOConnector`` in the CRD, ``moriio`` in the routing table; transfer modes READ (the
    decode pulls, so it needs the prefill's engine and block ids: serial, like NIXL) and WRITE
    (the prefill pushes into the decode, so both legs go out at once).
``--kv-transfer-config``
    ``kv_role`` kv_producer / kv_consumer (vLLM sets its producer/consumer role from it). Its
    ``kv_connector_extra_config`` must carry ``handshake_port``, ``notify_port``, ``http_port``,
    ``proxy_ip`` and ``proxy_ping_port`` (read with ``[]``), and ``read_mode`` selects READ (true)
    or WRITE (false). ``proxy_ip`` is left empty: vLLM then starts no discovery heartbeat,
    because pdserve's router learns instances from the routing table, not from pings.
    ``extraConfig`` is merged last (``backend``, ``qp_per_transfer``, ...); keys that would
    contradict the spec are refused (``read_mode`` against ``transferMode``, ports that are not).
Pod
    The peer dials ``handshake_port + dp_rank * tp_size + tp_rank`` and notifications go to
    ``notify_port`` plus a rank offset, on the address in ``VLLM_HOST_IP`` (the pod IP). pdserve
    declares both ranges, ``DP x TP`` ports each, named ``mori-hs-<n>`` and ``mori-nt-<n>``; the
    rank is folded to the node-local one (``moriio_common.py`` ``fold_local_rank``), so every pod
    of a multi-node group starts at the base. ``IPC_LOCK`` for the RDMA registration.
Routing table
    Every instance (and every node's endpoint) carries ``kvAddress``
    ``host:<ip>,handshake:<port>,notify:<port>``, the format vLLM parses from the request id;
    ``notify`` is the base port, vLLM adds the rank offset.
Request ids
    Both legs share one id naming both peers' KV addresses,
    ``___prefill_addr_<P>___decode_addr_<D>_<uuid hex>``, so a handoff belongs to the one decode
    it was made for: a failed decode always means a new prefill, and every attempt a fresh id.
``kv_transfer_params``
    Both legs carry the transfer id and the peer's DP/TP shape; the decode's ``max_tokens`` is
    one less (the prefill produced the first token); only the prefill leg carries the DP rank
    header (the decode learns the prefill's rank from ``remote_dp_rank``). A node of a multi-node
    instance with an API server per node is a peer of its own: its KV address, its local DP size
    and the local rank, as that node's API server numbers them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.kv.base import KVConnector, Names
from pdserve.kv.checks import (
    DECODE,
    PREFILL,
    FieldCheck,
    block_ids,
    field_problems,
    int_value,
    is_port,
    is_true,
    nonempty_str,
    remote_flags,
)
from pdserve.kv.render import IPC_LOCK, ExtraProblem, LocalRun, Pair, PodKV, Render, Rule, container_port
from pdserve.kv.route import HandoffParams, LegIds, LegPlan, Peer, prefill_only
from pdserve.kv.simulate import SimPrefill, Simulate

READ = "READ"
WRITE = "WRITE"
NAMES = Names(crd="MoRIIOConnector", table="moriio", modes=(READ, WRITE))

#: vLLM's MoRIIOConstants.DEFAULT_HANDSHAKE_PORT / DEFAULT_NOTIFY_PORT.
HANDSHAKE_PORT = 6301
NOTIFY_PORT = 61005
#: Must parse as an int in vLLM even though no heartbeat is sent (``proxy_ip`` is empty).
PROXY_PING_PORT = 36367
PORT_KEYS = ("handshake_port", "notify_port")
#: Keys only MoRIIO's legs carry (how the simulator recognises them when not told).
_SHAPE_KEYS = ("remote_dp_size", "remote_tp_size", "remote_dp_rank")

MORIIO_DP_TP_MESSAGE = (
    "prefill and decode: with MoRIIOConnector an instance cannot have both dataParallel > 1 and "
    "tensorParallel > 1 (vLLM gives those ranks colliding notify ports)"
)


# --- request ids ----------------------------------------------------------------------------------

_REQUEST_ID = re.compile(
    r"^___prefill_addr_(?P<prefill>.+?)___decode_addr_(?P<decode>.+)_(?P<uid>[0-9a-f]{32})$"
)


@dataclass(frozen=True)
class MoriioRequestId:
    """MoRIIO encodes both peers' KV addresses in the request id shared by the two legs."""

    prefill_kv_address: str
    decode_kv_address: str
    uid: str

    def __str__(self) -> str:
        return f"___prefill_addr_{self.prefill_kv_address}___decode_addr_{self.decode_kv_address}_{self.uid}"


def parse_request_id(request_id: str) -> MoriioRequestId | None:
    """Parse ``___prefill_addr_<P>___decode_addr_<D>_<uuid hex>``; None when it is not one.

    vLLM prefixes ids with ``cmpl-``/``chatcmpl-`` and may append ``-<n>-<salt>``; both are ignored.
    """
    start = request_id.find("___prefill_addr_")
    if start < 0:
        return None
    body = re.sub(r"(-\d+-[0-9a-f]{8})$", "", request_id[start:])
    match = _REQUEST_ID.match(body)
    if match is None:
        return None
    return MoriioRequestId(match["prefill"], match["decode"], match["uid"])


# --- kv_transfer_params ---------------------------------------------------------------------------


#: What a READ prefill answers and its decode passes on; None until then (and in WRITE mode).
_ANSWERED = ("remote_engine_id", "remote_block_ids")


def _leg_params(leg: str, transfer_id: str, peer_dp_size: int, peer_tp_size: int) -> dict[str, Any]:
    """What both legs carry: vLLM's flags, the transfer id and the other leg's DP/TP shape."""
    return {
        **remote_flags(leg),
        **dict.fromkeys(_ANSWERED),
        "transfer_id": transfer_id,
        "remote_dp_size": peer_dp_size,
        "remote_tp_size": peer_tp_size,
    }


def prefill_params(transfer_id: str, decode_dp_size: int, decode_tp_size: int) -> dict[str, Any]:
    """``kv_transfer_params`` of a MoRIIO prefill request: the decode's shape travels with it."""
    return _leg_params(PREFILL, transfer_id, decode_dp_size, decode_tp_size)


def decode_params(
    transfer_id: str,
    prefill_dp_size: int,
    prefill_tp_size: int,
    prefill_dp_rank: int | None,
    prefill_answer: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``kv_transfer_params`` of a MoRIIO decode request.

    READ mode passes the prefill's answer (``prefill_answer``: engine id and block ids); WRITE mode
    sends the decode concurrently, before that answer exists (``prefill_answer`` None).
    """
    params = _leg_params(DECODE, transfer_id, prefill_dp_size, prefill_tp_size)
    if prefill_answer is not None:
        own = {key: value for key, value in params.items() if key not in _ANSWERED}
        params.update(prefill_answer)
        params.update(own)  # the answer's ids and extra fields; this leg's flags, id and shape
    if prefill_dp_rank is not None:
        params["remote_dp_rank"] = prefill_dp_rank
    return params


#: What a READ decode needs of the prefill's answer.
ANSWER_CHECKS: tuple[FieldCheck, ...] = (("remote_engine_id", nonempty_str), ("remote_block_ids", block_ids))


def handoff_problems(params: object, mode: str) -> list[str]:
    """Problems with a MoRIIO decode request's ``kv_transfer_params`` (READ also needs the prefill's ids)."""
    checks = [("do_remote_prefill", is_true), ("transfer_id", nonempty_str)]
    return field_problems(params, [*checks, *(ANSWER_CHECKS if mode == READ else ())])


def prefill_answer_problems(params: object) -> list[str]:
    """Problems with what a MoRIIO READ prefill returned: the decode needs its engine and block ids."""
    return field_problems(params, ANSWER_CHECKS)


def decode_mode(params: Mapping[str, Any]) -> str:
    """WRITE-mode decode requests are sent before the prefill answered: no engine id yet."""
    return WRITE if params.get("remote_engine_id") is None else READ


# --- render ---------------------------------------------------------------------------------------


def ports(extra: Mapping[str, Any]) -> tuple[int, int]:
    """(handshake, notify) base ports in effect, after ``extraConfig`` overrides."""
    return (
        int(extra.get("handshake_port") or HANDSHAKE_PORT),
        int(extra.get("notify_port") or NOTIFY_PORT),
    )


class _AmdOnly:
    rule = Rule(
        "moriio-amd",
        "kvTransfer.connector, gpuResource",
        "MoRIIOConnector only with gpuResource amd.com/gpu",
        "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py (imports mori.io, AMD's "
        "MoRI on ROCm; CUDA builds have no MoRI)",
        "kvTransfer.connector: MoRIIOConnector moves KV between AMD GPUs (ROCm): set gpuResource to "
        "amd.com/gpu, or use NixlConnector",
        cel=True,
    )

    def problems(self, pair: Pair) -> list[str]:
        return [] if pair.gpu_resource == "amd.com/gpu" else [f"spec.{self.rule.message}"]


class _NotDpAndTp:
    rule = Rule(
        "moriio-dp-and-tp",
        "prefill/decode dataParallel, tensorParallel",
        "with MoRIIOConnector, no instance has both dataParallel > 1 and tensorParallel > 1",
        "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_common.py MoRIIOConfig.from_vllm_config: "
        "notify_port = base + get_port_offset(dp_rank, tp_rank) without tp_size, so ranks (0,1) and (1,0) "
        "bind the same port",
        MORIIO_DP_TP_MESSAGE,
        cel=True,
    )

    def problems(self, pair: Pair) -> list[str]:
        both = any(s.data_parallel > 1 and s.tensor_parallel > 1 for s in (pair.prefill, pair.decode))
        return [f"spec.{self.rule.message}"] if both else []


AMD_ONLY = _AmdOnly()
NOT_DP_AND_TP = _NotDpAndTp()


class MoriioRender(Render):
    pod_ip_env = ("VLLM_HOST_IP",)
    address_roles = frozenset({PREFILL, DECODE})
    rules = (AMD_ONLY, NOT_DP_AND_TP)
    sources = (
        (
            "tp-ratio",
            "kv_connector/v1/moriio/moriio_connector.py get_moriio_remote_tp_rank "
            "(MoRIIO: raises ValueError)",
        ),
        ("same-cache-dtype", "MoRIIO copies raw KV blocks"),
    )
    unchecked = (
        "MoRIIO with different prefill and decode tensorParallel needs replicated KV heads "
        "(`min(TP) >= num_kv_heads`) or an MLA model (`moriio_connector.py "
        "validate_moriio_heterogeneous_tp_kv_heads`)"
    )
    local = LocalRun(
        refused="MoRIIOConnector uses fixed handshake/notify ports, so two vLLM instances cannot share one "
        "machine; run MoRIIO manifests locally with --engine sim, or on a cluster"
    )

    def spec_problems(self, mode: str | None, extra: Mapping[str, Any]) -> list[ExtraProblem]:
        """The keys pdserve reads back (ports for kvAddress) or derives (read_mode) must agree with it."""
        found = [
            ExtraProblem(key, "expected a port number 1-65535", (extra[key],))
            for key in PORT_KEYS
            if key in extra and not is_port(int_value(extra[key]))
        ]
        if "read_mode" in extra:
            read = str(extra["read_mode"]).lower().strip() in ("true", "1")
            if read != (mode == READ):
                found.append(
                    ExtraProblem(
                        "read_mode",
                        f"contradicts transferMode {mode}; leave read_mode out, pdserve derives it from "
                        "transferMode",
                    )
                )
        return found

    def shape_problems(self, extra: Mapping[str, Any], ranks: int) -> list[tuple[str, str]]:
        """The per-rank ports (base + rank) must stay ports."""
        return [
            (key, f"needs {ranks} ports from {base} (one per rank), past 65535; lower {key}")
            for key, base in zip(PORT_KEYS, ports(extra), strict=True)
            if base + ranks - 1 > 65535
        ]

    def extra_config(self, mode: str | None, http_port: int) -> dict[str, Any]:
        return {
            "handshake_port": HANDSHAKE_PORT,
            "notify_port": NOTIFY_PORT,
            "http_port": http_port,
            "proxy_ip": "",
            "proxy_ping_port": PROXY_PING_PORT,
            "read_mode": mode == READ,
        }

    def pod(self, extra: Mapping[str, Any], role: str, dp: int, tp: int, first_rank: int = 0) -> PodKV:
        handshake, notify = ports(extra)
        ranks = range(dp * tp)
        declared = [container_port(f"mori-hs-{n}", handshake + n) for n in ranks]
        declared += [container_port(f"mori-nt-{n}", notify + n) for n in ranks]
        return PodKV([], declared, (IPC_LOCK,))

    def kv_address(self, extra: Mapping[str, Any], role: str, host: str, port: int | None = None) -> str:
        handshake, notify = ports(extra)
        return f"host:{host},handshake:{handshake},notify:{notify}"


# --- route ----------------------------------------------------------------------------------------


class MoriioRoute:
    name = NAMES.table
    reusable_handoff = False

    def __init__(self, transfer_mode: str) -> None:
        if transfer_mode not in NAMES.modes:
            raise ValueError(f"MoRIIO transfer mode must be READ or WRITE, got {transfer_mode!r}")
        self.transfer_mode = transfer_mode
        self.concurrent = transfer_mode == WRITE

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Peer, decode: Peer, uid: str
    ) -> LegIds:
        request_id = str(MoriioRequestId(prefill.kv_address or "", decode.kv_address or "", uid))
        return LegIds(request_id, request_id, transfer_id=uid)

    def prefill_leg(self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds) -> LegPlan:
        out = prefill_only(body)
        out["kv_transfer_params"] = prefill_params(
            _transfer_id(ids), decode.local_dp_size, decode.instance.tp_size
        )
        return LegPlan(out, prefill.rank_header)

    def handoff_problems(self, answer: object) -> list[str]:
        # In WRITE mode the decode never sees the prefill's answer; only its status matters.
        return prefill_answer_problems(answer) if self.transfer_mode == READ else []

    def decode_leg(
        self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds, handoff: HandoffParams | None
    ) -> LegPlan:
        out = dict(body)
        for key in ("max_tokens", "max_completion_tokens"):
            value = out.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = max(1, value - 1)
        out["kv_transfer_params"] = decode_params(
            _transfer_id(ids),
            prefill.local_dp_size,
            prefill.instance.tp_size,
            prefill.rank_header,
            handoff if self.transfer_mode == READ else None,
        )
        return LegPlan(out, None)


def _transfer_id(ids: LegIds) -> str:
    if ids.transfer_id is None:
        raise ValueError("MoRIIO legs need a transfer id")
    return ids.transfer_id


def route(mode: str | None) -> MoriioRoute:
    return MoriioRoute(mode or "")


# --- simulate -------------------------------------------------------------------------------------


class MoriioSimulate(Simulate):
    host_env = ("VLLM_HOST_IP",)
    default_port = HANDSHAKE_PORT

    def recognises(self, params: Mapping[str, Any], leg: str) -> int:
        if any(key in params for key in _SHAPE_KEYS):
            return 2
        return 1 if leg == DECODE and "transfer_id" in params else 0

    def prefill_answer(self, prefill: SimPrefill, params: Mapping[str, Any]) -> dict[str, Any]:
        """The transfer id echoed, with the engine and block ids READ needs."""
        engine = prefill.engine
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": str(params.get("transfer_id")),
            "remote_engine_id": engine.engine_id,
            "remote_block_ids": prefill.blocks,
            "remote_host": engine.kv_host,
            "remote_port": engine.kv_port,
            "remote_dp_rank": engine.rank,
            "tp_size": engine.tp_size,
        }

    def handoff_problems(self, params: Mapping[str, Any]) -> list[str]:
        return handoff_problems(params, decode_mode(params))

    def malformed(self, answer: Mapping[str, Any]) -> dict[str, Any]:
        """No engine id, no block ids."""
        return {k: v for k, v in answer.items() if k not in ("remote_engine_id", "remote_block_ids")}

    def record(self, request_id: str | None) -> dict[str, Any]:
        """Every request's id parsed as MoRIIO's, so tests see both peers' addresses."""
        parsed = parse_request_id(request_id) if request_id else None
        return {
            "moriio_request_id": None
            if parsed is None
            else {
                "prefill_kv_address": parsed.prefill_kv_address,
                "decode_kv_address": parsed.decode_kv_address,
                "uid": parsed.uid,
            }
        }


CONNECTOR = KVConnector(NAMES, MoriioRender(), route, MoriioSimulate())
