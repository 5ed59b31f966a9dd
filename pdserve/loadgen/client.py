"""The sending side of a replay: one aiohttp session, one task per request, open-loop.

Why one process and no worker pool: a request in flight is a task and a socket, so thousands fit
in one event loop; the client's own cost is measured and reported (CPU per request, how late each
request left) so a run shows when the client, not the server, was the limit. A request's prompt is
built when it is due, never all at once (a Mooncake prompt is ~100 KB of text).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pdserve.loadgen.prompts import BodyOptions, request_body
from pdserve.loadgen.results import RequestRecord
from pdserve.loadgen.schedule import Arrival
from pdserve.wire.headers import REQUEST_ID

DONE = b"[DONE]"


@dataclass(frozen=True)
class ClientConfig:
    url: str  # the server's base URL
    body: BodyOptions
    headers: Mapping[str, str]
    timeout_s: float = 600.0
    #: Requests carry ``X-Request-Id: <run_id>-<index>`` (vLLM's request id, in its logs and a
    #: pdserve router's legs as ``<id>-p1``/``<id>-d1``), so a run's requests can be found server-side.
    run_id: str = ""

    @property
    def generate_url(self) -> str:
        path = "/v1/chat/completions" if self.body.endpoint == "chat" else "/v1/completions"
        return self.url.rstrip("/") + path


class Counts:
    """What the progress bar shows, updated by the request tasks."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.done = 0
        self.failed = 0
        self.max_in_flight = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.done - self.failed


def _error_message(raw: bytes) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        doc = orjson.loads(raw)
        return str(doc["error"]["message"] if isinstance(doc.get("error"), dict) else doc.get("message", doc))
    return raw[:200].decode(errors="replace")


def read_chunk(record: RequestRecord, chunk: Mapping[str, Any], now: float) -> None:
    """One SSE event of a completion or chat stream: content chunks are token events; usage (the
    last event with ``stream_options.include_usage``) gives the server's own token counts."""
    if "error" in chunk:
        error = chunk["error"]
        record.error = f"stream-error: {error.get('message') if isinstance(error, Mapping) else error}"
        return
    for choice in chunk.get("choices") or ():
        text = choice.get("text")
        if text is None:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, Mapping) else None
        if text:
            if record.first_token_s is None:
                record.first_token_s = now
            else:
                record.chunk_s.append(now)
            record.chunks += 1
            break
    usage = chunk.get("usage")
    if isinstance(usage, Mapping):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]


async def send_one(
    session: aiohttp.ClientSession,
    config: ClientConfig,
    body: bytes,
    record: RequestRecord,
    clock: Callable[[], float],
) -> None:
    record.sent_s = clock()
    finished = False
    try:
        # A JSON body says so: routers that check the media type (vllm-router) answer 415 otherwise.
        headers = {
            **config.headers,
            "Content-Type": "application/json",
            REQUEST_ID: f"{config.run_id}-{record.index}",
        }
        async with session.post(config.generate_url, data=body, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"http-{resp.status}: {_error_message(await resp.read())}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == DONE:
                    finished = True
                    break
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    record.error = "bad-chunk: not JSON"
                    return
                read_chunk(record, chunk, clock())
                if record.error:
                    return
        if not finished:
            record.error = "incomplete-stream: ended without data: [DONE]"
        elif record.first_token_s is None:
            record.error = "no-tokens: the stream carried no content"
    except TimeoutError:
        record.error = f"timeout: no full answer within {config.timeout_s:g} s"
    except aiohttp.ClientPayloadError as exc:
        record.error = f"broken-stream: {exc}"
    except aiohttp.ClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        record.error = "cancelled: the replay was interrupted"
        raise
    finally:
        record.end_s = clock()


async def replay(
    session: aiohttp.ClientSession,
    config: ClientConfig,
    arrivals: Sequence[Arrival],
    counts: Counts,
    stop: asyncio.Event,
    start: float,
) -> list[RequestRecord]:
    """Send every arrival at its time (``start`` is ``time.perf_counter()`` at 0 s) and wait for
    every answer; ``stop`` set: no more sends, requests in flight are cancelled."""

    def clock() -> float:
        return time.perf_counter() - start

    records = [
        RequestRecord(a.index, a.at_s, a.request.input_length, a.request.output_length) for a in arrivals
    ]
    tasks: set[asyncio.Task[None]] = set()
    idle = asyncio.Event()  # every request sent has its answer
    dispatching = True

    def finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not tasks and not dispatching:
            idle.set()

    async def run(record: RequestRecord, body: bytes) -> None:
        try:
            await send_one(session, config, body, record, clock)
        finally:
            if record.ok:
                counts.done += 1
            else:
                counts.failed += 1

    stopped = asyncio.create_task(stop.wait())
    try:
        for arrival, record in zip(arrivals, records, strict=True):
            delay = arrival.at_s - clock()
            if delay > 0:
                await asyncio.wait([stopped], timeout=delay)
            if stop.is_set():
                break
            body = orjson.dumps(request_body(arrival.request, config.body))
            task = asyncio.create_task(run(record, body))
            tasks.add(task)
            task.add_done_callback(finished)
            counts.sent += 1
            counts.max_in_flight = max(counts.max_in_flight, counts.in_flight)
        dispatching = False
        if not tasks:
            idle.set()
        waiter = asyncio.create_task(idle.wait())
        await asyncio.wait([stopped, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stopped.cancel()
    return records
