"""Fan-out of requests that make several sequences: the parts, the refusals, and the merges."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pdserve.proxy.flow.sequences import MergedStream, merge_answers, merged_usage, plan_split
from pdserve.wire.openai import RequestError


def test_one_sequence_is_served_as_is() -> None:
    for body in ({"prompt": "x"}, {"prompt": ["x"]}, {"prompt": [1, 2, 3]}, {"prompt": "x", "n": 1}):
        assert plan_split(body, "completions", 8) is None
    assert plan_split({"messages": [{"role": "user", "content": "x"}], "best_of": 1}, "chat", 8) is None


def test_batch_times_n_parts_in_vllms_choice_order() -> None:
    body = {"prompt": ["a", "b"], "n": 3, "seed": 10, "max_tokens": 4}
    split = plan_split(body, "completions", 8)
    assert split is not None
    assert [(p.prompt, p.index, p.body["prompt"], p.body["seed"]) for p in split.parts] == [
        (0, 0, "a", 10),
        (0, 1, "a", 11),
        (0, 2, "a", 12),
        (1, 3, "b", 10),
        (1, 4, "b", 11),
        (1, 5, "b", 12),
    ]
    assert all("n" not in p.body and p.body["max_tokens"] == 4 for p in split.parts)
    assert body == {"prompt": ["a", "b"], "n": 3, "seed": 10, "max_tokens": 4}  # not mutated
    tokens = plan_split({"prompt": [[1, 2], [3]]}, "completions", 8)
    assert tokens is not None and [p.body["prompt"] for p in tokens.parts] == [[1, 2], [3]]
    unseeded = plan_split({"prompt": ["a", "b"]}, "completions", 8)
    assert unseeded is not None and all("seed" not in p.body for p in unseeded.parts)
    batch_seed = plan_split({"prompt": ["a", "b"], "seed": 5}, "completions", 8)
    assert batch_seed is not None and [p.body["seed"] for p in batch_seed.parts] == [5, 5]  # as vLLM
    chat = plan_split({"messages": [{"role": "user", "content": "x"}], "n": 2}, "chat", 8)
    assert chat is not None and chat.response_id("r") == "chatcmpl-r"
    assert [p.body["messages"] for p in chat.parts] == [[{"role": "user", "content": "x"}]] * 2


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"prompt": "x", "best_of": 3}, "best_of", "'best_of' 3 is not supported"),
        ({"prompt": "x", "best_of": True}, "best_of", "'best_of' must be an integer >= 1"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "'use_beam_search' cannot be served"),
        ({"prompt": "x", "n": 9}, "n", "makes 9 sequences (1 prompt(s) x n=9)"),
        ({"prompt": ["x"] * 5, "n": 2}, "n", "makes 10 sequences"),
        ({"prompt": ["x"] * 9}, "prompt", "more than the router serves in one request (8, --max-fan-out)"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(
    body: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(RequestError) as caught:
        plan_split(body, "completions", 8)
    error = caught.value.body()["error"]
    assert (caught.value.status, error["param"], error["code"], error["type"]) == (
        400,
        field,
        400,
        "BadRequestError",
    )
    assert message in error["message"]


def answer(text: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-engine-id",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
            "kv_transfer_params": {"x": 1},
        }
    ).encode()


def test_answers_merge_re_indexed_with_usage_counted_like_vllm() -> None:
    split = plan_split({"prompt": ["a", "b"], "n": 2}, "completions", 8)
    assert split is not None
    parts = [answer(f"t{k}", [4, 4, 7, 7][k], 3) for k in range(4)]
    merged = json.loads(merge_answers(split, parts, "rid"))
    assert merged["id"] == "cmpl-rid" and merged["model"] == "m" and merged["kv_transfer_params"] is None
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(k, f"t{k}") for k in range(4)]
    assert merged["usage"] == {
        "prompt_tokens": 11,  # each prompt once
        "completion_tokens": 12,
        "total_tokens": 23,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,  # vLLM's shape (tests/fixtures/vllm-0.32.0/decode-*.json)
    }
    with pytest.raises(ValueError, match="choices"):
        merge_answers(split, [b'{"error": {}}'] * 4, "rid")
    assert merged_usage(split, [None] * 4) is None


def test_cached_prompt_tokens_merge_once_per_prompt_and_streams_carry_only_the_counts() -> None:
    split = plan_split({"prompt": ["a", "b"], "n": 2}, "completions", 8)
    assert split is not None
    usages = [
        {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}},
        {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}},
        {"prompt_tokens": 20, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}},
        {"prompt_tokens": 20, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 16}},
    ]
    merged = merged_usage(split, usages)
    assert merged is not None and merged["prompt_tokens_details"] == {"cached_tokens": 32}
    assert merged_usage(split, usages, streamed=True) == {
        "prompt_tokens": 60,
        "total_tokens": 68,
        "completion_tokens": 8,
    }


class FakeStream:
    """A part's relayed stream: chunks (arbitrarily cut), then the end."""

    def __init__(self, chunks: list[bytes], delay: float = 0.0) -> None:
        self.chunks = list(chunks)
        self.delay = delay
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(self.delay)
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def chunk(text: str) -> bytes:
    return sse({"id": "cmpl-e", "object": "text_completion", "choices": [{"index": 0, "text": text}]})


