"""MoRIIO: both peers' KV addresses travel in the request id, a shared transfer id pairs the legs.

READ: the decode pulls, so it needs the prefill's engine and block ids (serial, like NIXL).
WRITE: the prefill pushes into the decode, so both legs go out at once.
The decode's ``max_tokens`` is one less because the prefill already produced the first token;
only the prefill leg carries the DP rank header (the decode learns the prefill's rank from
``remote_dp_rank``). A node of a multi-node instance with an API server per node is a peer of
its own: its KV address (the endpoint's), its local DP size and the local rank, all as that
node's API server numbers them (pdserve.routing.slots.Slot). The request id, shared by both
legs, names both peers' KV addresses, so a handoff belongs to the one decode it was made for:
a failed decode always means a new prefill, and every attempt gets a fresh id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pdserve.proxy.connectors.base import LegIds, LegPlan, prefill_only
from pdserve.routing import Slot
from pdserve.wire.kv import (
    MoriioRequestId,
    moriio_decode_params,
    moriio_prefill_answer_problems,
    moriio_prefill_params,
)


class MoriioConnector:
    name: ClassVar[str] = "moriio"

    def __init__(self, transfer_mode: str) -> None:
        if transfer_mode not in ("READ", "WRITE"):
            raise ValueError(f"MoRIIO transfer mode must be READ or WRITE, got {transfer_mode!r}")
        self.transfer_mode = transfer_mode

    reusable_handoff = False

    @property
    def concurrent(self) -> bool:
        return self.transfer_mode == "WRITE"

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Slot, decode: Slot, uid: str
    ) -> LegIds:
        request_id = str(MoriioRequestId(prefill.kv_address or "", decode.kv_address or "", uid))
        return LegIds(request_id, request_id, transfer_id=uid)

    def prefill_leg(self, body: Mapping[str, Any], prefill: Slot, decode: Slot, ids: LegIds) -> LegPlan:
        out = prefill_only(body)
        out["kv_transfer_params"] = moriio_prefill_params(
            _transfer_id(ids), decode.local_dp_size, decode.instance.tp_size
        )
        return LegPlan(out, prefill.rank_header)

    def handoff_problems(self, answer: object) -> list[str]:
        # In WRITE mode the decode never sees the prefill's answer; only its status matters.
        return moriio_prefill_answer_problems(answer) if self.transfer_mode == "READ" else []

    def decode_leg(
        self,
        body: Mapping[str, Any],
        prefill: Slot,
        decode: Slot,
        ids: LegIds,
        handoff: Mapping[str, Any] | None,
    ) -> LegPlan:
        out = dict(body)
        for key in ("max_tokens", "max_completion_tokens"):
            value = out.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = max(1, value - 1)
        out["kv_transfer_params"] = moriio_decode_params(
            _transfer_id(ids),
            prefill.local_dp_size,
            prefill.instance.tp_size,
            prefill.rank_header,
            handoff if self.transfer_mode == "READ" else None,
        )
        return LegPlan(out, None)


def _transfer_id(ids: LegIds) -> str:
    if ids.transfer_id is None:
        raise ValueError("MoRIIO legs need a transfer id")
    return ids.transfer_id
