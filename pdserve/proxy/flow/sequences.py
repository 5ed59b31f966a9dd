"""Requests that would make several sequences, served as independent P/D requests and merged.

One P/D request moves one KV handoff, so it can carry one sequence. vLLM does not refuse more:
a batched ``prompt`` is answered by the prefill with the handoff of its first prompt only
(``final_res_batch[0].kv_transfer_params`` in vLLM's completion serving), leaving the other
prompts' KV leased and unused, and the decode applies that one handoff to every prompt of the
batch; ``n > 1`` is split by vLLM into child requests (``ParentRequest``) each with its own KV
blocks and request id, of which again only one handoff comes back, and the decode's children
share it (vLLM PR #38900, open, adds per-child handoffs). vllm-router and vLLM's toy P/D
proxies forward such requests unchanged, so they are silently wrong behind them.

Here each sequence is its own P/D request (a *part*): prompt ``p`` of a batch, sample ``i`` of
``n``. A part is the client's body with one prompt and no ``n``; with ``n > 1`` and a ``seed``,
part ``i`` gets ``seed + i``, which is exactly how vLLM seeds its child requests, so a seeded
request gives the same samples as unsplit vLLM would. The answers are merged in OpenAI's
shape: choice ``index = p * n + i`` (vLLM's order), usage summed (prompt tokens once per
prompt, as vLLM counts them), one response id ``cmpl-<X-Request-Id>`` (``chatcmpl-`` for chat).
Streams are merged event by event as they arrive, re-indexed, with one final usage chunk (when
asked for) and one ``[DONE]``.

Refused with 400 naming the field: ``best_of > 1`` (vLLM V1 has no best_of) and
``use_beam_search`` (beam search runs many dependent engine steps on one engine, which P/D
cannot split), and a request of more parts than ``--max-fan-out``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.proxy.engine import codec
from pdserve.proxy.flow.reply import ReplyStream
from pdserve.wire.openai import Endpoint, RequestError

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Part:
    body: dict[str, Any]
    prompt: int  # which prompt of the client's batch
    index: int  # the choice index the part's answer takes in the merged response


@dataclass(frozen=True)
class Split:
    """A request that makes several sequences, as one part per sequence."""

    endpoint: Endpoint
    parts: tuple[Part, ...]

    def response_id(self, request_id: str) -> str:
        return f"{'chatcmpl' if self.endpoint == 'chat' else 'cmpl'}-{request_id}"


def plan_split(body: Mapping[str, Any], endpoint: Endpoint, max_parts: int) -> Split | None:
    """The parts of a request that makes several sequences; None for one sequence (served as is).

    Raises RequestError(400) naming the field for what P/D cannot serve.
    """
    if body.get("use_beam_search") is True:
        raise RequestError(
            400,
            "'use_beam_search' cannot be served with prefill/decode disaggregation (beam search runs "
            "its steps on one engine); send the request without it",
            param="use_beam_search",
        )
    best_of = body.get("best_of")
    if best_of is not None:
        if isinstance(best_of, bool) or not isinstance(best_of, int) or best_of < 1:
            raise RequestError(400, "'best_of' must be an integer >= 1", param="best_of")
        if best_of > 1:
            raise RequestError(
                400,
                f"'best_of' {best_of} is not supported (vLLM V1 does not implement best_of); use 'n' "
                "to get several completions",
                param="best_of",
            )
    n = body.get("n") or 1  # check_generation_request made sure it is an integer >= 1
    prompts = _prompts(body.get("prompt")) if endpoint == "completions" else [None]
    count = len(prompts) * n
    if count == 1:
        return None
    if count > max_parts:
        field = "n" if n > 1 else "prompt"
        raise RequestError(
            400,
            f"this request makes {count} sequences ({len(prompts)} prompt(s) x n={n}), more than the "
            f"router serves in one request ({max_parts}, --max-fan-out); split it",
            param=field,
        )
    seed = body.get("seed")
    parts = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            part = {k: v for k, v in body.items() if k != "n"}
            if prompt is not None:
                part["prompt"] = prompt
            if n > 1 and isinstance(seed, int) and not isinstance(seed, bool):
                part["seed"] = seed + i
            parts.append(Part(part, p, p * n + i))
    return Split(endpoint, tuple(parts))


def _prompts(prompt: object) -> list[Any]:
    """A batch is a list of strings or a list of token lists; a list of ints is one prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return list(prompt)
    return [prompt]


# --- merging -----------------------------------------------------------------------------------