def usage_chunk(prompt: int, completion: int) -> bytes:
    return sse(
        {"id": "cmpl-e", "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    )


async def collect(stream: MergedStream) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    async for raw in stream:
        for event in raw.decode().split("\n\n"):
            if event.startswith("data: "):
                data = event[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_streams_merge_by_index_with_one_usage_chunk_and_one_done() -> None:
    split = plan_split({"prompt": ["a", "b"]}, "completions", 8)
    assert split is not None
    whole = chunk(" x") + chunk(" y") + usage_chunk(2, 2) + b"data: [DONE]\n\n"
    first = FakeStream([whole[:7], whole[7:40], whole[40:]], delay=0.001)  # cut mid-event
    second = FakeStream([chunk(" z") + usage_chunk(5, 1) + b"data: [DONE]\n\n"])
    outcomes: list[str] = []
    events = await collect(MergedStream(split, [first, second], "rid", outcomes.append))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    docs = [e for e in events if isinstance(e, dict)]
    assert {d["id"] for d in docs} == {"cmpl-rid"}
    texts = {0: "", 1: ""}
    for d in docs:
        for c in d["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: " x y", 1: " z"}
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["prompt_tokens"] == 7
    assert docs[-1]["usage"]["completion_tokens"] == 3
    assert outcomes == ["ok"]


async def test_a_parts_error_event_ends_the_merged_stream_and_closes_the_others() -> None:
    split = plan_split({"prompt": "x", "n": 2}, "completions", 8)
    assert split is not None
    error = sse({"error": {"message": "decode d0/0: the decode's stream broke", "code": "upstream_dropped"}})
    broken = FakeStream([chunk(" a"), error + b"data: [DONE]\n\n"])
    slow = FakeStream([chunk(" b")] * 50, delay=0.01)
    outcomes: list[str] = []
    events = await collect(MergedStream(split, [broken, slow], "rid", outcomes.append))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert isinstance(events[-2], dict) and events[-2]["error"]["code"] == "upstream_dropped"
    assert slow.closed and outcomes == ["stream_error"]


async def test_closing_the_merged_stream_early_closes_every_part() -> None:
    split = plan_split({"prompt": "x", "n": 2}, "completions", 8)
    assert split is not None
    parts = [FakeStream([chunk(" a")] * 10, delay=0.01) for _ in range(2)]
    outcomes: list[str] = []
    merged = MergedStream(split, parts, "rid", outcomes.append)
    await merged.__anext__()
    await merged.aclose()
    await merged.aclose()  # once is enough
    assert all(p.closed for p in parts) and outcomes == ["cancelled"]
