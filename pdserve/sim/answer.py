"""Answering one admitted generation request: when its tokens come (fixed --ttft-ms/--itl-ms or
its rank's engine with --profile), the KV answer of a prefill leg, the JSON or SSE bytes, the
faults that break them, and what a finished request counts and traces.

Apart from admission (pdserve.sim.generation) because this is the part that times and writes
bytes: a reader of the streaming or the KV answer should not have to read the checks before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pdserve.kv.base import KVConnector, SimEngine, SimPrefill
from pdserve.sim import payloads
from pdserve.sim.config import SimConfig
from pdserve.sim.engine.request import Kind, Request
from pdserve.sim.engine.runtime import Engines
from pdserve.sim.faults import BUSY_STATUS, Fault, FaultKind, drop_after_chunks
from pdserve.sim.payloads import Leg
from pdserve.sim.stats import SimStats
from pdserve.sim.tokenizer import Endpoint, prompt_token_ids
from pdserve.wire.openai import error_body

if TYPE_CHECKING:  # loaded only when the simulator traces
    from pdserve.sim.spans import EngineTracer


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


class Answers:
    """The answers of one simulator process's admitted jobs."""

    def __init__(
        self, config: SimConfig, stats: SimStats, engines: Engines | None, tracer: EngineTracer | None
    ) -> None:
        self.config = config
        self.stats = stats
        self.engines = engines
        self.tracer = tracer
        self._next_block = [1] * stats.dp_size  # without an engine: each rank's next KV block id

    async def run(self, request: web.Request, job: Job, fault: Fault | None) -> web.StreamResponse:
        """The answer of ``job``, as ``fault`` (drawn for it, or None) bends it."""
        kind = fault.kind if fault is not None else None
        if kind is FaultKind.RESET:
            return await abort(request, job)
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
        return self._kv_answer(job, [self.engines.block_ids(job.rank, job.engine_request)])

    def _kv_answer(self, job: Job, blocks: list[list[int]] | None = None) -> dict[str, Any] | None:
        """A prefill leg's ``kv_transfer_params`` answer (malformed under its fault), recorded."""
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
        answer = simulate.prefill_answer(prefill, params)
        if answer is not None:
            if job.fault is FaultKind.MALFORMED_KV_PARAMS:
                answer = simulate.malformed(answer)
            job.record["kv_answer"] = answer
        return answer

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
        return await abort(request, job)

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
                return await abort(request, job)
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
            return await abort(request, job)
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


async def abort(request: web.Request, job: Job) -> web.StreamResponse:
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
