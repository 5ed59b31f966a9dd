"""The simulator's HTTP server (aiohttp.web on uvloop): the imperative shell over payloads.py,
faults.py and stats.py.

Why aiohttp.web and not Quart: the simulator is the backend of the proxy benchmark and must
not be what the benchmark measures; aiohttp.web serves the same SSE several times faster
per core, and gives direct access to the transport to abort connections on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import random
import socket
import struct
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pdserve import kv
from pdserve.kv.base import KVConnector, SimEngine, SimPrefill
from pdserve.sim import payloads, validation
from pdserve.sim.engine.request import Kind, Request
from pdserve.sim.engine.runtime import Engines, EngineSetup
from pdserve.sim.faults import (
    BUSY_STATUS,
    Fault,
    FaultKind,
    FaultSpecError,
    choose_fault,
    drop_after_chunks,
    faults_from_json,
)
from pdserve.sim.group import (
    ENGINE_PREFIX,
    JOIN_PATH,
    GroupConfig,
    GroupState,
    describe,
    engine_dead_reply,
    forward,
    resolve_rank,
)
from pdserve.sim.payloads import Identity, Leg
from pdserve.sim.stats import SimStats
from pdserve.sim.tokenizer import Endpoint, count_prompt_tokens, prompt_token_ids
from pdserve.tracing.context import TRACEPARENT, TRACESTATE
from pdserve.wire.headers import AUTHORIZATION, DP_RANK, REQUEST_ID
from pdserve.wire.openai import RequestError, error_body

if TYPE_CHECKING:  # loaded only when the simulator traces
    from pdserve.sim.spans import EngineTracer

ROLES = ("prefill", "decode", "both")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


@dataclass
class Job:
    """One accepted generation request, from admission to its last byte."""

    endpoint: Endpoint
    body: Mapping[str, Any]
    leg: Leg
    rank: int  # global
    index: int  # the rank's index in this process's counters (rank - first served rank)
    base_id: str
    engine_request_id: str
    prompt_tokens: int
    num_tokens: int
    record: dict[str, Any]
    connector: KVConnector  # whose kv_transfer_params a P/D leg carries
    aborted: bool = False  # the simulator itself broke the connection (a fault, not a client cancel)
    created: int = field(default_factory=lambda: int(time.time()))
    engine_request: Request | None = None  # with --profile: the request in its rank's engine
    fault: FaultKind | None = None
    arrival: float = field(default_factory=time.time)
    first_token_at: float | None = None  # wall clock, without --profile
    trace_headers: dict[str, str] | None = None  # the traceparent/tracestate it came with

    @property
    def cached_tokens(self) -> int:
        r = self.engine_request
        return max(0, r.num_cached_tokens) if r is not None else 0


class Simulator:
    def __init__(self, config: SimConfig, tracer: EngineTracer | None = None) -> None:
        """``tracer``: vLLM's request spans (``--otlp-traces-endpoint``); None: no tracing."""
        self.config = config
        self.tracer = tracer
        self._warned_untraced = False
        self.group_config = config.group or GroupConfig(dp_size=config.dp_size)
        self.group = GroupState(self.group_config)
        self.group.on_broken.append(self._on_broken)
        self.first_rank = self.group_config.first_served
        served = self.group_config.served
        self.stats = SimStats(config.role, served, self.first_rank)
        self.faults: tuple[Fault, ...] = config.faults
        self.rng = random.Random(config.seed)
        self._cursor = 0
        self._next_block = [1] * served
        self.forwarded = 0  # requests the leader of a leader-mode group relayed to a worker
        self.stopping = asyncio.Event()  # set when a broken group makes this process exit
        self._session: aiohttp.ClientSession | None = None  # forwarding to workers
        self._requests: dict[int, web.Request] = {}  # generation requests in flight, by id()
        self._started = int(time.time())
        self._running_ids: set[str] = set()  # X-Request-Id of the requests in flight
        self.engines: Engines | None = None
        if config.engine is not None:
            ranks = range(self.first_rank, self.first_rank + served)
            self.engines = Engines(config.engine, ranks, self._engine_rank)

    def app(self) -> web.Application:
        middlewares = [self._authenticate] if self.config.api_key else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        if self.engines is not None:
            app.on_startup.append(self._start_engines)
            app.on_cleanup.append(self._stop_engines)
        app.router.add_get("/sim/stats", self.get_stats)
        app.router.add_post("/sim/reset", self.reset)
        app.router.add_get("/sim/faults", self.get_faults)
        app.router.add_post("/sim/faults", self.set_faults)
        if self.group_config.headless:  # no OpenAI API: its engines, for the leader to forward to
            app.router.add_post(ENGINE_PREFIX + "/v1/completions", self.engine_completions)
            app.router.add_post(ENGINE_PREFIX + "/v1/chat/completions", self.engine_chat_completions)
            return app
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/version", self.version)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/start_profile", self.profile)
        app.router.add_post("/stop_profile", self.profile)
        return app

    async def _start_engines(self, app: web.Application) -> None:
        assert self.engines is not None
        identity = self.config.identity
        listen = (identity.kv_host, identity.kv_port) if self.config.role != "decode" else None
        await self.engines.start(listen)

    async def _stop_engines(self, app: web.Application) -> None:
        assert self.engines is not None
        await self.engines.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def group_app(self) -> web.Application:
        """The leader's RPC port: where the other nodes join."""
        app = web.Application()
        app.router.add_post(JOIN_PATH, self.group.join)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's rule: only /v1/* needs the key (probes and /metrics stay open); 401 otherwise."""
        if request.path.startswith("/v1") and not hmac.compare_digest(
            request.headers.get(AUTHORIZATION, "").encode(), f"Bearer {self.config.api_key}".encode()
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # --- plain endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        problem = self.group.health_problem()
        return web.Response(status=200) if problem is None else web.Response(status=503, text=problem)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(payloads.models_body(self.config.identity, self._started))

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
            self.first_rank,
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def profile(self, request: web.Request) -> web.Response:
        self.stats.profile_calls += 1
        return web.Response(status=200)

    async def get_stats(self, request: web.Request) -> web.Response:
        out = self.stats.to_dict()
        if self.group_config.multi_node:
            g = self.group
            out["group"] = {
                **describe(self.group_config),
                "complete": g.complete,
                "broken": g.broken,
                "joined": sorted(g.members),
                "forwarded": self.forwarded,
            }
        return web.json_response(out)

    async def reset(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return web.json_response(self.stats.to_dict())

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response({"faults": [f.to_dict() for f in self.faults]})

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            self.faults = faults_from_json(body)
        except ValueError as exc:  # FaultSpecError and JSONDecodeError are both ValueErrors
            message = str(exc) if isinstance(exc, FaultSpecError) else f"body is not valid JSON: {exc}"
            return web.json_response(error_body(400, message, param="faults"), status=400)
        return web.json_response({"faults": [f.to_dict() for f in self.faults]})

    # --- generation -----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def engine_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", engine_path=True)

    async def engine_chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", engine_path=True)

    async def _generate(
        self, request: web.Request, endpoint: Endpoint, engine_path: bool = False
    ) -> web.StreamResponse:
        self._requests[id(request)] = request
        try:
            return await self._generate_one(request, endpoint, engine_path)
        finally:
            self._requests.pop(id(request), None)

    async def _generate_one(
        self, request: web.Request, endpoint: Endpoint, engine_path: bool
    ) -> web.StreamResponse:
        if self.group.broken is not None:
            return engine_dead_reply()
        # vLLM's checks, in vLLM's words (pdserve.sim.validation), not the router's.
        raw = await request.read()
        try:
            body = validation.parse_body(raw)
        except RequestError as exc:
            return self._reject("invalid_json", exc)
        try:
            validation.check_schema(body, endpoint)
            identity = self.config.identity
            prompt_tokens = count_prompt_tokens(body, endpoint)
            validation.check_request(body, endpoint, identity.model, identity.max_model_len, prompt_tokens)
        except RequestError as exc:
            return self._reject("model_not_found" if exc.status == 404 else "invalid_request", exc)
        try:
            header_rank = resolve_rank(self.group_config, request.headers.get(DP_RANK), engine_path)
        except RequestError as exc:
            return self._reject("rank_out_of_range", exc)
        try:
            leg = payloads.classify_leg(body)
        except RequestError as exc:
            return self._reject("invalid_kv_transfer_params", exc)
        wrong_role = self._wrong_role(leg)
        if wrong_role is not None:
            return self._reject("wrong_role", wrong_role)
        sequences = payloads.sequences(body, endpoint)
        if leg != "plain" and sequences > 1:
            return self._reject(
                "multi_sequence_pd",
                RequestError(
                    400,
                    f"this P/D request makes {sequences} sequences (a batched prompt or n > 1) but "
                    "kv_transfer_params carries one KV handoff (real vLLM would hand over the first "
                    "one only)",
                    param="kv_transfer_params",
                ),
            )
        client_id = request.headers.get(REQUEST_ID)
        if client_id is not None and client_id in self._running_ids:
            # vLLM keys requests by this id: a second one in flight collides (older vLLM refuses
            # it like this; newer vLLM salts its internal id but still aborts by this one).
            return self._reject(
                "duplicate_request_id",
                RequestError(400, f"Request id {client_id} already running."),
            )

        rank = header_rank if header_rank is not None else self._pick_rank()
        remote = self.group.remote_url(rank)
        if remote is not None or not self.group_config.owns(rank):
            return await self._forward(request, remote, rank, raw, leg, header_rank is not None)
        job = self._admit(request, endpoint, body, leg, rank, header_rank is not None)
        if leg == "decode":
            problems = job.connector.simulate.handoff_problems(body["kv_transfer_params"])
            if problems:
                self.stats.malformed_handoff += 1
                job.record["outcome"] = "malformed_handoff"
                job.record["problems"] = problems
                return self._reject(
                    "malformed_handoff",
                    RequestError(
                        400,
                        "kv_transfer_params of this remote-prefill request are missing or malformed: "
                        f"{', '.join(problems)} (real vLLM would wait forever for this KV)",
                        param="kv_transfer_params",
                    ),
                )

        if client_id is not None:
            self._running_ids.add(client_id)
        s = self.stats
        s.requests += 1
        s.last_request_at = time.time()
        s.by_rank[job.index] += 1
        s.by_leg[leg] += 1
        if header_rank is None:
            s.without_rank_header += 1
        s.in_flight[job.index] += 1
        try:
            fault = choose_fault(self.faults, self.rng, leg, rank)
            if fault is not None:
                s.faults[str(fault.kind)] += 1
                job.record["fault"] = fault.spec()
            response = await self._run(request, job, fault)
        except (asyncio.CancelledError, ConnectionResetError):
            if not job.aborted:
                s.cancelled += 1
                job.record["outcome"] = "cancelled"
            raise
        finally:
            s.in_flight[job.index] -= 1
            self._running_ids.discard(client_id or "")
        return response

    async def _forward(
        self, request: web.Request, url: str | None, rank: int, raw: bytes, leg: Leg, header: bool
    ) -> web.StreamResponse:
        """The leader of a leader-mode group: a rank of a headless worker runs there."""
        if url is None:  # the group is not complete: vLLM's API is not up yet
            return web.json_response(
                error_body(503, f"data_parallel_rank {rank} has not joined the group yet"), status=503
            )
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0), auto_decompress=False
            )
        s = self.stats
        index = rank - self.first_rank
        s.requests += 1
        s.last_request_at = time.time()
        s.by_rank[index] += 1
        s.by_leg[leg] += 1
        s.without_rank_header += 0 if header else 1
        s.in_flight[index] += 1
        self.forwarded += 1
        try:
            return await forward(request, self._session, url, rank, raw)
        finally:
            s.in_flight[index] -= 1

    def _on_broken(self, reason: str) -> None:
        """vLLM's engine death: what is in flight fails (connections cut), then the server exits."""
        for request in list(self._requests.values()):
            if request.transport is not None:
                request.transport.abort()
        if not self.config.keep_alive_on_engine_death:
            asyncio.get_running_loop().call_later(0.3, self.stopping.set)

    def _reject(self, reason: str, exc: RequestError) -> web.Response:
        self.stats.rejected[reason] += 1
        return web.json_response(exc.body(), status=exc.status)

    def _wrong_role(self, leg: Leg) -> RequestError | None:
        """A misrouted leg is made visible (real vLLM may serve it: NixlConnector ignores kv_role)."""
        role = self.config.role
        if role == "decode" and leg == "prefill":
            return RequestError(400, "this instance is a decode instance; it does not serve do_remote_decode")
        if role == "prefill" and leg == "decode":
            return RequestError(
                400, "this instance is a prefill instance; it does not serve do_remote_prefill"
            )
        return None

    def _engine_rank(self, engine_id: str) -> int | None:
        """The rank a pull notice's engine id names, as the connector played names its engines."""
        instance = self.config.identity.instance_name
        connectors = (self.config.connector,) if self.config.connector is not None else kv.CONNECTORS
        return next(
            (r for c in connectors if (r := c.simulate.engine_rank(engine_id, instance)) is not None), None
        )

    def _connector(self, params: object, leg: Leg) -> KVConnector:
        if self.config.connector is not None:
            return self.config.connector
        return kv.simulated(params, leg) if isinstance(params, Mapping) else kv.DEFAULT

    def _pick_rank(self) -> int:
        """A global rank among those this process answers for (a leader-mode leader: all)."""
        index = payloads.pick_rank(self.stats.in_flight, self._cursor)
        self._cursor = (index + 1) % len(self.stats.in_flight)
        return self.first_rank + index

    def _admit(
        self,
        request: web.Request,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        leg: Leg,
        rank: int,
        header: bool,
    ) -> Job:
        client_id = request.headers.get(REQUEST_ID)
        base = client_id or uuid.uuid4().hex[:16]
        engine_request_id = payloads.engine_request_id(endpoint, base, uuid.uuid4().hex[:8])
        params = body.get("kv_transfer_params")
        record: dict[str, Any] = {
            "request_id": client_id,
            "engine_request_id": engine_request_id,
            "endpoint": endpoint,
            "leg": leg,
            "rank": rank,
            "rank_header": header,
            "stream": bool(body.get("stream")),
            "max_tokens": body.get("max_tokens"),
            "max_completion_tokens": body.get("max_completion_tokens"),
            "min_tokens": body.get("min_tokens"),
            "stream_options": body.get("stream_options"),
            "prompt": body.get("prompt"),
            "n": body.get("n"),
            "seed": body.get("seed"),
            "transfer_id": params.get("transfer_id") if isinstance(params, Mapping) else None,
            **kv.sim_record(client_id),
            "kv_transfer_params": dict(params) if isinstance(params, Mapping) else None,
            # which prefill engine (instance and DP rank) a decode's handoff came from
            "handoff_from": params.get("remote_engine_id")
            if leg == "decode" and isinstance(params, Mapping)
            else None,
            "authorization": request.headers.get(AUTHORIZATION),
            "fault": None,
            "outcome": "running",
        }
        self.stats.recent.append(record)
        trace_headers = None
        if TRACEPARENT in request.headers or TRACESTATE in request.headers:
            trace_headers = {k: request.headers[k] for k in (TRACEPARENT, TRACESTATE) if k in request.headers}
            if self.tracer is None and not self._warned_untraced:  # vLLM warns once, too
                self._warned_untraced = True
                print(
                    "pdserve sim: warning: Received a request with trace context but tracing is disabled",
                    file=sys.stderr,
                    flush=True,
                )
        return Job(
            endpoint=endpoint,
            body=body,
            leg=leg,
            rank=rank,
            index=rank - self.first_rank,
            base_id=base,
            engine_request_id=engine_request_id,
            prompt_tokens=count_prompt_tokens(body, endpoint),
            num_tokens=self._output_tokens(body, endpoint),
            record=record,
            connector=self._connector(params, leg),
            trace_headers=trace_headers,
        )

    def _output_tokens(self, body: Mapping[str, Any], endpoint: Endpoint) -> int:
        """--tokens, capped by max_tokens; with an engine max_tokens is honoured as vLLM does (a
        performance model must generate what a trace asks), within max_model_len."""
        if self.engines is None:
            return payloads.num_output_tokens(body, self.config.tokens)
        cap = body.get("max_tokens") or body.get("max_completion_tokens")
        if cap is None:
            return self.config.tokens
        room = self.config.identity.max_model_len - count_prompt_tokens(body, endpoint)
        return max(1, min(int(cap), room))

    def _submit(self, job: Job) -> None:
        """--profile: the request joins its rank's engine, which will time its tokens."""
        assert self.engines is not None
        params = job.body.get("kv_transfer_params") or {}  # a P/D leg's is a mapping (classify_leg)
        simulate = job.connector.simulate
        kind, request_id, notice = Kind.PLAIN, job.engine_request_id, None
        if job.leg == "prefill" and simulate.holds_kv:  # its blocks wait for the decode
            kind, request_id = Kind.PREFILL, simulate.hold_key(params, job.engine_request_id)
        elif job.leg == "decode":
            kind, notice = Kind.DECODE, simulate.pull_notice(params)
        job.engine_request = self.engines.submit(
            job.rank,
            request_id,
            prompt_token_ids(job.body, job.endpoint),
            job.num_tokens,
            kind,
            payloads.finish_reason(job.num_tokens, job.body),
            handoff=notice,
        )

    async def _until(self, job: Job, tokens: int) -> None:
        """With an engine: until it generated ``tokens`` of the job's tokens."""
        assert self.engines is not None and job.engine_request is not None
        await self.engines.wait(job.rank, job.engine_request, tokens - 1)

    def _final_kv_answer(self, job: Job, kv_answer: dict[str, Any] | None) -> dict[str, Any] | None:
        """An engine's prefill answer names the blocks it really holds, known once it ran."""
        if self.engines is None or job.engine_request is None or job.leg != "prefill":
            return kv_answer
        kv_answer = self._kv_answer(job, [self.engines.block_ids(job.rank, job.engine_request)])
        if kv_answer is not None:
            if job.fault is FaultKind.MALFORMED_KV_PARAMS:
                kv_answer = job.connector.simulate.malformed(kv_answer)
            job.record["kv_answer"] = kv_answer
        return kv_answer

    def _kv_answer(self, job: Job, blocks: list[list[int]] | None = None) -> dict[str, Any] | None:
        if job.leg != "prefill":
            return None
        if blocks is None:
            blocks = payloads.block_ids(job.prompt_tokens, self._next_block[job.index])
            self._next_block[job.index] += len(blocks[0])
        identity = self.config.identity
        engine = SimEngine(
            identity.instance_name,
            job.rank,
            self.config.dp_size,
            identity.tp_size,
            identity.kv_host,
            identity.kv_port,
        )
        params = job.body["kv_transfer_params"]
        simulate = job.connector.simulate
        prefill = SimPrefill(engine, job.engine_request_id, job.prompt_tokens, blocks)
        return simulate.prefill_answer(prefill, params)

    async def _run(self, request: web.Request, job: Job, fault: Fault | None) -> web.StreamResponse:
        kind = fault.kind if fault is not None else None
        if kind is FaultKind.RESET:
            return await self._abort(request, job)
        if kind is FaultKind.HANG:
            await asyncio.Future()  # until the client disconnects (the handler is cancelled)
        if kind is FaultKind.SLOW_FIRST_BYTE and fault is not None and fault.delay_ms:
            await asyncio.sleep(fault.delay_ms / 1000)
        busy = BUSY_STATUS.get(kind) if kind is not None else None
        if busy is not None:
            status = busy
            job.record["outcome"] = str(kind)
            body = error_body(status, f"simulated saturated engine (fault {kind})")
            return web.json_response(body, status=status, headers={"Retry-After": "1"})
        if kind is FaultKind.HTTP_500:
            job.record["outcome"] = "http-500"
            body = error_body(500, "simulated internal server error (fault http-500)")
            return web.json_response(body, status=500)
        job.fault = kind
        kv_answer = None
        if self.engines is None:
            kv_answer = self._kv_answer(job)
            if kv_answer is not None:
                if kind is FaultKind.MALFORMED_KV_PARAMS:
                    kv_answer = job.connector.simulate.malformed(kv_answer)
                job.record["kv_answer"] = kv_answer
        else:
            self._submit(job)
        drop = kind is FaultKind.DROP_MID_STREAM
        try:
            if job.body.get("stream"):
                linger = fault.delay_ms if kind is FaultKind.SLOW_END and fault is not None else None
                return await self._stream(request, job, kv_answer, drop, linger)
            return await self._respond(request, job, kv_answer, drop)
        finally:
            if self.engines is not None and job.engine_request is not None:
                self.engines.done(job.rank, job.engine_request)

    async def _respond(
        self, request: web.Request, job: Job, kv_answer: dict[str, Any] | None, drop: bool
    ) -> web.StreamResponse:
        c = self.config
        if job.engine_request is None:
            job.first_token_at = time.time() + c.ttft_ms / 1000
            await asyncio.sleep((c.ttft_ms + c.itl_ms * (job.num_tokens - 1)) / 1000)
        else:
            await self._until(job, job.num_tokens)
            kv_answer = self._final_kv_answer(job, kv_answer)
        rid = payloads.response_id(job.endpoint, job.base_id)
        body = payloads.completion_body(
            job.endpoint,
            rid,
            c.identity.model,
            job.created,
            payloads.echoed_prompt(job.body, job.endpoint) + payloads.generated_text(job.num_tokens),
            payloads.finish_reason(job.num_tokens, job.body),
            job.prompt_tokens,
            job.num_tokens,
            kv_answer,
            job.cached_tokens if c.prompt_tokens_details else None,
        )
        data = json.dumps(body, separators=(",", ":")).encode()
        if not drop:
            self._finished(job)
            return web.Response(body=data, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data[: len(data) // 2])
        return await self._abort(request, job)

    async def _stream(
        self,
        request: web.Request,
        job: Job,
        kv_answer: dict[str, Any] | None,
        drop: bool,
        linger_ms: int | None = None,
    ) -> web.StreamResponse:
        c = self.config
        model = c.identity.model
        rid = payloads.response_id(job.endpoint, job.base_id)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if job.endpoint == "chat":
            await response.write(payloads.sse(payloads.chat_role_chunk(rid, model, job.created)))
        reason = payloads.finish_reason(job.num_tokens, job.body)
        stop_after = drop_after_chunks(job.num_tokens) if drop else None
        echo = payloads.echoed_prompt(job.body, job.endpoint)
        for i in range(job.num_tokens):
            if job.engine_request is None:
                await asyncio.sleep((c.ttft_ms if i == 0 else c.itl_ms) / 1000)
            else:
                await self._until(job, i + 1)
            if stop_after is not None and i == stop_after:
                return await self._abort(request, job)
            last = i == job.num_tokens - 1
            if last:
                kv_answer = self._final_kv_answer(job, kv_answer)
            chunk = payloads.stream_chunk(
                job.endpoint,
                rid,
                model,
                job.created,
                (echo if i == 0 else "") + payloads.token_text(i),
                reason if last else None,
            )
            if last and kv_answer is not None:
                chunk["kv_transfer_params"] = kv_answer
            await response.write(payloads.sse(chunk))
            if i == 0:
                job.first_token_at = time.time()
        if stop_after is not None:  # a one-token answer: break it before [DONE]
            return await self._abort(request, job)
        if payloads.wants_usage_in_stream(job.body):
            chunk = payloads.usage_chunk(
                job.endpoint,
                rid,
                model,
                job.created,
                job.prompt_tokens,
                job.num_tokens,
                job.cached_tokens if c.prompt_tokens_details else None,
            )
            await response.write(payloads.sse(chunk))
        await response.write(payloads.SSE_DONE)
        self._finished(job)  # the client has the whole answer
        if linger_ms:
            await asyncio.sleep(linger_ms / 1000)
        await response.write_eof()
        return response

    def _finished(self, job: Job) -> None:
        s = self.stats
        s.completed += 1
        s.success[job.index][payloads.finish_reason(job.num_tokens, job.body)] += 1
        s.prompt_tokens[job.index] += job.prompt_tokens
        s.generation_tokens[job.index] += job.num_tokens
        if job.leg == "decode":
            s.external_hits[job.index] += job.prompt_tokens
        job.record["outcome"] = "ok"
        if self.tracer is not None:
            self._span(job, self.tracer)

    def _span(self, job: Job, tracer: EngineTracer) -> None:
        """vLLM's llm_request span of a finished request (pdserve.sim.spans)."""
        from pdserve.sim.spans import Finished

        now = time.time()
        scheduled, first = job.arrival, job.first_token_at or now
        r = job.engine_request
        if r is not None:  # the engine's own marks, on the loop's clock
            offset = now - asyncio.get_running_loop().time()
            scheduled = r.first_scheduled + offset if r.first_scheduled is not None else job.arrival
            first = r.first_token + offset if r.first_token is not None else now
        times = Finished(job.arrival, scheduled, first, now, job.prompt_tokens, job.num_tokens)
        external_id = job.engine_request_id.rsplit("-", 1)[0]  # vLLM's id before its salt
        tracer.finished(job.trace_headers, external_id, times, job.body)

    async def _abort(self, request: web.Request, job: Job) -> web.StreamResponse:
        """Break the TCP connection with a reset (SO_LINGER 0), so the client sees a broken
        connection, not a clean end of the answer."""
        job.aborted = True
        job.record["outcome"] = "aborted"
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        await asyncio.Future()  # aiohttp cancels the handler once the connection is gone
        raise AssertionError("unreachable")
