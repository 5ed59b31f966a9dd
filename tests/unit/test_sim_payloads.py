"""What `pdserve sim` answers, built by pure functions: vLLM's shapes and P/D parameters."""

from __future__ import annotations

import json

import pytest

from pdserve.kv.nixl import prefill_params as nixl_prefill_params
from pdserve.sim import payloads
from pdserve.sim.payloads import Identity
from pdserve.wire.openai import RequestError

IDENTITY = Identity(model="m", instance_name="sim-a", kv_host="127.0.0.1", kv_port=5600)


def test_generated_text_is_deterministic() -> None:
    assert payloads.generated_text(3) == " tok0 tok1 tok2"
    assert "".join(payloads.token_text(i) for i in range(3)) == payloads.generated_text(3)


@pytest.mark.parametrize(
    ("body", "expected"),
    [({}, 16), ({"max_tokens": 4}, 4), ({"max_tokens": 100}, 16), ({"max_completion_tokens": 2}, 2)],
)
def test_max_tokens_caps_the_configured_tokens(body: dict[str, int], expected: int) -> None:
    assert payloads.num_output_tokens(body, 16) == expected


def test_finish_reason_is_length_only_when_the_cap_is_reached() -> None:
    assert payloads.finish_reason(4, {"max_tokens": 4}) == "length"
    assert payloads.finish_reason(4, {"max_tokens": 9}) == "stop"
    assert payloads.finish_reason(4, {}) == "stop"


def test_prompt_blocks() -> None:
    assert payloads.block_ids(1, 1) == [[1]]
    assert payloads.block_ids(16, 1) == [[1]]
    assert payloads.block_ids(17, 5) == [[5, 6]]
    assert payloads.block_ids(481, 1) == [list(range(1, 32))]


@pytest.mark.parametrize(
    ("params", "leg"),
    [
        (None, "plain"),
        ({}, "plain"),
        (nixl_prefill_params(), "prefill"),
        ({"do_remote_prefill": True}, "decode"),
        ({"do_remote_decode": False, "do_remote_prefill": False}, "plain"),
    ],
)
def test_classify_leg(params: object, leg: str) -> None:
    body = {"prompt": "x"} if params is None else {"prompt": "x", "kv_transfer_params": params}
    assert payloads.classify_leg(body) == leg


def test_classify_leg_rejects_unusable_params() -> None:
    with pytest.raises(RequestError):
        payloads.classify_leg({"kv_transfer_params": [1]})
    with pytest.raises(RequestError):
        payloads.classify_leg({"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True}})


def test_rank_header_in_vllms_words() -> None:
    assert payloads.parse_rank_header(None, 2) is None
    assert payloads.parse_rank_header("1", 2) == 1
    with pytest.raises(RequestError) as info:
        payloads.parse_rank_header("5", 2)
    assert info.value.status == 400
    assert info.value.message == "data_parallel_rank 5 is out of range [0, 2)."
    with pytest.raises(RequestError):
        payloads.parse_rank_header("-1", 2)
    with pytest.raises(RequestError):
        payloads.parse_rank_header("one", 2)


def test_pick_rank_least_loaded_then_round_robin() -> None:
    assert payloads.pick_rank([0, 0, 0], 0) == 0
    assert payloads.pick_rank([0, 0, 0], 2) == 2
    assert payloads.pick_rank([3, 1, 2], 0) == 1
    assert payloads.pick_rank([1, 0, 0], 0) == 1


def test_request_ids_follow_vllm() -> None:
    assert payloads.engine_request_id("completions", "abc", "0123abcd") == "cmpl-abc-0-0123abcd"
    assert payloads.engine_request_id("chat", "abc", "0123abcd") == "chatcmpl-abc-0123abcd"
    assert payloads.response_id("completions", "abc") == "cmpl-abc"


def test_bodies_and_chunks_have_openai_shapes() -> None:
    body = payloads.completion_body("chat", "chatcmpl-x", "m", 1, " tok0", "length", 3, 1, None)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == " tok0"
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1,
                             "prompt_tokens_details": None, "completion_tokens_details": None}  # fmt: skip
    chunk = payloads.stream_chunk("completions", "cmpl-x", "m", 1, " tok0", None)
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == " tok0"
    raw = payloads.sse(chunk)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:]) == chunk
    usage = payloads.usage_chunk("chat", "c", "m", 1, 2, 3)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert payloads.wants_usage_in_stream({"stream_options": {"include_usage": True}})
    assert not payloads.wants_usage_in_stream({"stream_options": {"include_usage": False}})


def test_models_and_metrics() -> None:
    models = payloads.models_body(IDENTITY, 1)
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "m" and models["data"][0]["owned_by"] == "vllm"
    text = payloads.metrics_text("m", [2, 0], [{"length": 3}, {}], [10, 0], [4, 0])
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2' in text
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 0' in text
    assert 'vllm:request_success_total{engine="0",model_name="m",finished_reason="length"} 3' in text
    assert "# TYPE vllm:request_success_total counter" in text
