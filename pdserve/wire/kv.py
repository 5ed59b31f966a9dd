"""vLLM's ``kv_transfer_params`` per connector: what the prefill is asked for, what it must
answer, and how a decode request's parameters are checked.

The proxy uses the ``*_problems`` functions to refuse a handoff that a real decode could not
complete (vLLM then waits forever for KV that never comes, and dies when the client gives
up); the simulator uses the same functions to answer 400 to such a decode request.
Each ``*_problems`` function returns the names of missing or malformed fields, empty when
the parameters are usable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# --- NIXL ---------------------------------------------------------------------------------------

#: Fields a NIXL prefill response must carry for the decode to pull the KV.
NIXL_HANDOFF_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


def nixl_prefill_params() -> dict[str, Any]:
    """``kv_transfer_params`` of a NIXL prefill request (vLLM's two-step protocol, step one)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def nixl_handoff_problems(params: object) -> list[str]:
    """Problems with the ``kv_transfer_params`` that a NIXL prefill returned (and the decode receives)."""
    if not isinstance(params, Mapping):
        return ["kv_transfer_params"]
    problems = []
    if params.get("do_remote_prefill") is not True:
        problems.append("do_remote_prefill")
    if not _nonempty_str(params.get("remote_engine_id")):
        problems.append("remote_engine_id")
    if not _block_ids(params.get("remote_block_ids")):
        problems.append("remote_block_ids")
    if not _nonempty_str(params.get("remote_host")):
        problems.append("remote_host")
    if not _port(params.get("remote_port")):
        problems.append("remote_port")
    # Older vLLM does not send remote_request_id; when it is there it must be usable.
    if "remote_request_id" in params and not _nonempty_str(params["remote_request_id"]):
        problems.append("remote_request_id")
    return problems


# --- MoRIIO -------------------------------------------------------------------------------------

MORIIO_READ_HANDOFF_FIELDS = ("remote_engine_id", "remote_block_ids")
_MORIIO_ID = re.compile(
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


def parse_moriio_request_id(request_id: str) -> MoriioRequestId | None:
    """Parse ``___prefill_addr_<P>___decode_addr_<D>_<uuid hex>``; None when it is not one.

    vLLM prefixes ids with ``cmpl-``/``chatcmpl-`` and may append ``-<n>-<salt>``; both are ignored.
    """
    start = request_id.find("___prefill_addr_")
    if start < 0:
        return None
    body = re.sub(r"(-\d+-[0-9a-f]{8})$", "", request_id[start:])
    match = _MORIIO_ID.match(body)
    if match is None:
        return None
    return MoriioRequestId(match["prefill"], match["decode"], match["uid"])


def moriio_prefill_params(transfer_id: str, decode_dp_size: int, decode_tp_size: int) -> dict[str, Any]:
    """``kv_transfer_params`` of a MoRIIO prefill request: the decode's shape travels with it."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": transfer_id,
        "remote_dp_size": decode_dp_size,
        "remote_tp_size": decode_tp_size,
    }


def moriio_decode_params(
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
    params: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": transfer_id,
        "remote_dp_size": prefill_dp_size,
        "remote_tp_size": prefill_tp_size,
    }
    if prefill_answer is not None:
        params.update(prefill_answer)
        params.update(do_remote_decode=False, do_remote_prefill=True, transfer_id=transfer_id)
        params["remote_dp_size"] = prefill_dp_size
        params["remote_tp_size"] = prefill_tp_size
    if prefill_dp_rank is not None:
        params["remote_dp_rank"] = prefill_dp_rank
    return params


def moriio_handoff_problems(params: object, mode: str) -> list[str]:
    """Problems with a MoRIIO decode request's ``kv_transfer_params`` (READ also needs the prefill's ids)."""
    if not isinstance(params, Mapping):
        return ["kv_transfer_params"]
    problems = []
    if params.get("do_remote_prefill") is not True:
        problems.append("do_remote_prefill")
    if not _nonempty_str(params.get("transfer_id")):
        problems.append("transfer_id")
    if mode == "READ":
        if not _nonempty_str(params.get("remote_engine_id")):
            problems.append("remote_engine_id")
        if not _block_ids(params.get("remote_block_ids")):
            problems.append("remote_block_ids")
    return problems


def moriio_prefill_answer_problems(params: object) -> list[str]:
    """Problems with what a MoRIIO READ prefill returned: the decode needs its engine and block ids."""
    if not isinstance(params, Mapping):
        return ["kv_transfer_params"]
    problems = []
    if not _nonempty_str(params.get("remote_engine_id")):
        problems.append("remote_engine_id")
    if not _block_ids(params.get("remote_block_ids")):
        problems.append("remote_block_ids")
    return problems


# --- shared checks ------------------------------------------------------------------------------


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _port(value: object) -> bool:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _block_ids(value: object) -> bool:
    """vLLM sends one list of block ids per KV-cache group; a flat list is accepted too."""
    if not isinstance(value, list):
        return False
    if all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return True
    return all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in value)
