"""The simulate part of a connector: what ``pdserve sim`` answers and refuses for its legs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# --- simulate: what a simulated engine answers ----------------------------------------------------


@dataclass(frozen=True)
class SimEngine:
    """The simulated engine that serves a leg: its instance, its global DP rank, and its side channel."""

    instance: str
    rank: int
    dp_size: int
    tp_size: int
    kv_host: str
    kv_port: int

    @property
    def engine_id(self) -> str:
        """The simulator's ``remote_engine_id`` (NIXL, MoRIIO): names the instance and the DP rank
        that holds the KV (real vLLM's NIXL engine id is a random uuid per engine)."""
        return f"{self.instance}-dp{self.rank}"


@dataclass(frozen=True)
class SimPrefill:
    """A prefill leg a simulated engine ran: the engine, vLLM's internal request id, the prompt's
    length in tokens and the KV blocks the engine holds for the decode."""

    engine: SimEngine
    request_id: str
    prompt_tokens: int
    blocks: list[list[int]]


def rank_after(engine_id: str, prefix: str) -> int | None:
    """The DP rank an engine id ``<prefix><rank>`` names (None: not such an id)."""
    rank = engine_id[len(prefix) :] if engine_id.startswith(prefix) else ""
    return int(rank) if rank.isdigit() else None


@dataclass(frozen=True)
class PullNotice:
    """A simulated decode telling the simulated prefill that holds its KV "I have it", so the
    prefill's engine (``pdserve sim --profile``) frees the blocks before its lease ends."""

    url: str  # the prefill simulator's side channel: http://host:port
    engine_id: str  # the prefill engine, which names its DP rank
    key: str  # the prefill leg, as its engine holds the blocks (Simulate.hold_key)


class Simulate:
    """What ``pdserve sim`` does for a connector's legs; the defaults answer nothing and refuse nothing."""

    #: A prefill leg's blocks stay held for its decode until a pull notice or the lease's end
    #: (the step engine of ``pdserve sim --profile``); False: freed when the prefill finishes.
    holds_kv: bool = False

    #: Where the ``vllm`` stand-in reads the advertised side channel (pdserve.sim.vllm_cli): the
    #: host's variables in order, the port's variable, and vLLM's default port.
    host_env: tuple[str, ...] = ()
    port_env: str | None = None
    default_port: int = 0

    def recognises(self, params: Mapping[str, Any], leg: str) -> int:
        """How surely ``params`` are this connector's when the simulator is not told its connector:
        2 a key only this connector sends, 1 its shape without such a key, 0 not its."""
        return 0

    def prefill_answer(self, prefill: SimPrefill, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a prefill answers with (None: vLLM answers none)."""
        return None

    def handoff_problems(self, params: Mapping[str, Any]) -> list[str]:
        """Missing or malformed fields of a decode leg's ``kv_transfer_params``; a real decode
        given them would wait for KV that never comes, so the simulator refuses them."""
        return []

    def malformed(self, answer: Mapping[str, Any]) -> dict[str, Any]:
        """The prefill answer of the ``malformed-kv-params`` fault: without what the decode needs."""
        return dict(answer)

    def record(self, request_id: str | None) -> dict[str, Any]:
        """Fields of the simulator's per-request record this connector adds (for every request)."""
        return {}

    def hold_key(self, params: Mapping[str, Any], request_id: str) -> str:
        """The key a prefill leg's held blocks go by (``request_id``: vLLM's internal id)."""
        return request_id

    def pull_notice(self, params: Mapping[str, Any]) -> PullNotice | None:
        """Whom a decode leg tells once it has the KV (None: nobody)."""
        return None

    def engine_rank(self, engine_id: str, instance: str) -> int | None:
        """The DP rank of ``instance`` an engine id of this connector names (None: not one of its)."""
        return None
