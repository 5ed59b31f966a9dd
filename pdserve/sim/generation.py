"""The OpenAI generation endpoints (``/v1/completions``, ``/v1/chat/completions`` and the engine
path a group's leader forwards to): admission of a request, in vLLM's words, its rank, its
record in ``/sim/stats``, the fault drawn for it, then its answer (pdserve.sim.answer).

Its own module because this is the simulator's request flow: a reader follows one request from
its first check to its answer here, apart from the informational routes (pdserve.sim.admin).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pdserve import kv
from pdserve.kv.base import KVConnector
from pdserve.sim import payloads, validation
from pdserve.sim.answer import Answers, Job
from pdserve.sim.config import SimConfig
from pdserve.sim.engine.runtime import Engines
from pdserve.sim.faults import Fault, choose_fault
from pdserve.sim.group import GroupState, engine_dead_reply, forward, resolve_rank
from pdserve.sim.payloads import Leg
from pdserve.sim.stats import SimStats
from pdserve.sim.tokenizer import Endpoint, count_prompt_tokens
from pdserve.tracing.context import TRACEPARENT, TRACESTATE
from pdserve.wire.headers import AUTHORIZATION, DP_RANK, REQUEST_ID
from pdserve.wire.openai import RequestError, error_body

if TYPE_CHECKING:  # loaded only when the simulator traces
    from pdserve.sim.spans import EngineTracer


class Generation:
    """The generation requests of one simulator process, and the faults they may meet."""

    def __init__(
        self,
        config: SimConfig,
        stats: SimStats,
        group: GroupState,
        engines: Engines | None,
        tracer: EngineTracer | None,
    ) -> None:
        self.config = config
        self.stats = stats
        self.group = group
        self.group_config = group.config
        self.engines = engines
        self.tracer = tracer
        self.answers = Answers(config, stats, engines, tracer)
        self.faults: tuple[Fault, ...] = config.faults  # replaced at run time by POST /sim/faults
        self.rng = random.Random(config.seed)
        self.forwarded = 0  # requests the leader of a leader-mode group relayed to a worker
        self.first_rank = self.group_config.first_served
        self._cursor = 0
        self._warned_untraced = False
        self._session: aiohttp.ClientSession | None = None  # forwarding to workers
        self._requests: dict[int, web.Request] = {}  # generation requests in flight, by id()
        self._running_ids: set[str] = set()  # X-Request-Id of the requests in flight

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def engine_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", engine_path=True)

    async def engine_chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", engine_path=True)

    def abort_in_flight(self) -> None:
        """vLLM's engine death: what is in flight fails, its connections cut."""
        for request in list(self._requests.values()):
            if request.transport is not None:
                request.transport.abort()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        job = self._admit(request, endpoint, body, prompt_tokens, leg, rank, header_rank is not None)
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
        self._count(job.index, leg, header_rank is not None)
        s = self.stats
        try:
            fault = choose_fault(self.faults, self.rng, leg, rank)
            if fault is not None:
                s.faults[str(fault.kind)] += 1
                job.record["fault"] = fault.spec()
            response = await self.answers.run(request, job, fault)
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
        index = rank - self.first_rank
        self._count(index, leg, header)
        self.forwarded += 1
        try:
            return await forward(request, self._session, url, rank, raw)
        finally:
            self.stats.in_flight[index] -= 1

    def _count(self, index: int, leg: Leg, header: bool) -> None:
        """An accepted request, served here or forwarded: counted, and in flight until it ends."""
        s = self.stats
        s.requests += 1
        s.last_request_at = time.time()
        s.by_rank[index] += 1
        s.by_leg[leg] += 1
        s.without_rank_header += 0 if header else 1
        s.in_flight[index] += 1

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
        prompt_tokens: int,
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
            prompt_tokens=prompt_tokens,
            num_tokens=self._output_tokens(body, prompt_tokens),
            record=record,
            connector=self._connector(params, leg),
            trace_headers=trace_headers,
        )

    def _output_tokens(self, body: Mapping[str, Any], prompt_tokens: int) -> int:
        """--tokens, capped by max_tokens; with an engine max_tokens is honoured as vLLM does (a
        performance model must generate what a trace asks), within max_model_len."""
        if self.engines is None:
            return payloads.num_output_tokens(body, self.config.tokens)
        cap = body.get("max_tokens") or body.get("max_completion_tokens")
        if cap is None:
            return self.config.tokens
        room = self.config.identity.max_model_len - prompt_tokens
        return max(1, min(int(cap), room))