def merged_usage(
    split: Split, usages: Sequence[Mapping[str, Any] | None], streamed: bool = False
) -> dict[str, Any] | None:
    """Completion tokens summed over every part; prompt tokens (and cached prompt tokens) once per
    prompt, as vLLM counts them. A stream's usage chunk has only the three counts, as vLLM's."""
    if not any(isinstance(u, Mapping) for u in usages):
        return None
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int | None] = {}
    completion = 0
    for part, usage in zip(split.parts, usages, strict=True):
        if not isinstance(usage, Mapping):
            continue
        prompt_tokens.setdefault(part.prompt, _count(usage.get("prompt_tokens")))
        details = usage.get("prompt_tokens_details")
        cached.setdefault(
            part.prompt, _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        )
        completion += _count(usage.get("completion_tokens"))
    prompt = sum(prompt_tokens.values())
    merged: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if streamed:
        return merged
    known = [c for c in cached.values() if c is not None]
    merged["prompt_tokens_details"] = {"cached_tokens": sum(known)} if known else None
    merged["completion_tokens_details"] = None
    return merged


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def merge_answers(split: Split, answers: Sequence[bytes], request_id: str) -> bytes:
    """One OpenAI answer from the parts' answers; ValueError when one is not an answer."""
    docs = [codec.loads(a) for a in answers]
    if not all(isinstance(d, dict) and isinstance(d.get("choices"), list) for d in docs):
        raise ValueError("a decode answered without a 'choices' list")
    merged = dict(docs[0])
    choices = []
    for part, doc in zip(split.parts, docs, strict=True):
        for choice in doc["choices"]:
            choices.append(_reindexed(choice, part))
    merged["id"] = split.response_id(request_id)
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    merged["usage"] = merged_usage(split, [d.get("usage") for d in docs])
    if "kv_transfer_params" in merged:
        merged["kv_transfer_params"] = None
    return codec.dumps(merged)


def _reindexed(choice: Any, part: Part) -> Any:
    if not isinstance(choice, dict):
        return choice
    offset = choice.get("index", 0)
    return {**choice, "index": part.index + (offset if isinstance(offset, int) else 0)}


async def _next_chunk(stream: ReplyStream) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


class MergedStream:
    """The parts' SSE streams as one: events re-indexed and interleaved as they arrive.

    A part's error event (the decode's, or the relay's after a broken stream) ends the merged
    stream: it is passed on, the other parts are closed (their decodes cancelled), and
    ``[DONE]`` follows. ``on_close(outcome)`` is called once: ok, stream_error or cancelled.
    """

    def __init__(
        self,
        split: Split,
        streams: Sequence[ReplyStream],
        request_id: str,
        on_close: Callable[[str], None],
    ) -> None:
        self._split = split
        self._streams = list(streams)
        self._response_id = split.response_id(request_id)
        self._on_close = on_close
        self._buffers = [b""] * len(self._streams)
        self._open = set(range(len(self._streams)))
        self._pending: dict[int, asyncio.Task[bytes | None]] = {}
        self._out: deque[bytes] = deque()
        self._usages: list[Mapping[str, Any] | None] = [None] * len(self._streams)
        self._usage_chunk: dict[str, Any] | None = None
        self._failed = False
        self._done = False

    #: The parts' ends are not tracked here: the merged stream ends after the last part's.
    complete = False

    def delivered(self) -> None:
        pass

    def push_to(self, push: Callable[[bytes], bool]) -> None:
        """Not taken: the parts are merged event by event, in the serving task."""

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._out:
            if self._done:
                raise StopAsyncIteration
            if not self._open:
                self._finish()
                continue
            try:
                await self._read()
            except asyncio.CancelledError:
                await self.aclose()
                raise
            if self._failed:
                await self._close_streams()
                self._done = True
                self._on_close("stream_error")
        return self._out.popleft()

    async def _read(self) -> None:
        for k in self._open:
            if k not in self._pending:
                self._pending[k] = asyncio.ensure_future(_next_chunk(self._streams[k]))
        await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        for k, task in list(self._pending.items()):
            if not task.done():
                continue
            del self._pending[k]
            chunk = task.result()
            if chunk is None:
                self._open.discard(k)
            else:
                self._take(k, chunk)
            if self._failed:
                return

    def _take(self, k: int, chunk: bytes) -> None:
        buffer = self._buffers[k] + chunk
        *events, self._buffers[k] = buffer.split(b"\n\n")
        for event in events:
            data = b"\n".join(line[6:] for line in event.split(b"\n") if line.startswith(b"data: "))
            if not data or data == b"[DONE]":
                continue
            try:
                doc = codec.loads(data)
            except (ValueError, UnicodeDecodeError):
                doc = None
            if not isinstance(doc, dict) or "error" in doc:
                self._out.append(event + b"\n\n" + DONE_EVENT)
                self._failed = True
                return
            choices = doc.get("choices")
            if isinstance(choices, list) and not choices and doc.get("usage") is not None:
                self._usages[k] = doc["usage"]  # the part's final usage chunk: merged at the end
                self._usage_chunk = doc
                continue
            if isinstance(choices, list):
                doc["choices"] = [_reindexed(c, self._split.parts[k]) for c in choices]
            doc["id"] = self._response_id
            self._out.append(b"data: " + codec.dumps(doc) + b"\n\n")

    def _finish(self) -> None:
        if self._usage_chunk is not None:
            chunk = {**self._usage_chunk, "id": self._response_id}
            chunk["usage"] = merged_usage(self._split, self._usages, streamed=True)
            self._out.append(b"data: " + codec.dumps(chunk) + b"\n\n")
        self._out.append(DONE_EVENT)
        self._done = True
        self._on_close("ok")

    async def _close_streams(self) -> None:
        for task in self._pending.values():
            task.cancel()
        for task in self._pending.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pending.clear()
        for stream in self._streams:
            await stream.aclose()

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        await self._close_streams()
        self._on_close("cancelled")

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # never raise from a finalizer
                self._done = True
                for task in self._pending.values():
                    task.cancel()
                self._on_close("cancelled")
