"""The simulator's informational and admin routes: vLLM's (``/health``, ``/v1/models``,
``/version``, ``/get_server_info``, ``/get_model_info``, ``/metrics``, the profiler's
``/start_profile`` and ``/stop_profile``) and its own (``/sim/stats``, ``/sim/reset``,
``/sim/faults``).

Apart from the generation flow (pdserve.sim.generation) because none of them generates: they
read the process's state, or replace its faults and zero its counters, for probes and tests.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from aiohttp import web

from pdserve.sim import payloads
from pdserve.sim.config import SimConfig
from pdserve.sim.engine.runtime import Engines
from pdserve.sim.faults import FaultSpecError, faults_from_json
from pdserve.sim.generation import Generation
from pdserve.sim.group import GroupState, describe
from pdserve.sim.stats import SimStats
from pdserve.wire.openai import error_body


@dataclass
class Admin:
    """The routes that report on, and steer, one simulator process's ``generation``."""

    config: SimConfig
    stats: SimStats
    group: GroupState
    engines: Engines | None
    generation: Generation
    started: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created"

    # --- vLLM's ---------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        problem = self.group.health_problem()
        return web.Response(status=200) if problem is None else web.Response(status=503, text=problem)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(payloads.models_body(self.config.identity, self.started))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "pdserve-sim"})

    async def server_info(self, request: web.Request) -> web.Response:
        """The configuration, for routers and tools that ask (vllm-router reads DP ranks from /metrics)."""
        c = self.config
        return web.json_response(
            {
                "model": c.identity.model,
                "role": c.role,
                "data_parallel_size": c.dp_size,
                "tensor_parallel_size": c.identity.tp_size,
                "max_model_len": c.identity.max_model_len,
                "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}.get(c.role, "kv_both"),
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.config.identity.model, "is_generation": True})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.engines is not None:
            text = self.engines.metrics_text(self.config.identity.model)
            return web.Response(text=text, content_type="text/plain", charset="utf-8")
        s = self.stats
        text = payloads.metrics_text(
            self.config.identity.model,
            s.in_flight,
            s.success,
            s.prompt_tokens,
            s.generation_tokens,
            s.external_hits,
            s.first_rank,
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def profile(self, request: web.Request) -> web.Response:
        self.stats.profile_calls += 1
        return web.Response(status=200)

    # --- the simulator's own (/sim/*) -----------------------------------------------------------

    async def get_stats(self, request: web.Request) -> web.Response:
        out = self.stats.to_dict()
        if self.group.config.multi_node:
            g = self.group
            out["group"] = {
                **describe(g.config),
                "complete": g.complete,
                "broken": g.broken,
                "joined": sorted(g.members),
                "forwarded": self.generation.forwarded,
            }
        return web.json_response(out)

    async def reset(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return web.json_response(self.stats.to_dict())

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response({"faults": [f.to_dict() for f in self.generation.faults]})

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            self.generation.faults = faults_from_json(body)
        except ValueError as exc:  # FaultSpecError and JSONDecodeError are both ValueErrors
            message = str(exc) if isinstance(exc, FaultSpecError) else f"body is not valid JSON: {exc}"
            return web.json_response(error_body(400, message, param="faults"), status=400)
        return web.json_response({"faults": [f.to_dict() for f in self.generation.faults]})
