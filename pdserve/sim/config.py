"""What one simulator process is: its role, ranks, timing, identity, faults and the rest of its
flags, as ``pdserve sim`` parses them.

Its own module because every part of the HTTP server (pdserve.sim.server, .admin,
.generation, .answer) reads it and none of them owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv.base import KVConnector
from pdserve.sim.engine.runtime import EngineSetup
from pdserve.sim.faults import Fault
from pdserve.sim.group import GroupConfig
from pdserve.sim.payloads import Identity

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class SimConfig:
    role: str
    dp_size: int
    ttft_ms: float
    itl_ms: float
    tokens: int
    identity: Identity
    faults: tuple[Fault, ...] = ()
    seed: int | None = None
    #: Like vLLM's --api-key / VLLM_API_KEY: /v1/* then needs ``Authorization: Bearer <key>``.
    api_key: str | None = None
    #: One node of a multi-node group (pdserve.sim.group); None: a single-node server.
    group: GroupConfig | None = None
    #: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: a broken group's processes stay up (503/500) instead of exiting.
    keep_alive_on_engine_death: bool = False
    #: --profile: a step-based engine per rank times the answers (None: fixed --ttft-ms/--itl-ms).
    engine: EngineSetup | None = None
    #: --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, as vLLM.
    prompt_tokens_details: bool = False
    #: The KV connector this engine plays (vLLM's --kv-transfer-config); None: recognised per
    #: request from its kv_transfer_params (pdserve.kv.simulated).
    connector: KVConnector | None = None
