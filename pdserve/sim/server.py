"""The simulator's HTTP server (aiohttp.web on uvloop): the imperative shell over payloads.py,
faults.py and stats.py. :class:`Simulator` builds one process's shared state and composes its two
jobs into one aiohttp app: the generation flow (pdserve.sim.generation, answered by
pdserve.sim.answer) and the informational and admin routes (pdserve.sim.admin).

Why aiohttp.web and not Quart: the simulator is the backend of the proxy benchmark and must
not be what the benchmark measures; aiohttp.web serves the same SSE several times faster
per core, and gives direct access to the transport to abort connections on purpose.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from pdserve import kv
from pdserve.sim.admin import Admin
from pdserve.sim.config import SimConfig
from pdserve.sim.engine.runtime import Engines
from pdserve.sim.generation import Generation
from pdserve.sim.group import ENGINE_PREFIX, JOIN_PATH, GroupConfig, GroupState
from pdserve.sim.stats import SimStats
from pdserve.wire.headers import AUTHORIZATION

if TYPE_CHECKING:  # loaded only when the simulator traces
    from pdserve.sim.spans import EngineTracer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Simulator:
    def __init__(self, config: SimConfig, tracer: EngineTracer | None = None) -> None:
        """``tracer``: vLLM's request spans (``--otlp-traces-endpoint``); None: no tracing."""
        self.config = config
        self.tracer = tracer
        self.group_config = config.group or GroupConfig(dp_size=config.dp_size)
        self.group = GroupState(self.group_config)
        self.group.on_broken.append(self._on_broken)
        first_rank, served = self.group_config.first_served, self.group_config.served
        self.stats = SimStats(config.role, served, first_rank)
        self.stopping = asyncio.Event()  # set when a broken group makes this process exit
        self.engines: Engines | None = None
        if config.engine is not None:
            ranks = range(first_rank, first_rank + served)
            self.engines = Engines(config.engine, ranks, self._engine_rank)
        self.generation = Generation(config, self.stats, self.group, self.engines, tracer)
        self.admin = Admin(config, self.stats, self.group, self.engines, self.generation)

    def app(self) -> web.Application:
        middlewares = [self._authenticate] if self.config.api_key else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        if self.engines is not None:
            app.on_startup.append(self._start_engines)
            app.on_cleanup.append(self._stop_engines)
        gen, admin = self.generation, self.admin
        app.router.add_get("/sim/stats", admin.get_stats)
        app.router.add_post("/sim/reset", admin.reset)
        app.router.add_get("/sim/faults", admin.get_faults)
        app.router.add_post("/sim/faults", admin.set_faults)
        if self.group_config.headless:  # no OpenAI API: its engines, for the leader to forward to
            app.router.add_post(ENGINE_PREFIX + "/v1/completions", gen.engine_completions)
            app.router.add_post(ENGINE_PREFIX + "/v1/chat/completions", gen.engine_chat_completions)
            return app
        app.router.add_post("/v1/completions", gen.completions)
        app.router.add_post("/v1/chat/completions", gen.chat_completions)
        app.router.add_get("/health", admin.health)
        app.router.add_get("/v1/models", admin.models)
        app.router.add_get("/metrics", admin.metrics)
        app.router.add_get("/version", admin.version)
        app.router.add_get("/get_server_info", admin.server_info)
        app.router.add_get("/get_model_info", admin.model_info)
        app.router.add_post("/start_profile", admin.profile)
        app.router.add_post("/stop_profile", admin.profile)
        return app

    def group_app(self) -> web.Application:
        """The leader's RPC port: where the other nodes join."""
        app = web.Application()
        app.router.add_post(JOIN_PATH, self.group.join)
        return app

    async def close(self) -> None:
        await self.generation.close()

    async def _start_engines(self, app: web.Application) -> None:
        assert self.engines is not None
        identity = self.config.identity
        listen = (identity.kv_host, identity.kv_port) if self.config.role != "decode" else None
        await self.engines.start(listen)

    async def _stop_engines(self, app: web.Application) -> None:
        assert self.engines is not None
        await self.engines.close()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's rule: only /v1/* needs the key (probes and /metrics stay open); 401 otherwise."""
        if request.path.startswith("/v1") and not hmac.compare_digest(
            request.headers.get(AUTHORIZATION, "").encode(), f"Bearer {self.config.api_key}".encode()
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def _on_broken(self, reason: str) -> None:
        """vLLM's engine death: what is in flight fails (connections cut), then the server exits."""
        self.generation.abort_in_flight()
        if not self.config.keep_alive_on_engine_death:
            asyncio.get_running_loop().call_later(0.3, self.stopping.set)

    def _engine_rank(self, engine_id: str) -> int | None:
        """The rank a pull notice's engine id names, as the connector played names its engines."""
        instance = self.config.identity.instance_name
        connectors = (self.config.connector,) if self.config.connector is not None else kv.CONNECTORS
        return next(
            (r for c in connectors if (r := c.simulate.engine_rank(engine_id, instance)) is not None), None
        )
