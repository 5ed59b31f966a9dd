"""The route part of a connector: how the router turns a client request into a prefill leg and a
decode leg (pure: the proxy does the I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.kv.checks import DECODE, PREFILL

# --- route: the proxy's legs --------------------------------------------------------------------


class Instance(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def tp_size(self) -> int: ...


class Peer(Protocol):
    """What a connector reads of a slot (pdserve.routing.Slot): one engine and how to reach it."""

    @property
    def instance(self) -> Instance: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def rank_header(self) -> int | None: ...

    @property
    def kv_address(self) -> str | None: ...

    @property
    def local_dp_size(self) -> int: ...


@dataclass(frozen=True)
class LegIds:
    """The X-Request-Id each leg of an attempt carries, and the transfer id they share.

    vLLM takes its request id from X-Request-Id: two requests in flight with one id collide
    there (a cancel of one aborts the other), so a retry must never reuse an id.
    """

    prefill: str
    decode: str
    transfer_id: str | None = None


def leg_id(base: str, role: str, number: int) -> str:
    """``<base>-p<n>`` / ``<base>-d<n>``: the n-th prefill or decode leg of a request."""
    return f"{base}-{role[0]}{number}"


#: The ``kv_transfer_params`` a prefill answered, as a decode leg is given them.
HandoffParams = Mapping[str, Any]


@dataclass(frozen=True)
class LegPlan:
    """One upstream request: its JSON body and the X-data-parallel-rank to send (None: none)."""

    body: dict[str, Any]
    dp_rank: int | None


class Route(Protocol):
    """How one client request becomes a prefill leg and a decode leg (the proxy's connector).

    Built once per routing table (:meth:`KVConnector.route`); the I/O flow (pdserve.proxy) is
    shared by all connectors, a connector only says whether its two legs run one after the other
    or at once and whether a prefill's handoff may go to another decode.
    """

    name: str  # the routing table's connector.type, for logs
    concurrent: bool  # the decode is sent together with the prefill instead of after it
    reusable_handoff: bool  # a prefill's handoff may go to another decode than the one it was made for

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Peer, decode: Peer, uid: str
    ) -> LegIds:
        """Ids of an attempt whose legs are the ``prefill_leg``-th and ``decode_leg``-th of the request."""
        ...

    def prefill_leg(self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds) -> LegPlan: ...

    def handoff_problems(self, answer: object) -> list[str]:
        """Missing or malformed fields in the prefill's ``kv_transfer_params`` (empty: usable)."""
        ...

    def decode_leg(
        self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds, handoff: HandoffParams | None
    ) -> LegPlan: ...


class SerialRoute:
    """What the routes of NIXL and Mooncake share: the decode goes out once its prefill succeeded,
    each leg has an id of its own, and any decode may take the prefill's handoff."""

    name: str
    concurrent = False
    reusable_handoff = True

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Peer, decode: Peer, uid: str
    ) -> LegIds:
        return LegIds(leg_id(base, PREFILL, prefill_leg), leg_id(base, DECODE, decode_leg))


def prefill_only(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request cut down to a prefill: one token, no streaming.

    ``min_tokens`` would contradict ``max_tokens=1`` and ``stream_options`` is invalid without
    ``stream``, so both go.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out
