"""NIXL: vLLM's two-step protocol, prefill then decode.

The decode receives the prefill's ``kv_transfer_params`` exactly as returned: real vLLM needs
every field (``remote_host``, ``remote_port``, ``remote_request_id``, ...), and a decode that
gets only some of them waits forever for KV that never comes.

The handoff names the prefill (host, port, engine, request and block ids), not a decode: any
decode can pull it, so a decode that could not be reached may be replaced by another one
with the same handoff while the prefill still holds the KV. Each leg has its own request id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pdserve.proxy.connectors.base import LegIds, LegPlan, leg_id, prefill_only
from pdserve.routing import Slot
from pdserve.wire.kv import nixl_handoff_problems, nixl_prefill_params


class NixlConnector:
    name: ClassVar[str] = "nixl"
    concurrent = False
    reusable_handoff = True

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Slot, decode: Slot, uid: str
    ) -> LegIds:
        return LegIds(leg_id(base, "prefill", prefill_leg), leg_id(base, "decode", decode_leg))

    def prefill_leg(self, body: Mapping[str, Any], prefill: Slot, decode: Slot, ids: LegIds) -> LegPlan:
        out = prefill_only(body)
        out["kv_transfer_params"] = nixl_prefill_params()
        return LegPlan(out, prefill.rank_header)

    def handoff_problems(self, answer: object) -> list[str]:
        return nixl_handoff_problems(answer)

    def decode_leg(
        self,
        body: Mapping[str, Any],
        prefill: Slot,
        decode: Slot,
        ids: LegIds,
        handoff: Mapping[str, Any] | None,
    ) -> LegPlan:
        out = dict(body)
        out["kv_transfer_params"] = dict(handoff) if handoff is not None else None
        return LegPlan(out, decode.rank_header)
