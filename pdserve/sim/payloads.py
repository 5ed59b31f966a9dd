"""What the simulator answers, as pure functions: generated text, OpenAI/vLLM response bodies
and stream chunks, request ids, KV block ids, rank choice and metrics (the ``kv_transfer_params``
each connector answers are its module's, pdserve.kv).

Shapes follow vLLM's OpenAI server (completion, chat.completion, their chunks) so a proxy
tested against the simulator also works in front of real vLLM.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.sim.tokenizer import Endpoint
from pdserve.wire.openai import RequestError

Leg = Literal["prefill", "decode", "plain"]

#: vLLM's default KV-cache block size; block ids per prompt follow from it.
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Identity:
    """Who this simulator claims to be, as reported in kv_transfer_params and /v1/models."""

    model: str
    instance_name: str
    kv_host: str
    kv_port: int
    tp_size: int = 1
    max_model_len: int = 4096


# --- generation ---------------------------------------------------------------------------------


def token_text(index: int) -> str:
    """The deterministic text of generated token ``index`` (tests compare whole outputs)."""
    return f" tok{index}"


def generated_text(num_tokens: int) -> str:
    return "".join(token_text(i) for i in range(num_tokens))


def echoed_prompt(body: Mapping[str, Any], endpoint: Endpoint) -> str:
    """``echo: true`` on a completion puts its (text) prompt before the output, as vLLM does."""
    prompt = body.get("prompt")
    if endpoint == "completions" and body.get("echo") is True and isinstance(prompt, str):
        return prompt
    return ""


def num_output_tokens(body: Mapping[str, Any], default_tokens: int) -> int:
    """``--tokens`` per request, capped by ``max_tokens`` (or ``max_completion_tokens``)."""
    cap = body.get("max_tokens")
    if cap is None:
        cap = body.get("max_completion_tokens")
    return default_tokens if cap is None else max(1, min(default_tokens, int(cap)))


def finish_reason(num_tokens: int, body: Mapping[str, Any]) -> str:
    cap = body.get("max_tokens") or body.get("max_completion_tokens")
    return "length" if cap is not None and num_tokens >= int(cap) else "stop"


def sequences(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """How many sequences vLLM would make of the request: prompts of a batch times ``n``."""
    n = body.get("n")
    count = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompt = body.get("prompt") if endpoint == "completions" else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        count *= len(prompt)
    return count


def wants_usage_in_stream(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


def usage(
    prompt_tokens: int, completion_tokens: int, streamed: bool = False, cached_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's ``usage``; the usage chunk of a stream carries only the three counts, and
    ``prompt_tokens_details`` when vLLM runs with --enable-prompt-tokens-details (``cached_tokens``
    given): then the body has all its fields, a stream's chunk only the set one (exclude_unset)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    details: dict[str, Any] | None = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens}
        if not streamed:
            details |= {"created_cache_tokens": None, "multimodal_tokens": None}
    if not streamed:
        out |= {"prompt_tokens_details": details, "completion_tokens_details": None}
    elif details is not None:
        out["prompt_tokens_details"] = details
    return out


# --- request classification ---------------------------------------------------------------------


def classify_leg(body: Mapping[str, Any]) -> Leg:
    """Which P/D leg a request is, from its kv_transfer_params; RequestError(400) when unusable."""
    params = body.get("kv_transfer_params")
    if params is None:
        return "plain"
    if not isinstance(params, Mapping):
        raise RequestError(400, "'kv_transfer_params' must be an object", param="kv_transfer_params")
    remote_decode = params.get("do_remote_decode") is True
    remote_prefill = params.get("do_remote_prefill") is True
    if remote_decode and remote_prefill:
        raise RequestError(
            400,
            "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true",
            param="kv_transfer_params",
        )
    if remote_decode:
        return "prefill"
    return "decode" if remote_prefill else "plain"


def rank_number(value: str) -> int:
    """A rank header's number; RequestError(400) when it is not one."""
    try:
        return int(value.strip())
    except ValueError:
        raise RequestError(400, f"data_parallel_rank {value!r} is not an integer.") from None


def parse_rank_header(value: str | None, dp_size: int) -> int | None:
    """The ``X-data-parallel-rank`` header; RequestError(400) in vLLM's words when out of range."""
    if value is None:
        return None
    rank = rank_number(value)
    if not 0 <= rank < dp_size:
        raise RequestError(400, f"data_parallel_rank {rank} is out of range [0, {dp_size}).")
    return rank


def pick_rank(in_flight: Sequence[int], cursor: int) -> int:
    """Least-loaded rank, ties broken round-robin from ``cursor`` (vLLM balances its own ranks)."""
    size = len(in_flight)
    order = [(cursor + i) % size for i in range(size)]
    return min(order, key=lambda r: in_flight[r])


# --- ids ----------------------------------------------------------------------------------------


def response_id(endpoint: Endpoint, base: str) -> str:
    return f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{base}"


def engine_request_id(endpoint: Endpoint, base: str, salt: str) -> str:
    """vLLM's internal request id (the one a NIXL prefill reports as remote_request_id):
    ``cmpl-<X-Request-Id or random>-0-<8 hex>`` for completions, ``chatcmpl-<...>-<8 hex>`` for chat."""
    if endpoint == "chat":
        return f"chatcmpl-{base}-{salt}"
    return f"cmpl-{base}-0-{salt}"


# --- KV blocks ----------------------------------------------------------------------------------


def block_ids(prompt_tokens: int, first_block: int) -> list[list[int]]:
    """One KV-cache group, ceil(prompt/16) blocks: vLLM sends a list of lists."""
    count = max(1, math.ceil(prompt_tokens / BLOCK_SIZE))
    return [list(range(first_block, first_block + count))]


# --- bodies and chunks --------------------------------------------------------------------------
# Keys, and which are null, as vLLM 0.32 answers (tests/fixtures/vllm-0.32.0/, held by
# tests/unit/test_vllm_fixtures.py).

#: ``system_fingerprint``: vLLM's is ``vllm-<version>-<hash of its config>``.
SYSTEM_FINGERPRINT = "pdserve-sim"


def completion_body(
    endpoint: Endpoint,
    rid: str,
    model: str,
    created: int,
    text: str,
    reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    kv_params: Mapping[str, Any] | None,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` or ``chat.completion`` body, as vLLM shapes it."""
    ends = {"finish_reason": reason, "stop_reason": None, "token_ids": None, "routed_experts": None}
    if endpoint == "chat":
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, **ends}
        extra: dict[str, Any] = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, **ends}
        choice |= {"prompt_logprobs": None, "prompt_token_ids": None}
        extra = {}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens=cached_tokens),
        "kv_transfer_params": dict(kv_params) if kv_params is not None else None,
        "ec_transfer_params": None,
        "metrics": None,
        **extra,
    }


def stream_chunk(
    endpoint: Endpoint, rid: str, model: str, created: int, text: str, reason: str | None
) -> dict[str, Any]:
    """One token's ``text_completion`` or ``chat.completion.chunk`` (``reason`` on the last)."""
    if endpoint == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
        choice["finish_reason"] = reason
        if reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        choice |= {"token_ids": None, "prompt_token_ids": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def chat_role_chunk(rid: str, model: str, created: int) -> dict[str, Any]:
    """vLLM opens a chat stream with the assistant role and empty content."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": None,
        "prompt_text": None,
    }


def usage_chunk(
    endpoint: Endpoint,
    rid: str,
    model: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The final ``stream_options.include_usage`` chunk: no choices, only usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, streamed=True, cached_tokens=cached_tokens),
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_body(identity: Identity, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": identity.model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": identity.model,
                "parent": None,
                "max_model_len": identity.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{identity.instance_name}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


# --- metrics ------------------------------------------------------------------------------------


def metrics_text(
    model: str,
    running: Sequence[int],
    success: Sequence[Mapping[str, int]],
    prompt_tokens: Sequence[int],
    generation_tokens: Sequence[int],
    external_hits: Sequence[int] | None = None,
    first_rank: int = 0,
) -> str:
    """Prometheus exposition of vLLM's per-engine metrics that routers and dashboards read
    (``engine`` is the global DP rank: ``first_rank`` is that of index 0)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    def labels(rank: int, **extra: str) -> str:
        parts = [
            f'engine="{first_rank + rank}"',
            f'model_name="{model}"',
            *(f'{k}="{v}"' for k, v in extra.items()),
        ]
        return "{" + ",".join(parts) + "}"

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
    lines += [f"vllm:num_requests_running{labels(r)} {n}" for r, n in enumerate(running)]
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
    lines += [f"vllm:num_requests_waiting{labels(r)} 0" for r in range(len(running))]
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for rank, by_reason in enumerate(success):
        for reason in ("length", "stop"):
            lines.append(
                f"vllm:request_success_total{labels(rank, finished_reason=reason)} {by_reason.get(reason, 0)}"
            )
    family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
    lines += [f"vllm:prompt_tokens_total{labels(r)} {n}" for r, n in enumerate(prompt_tokens)]
    family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
    lines += [f"vllm:generation_tokens_total{labels(r)} {n}" for r, n in enumerate(generation_tokens)]
    # A decode leg's prompt came over the KV connector: vLLM counts it as external cache hits.
    hits = external_hits if external_hits is not None else [0] * len(running)
    for name, help_text in (
        ("vllm:external_prefix_cache_queries_total", "External prefix cache queries from KV connector."),
        ("vllm:external_prefix_cache_hits_total", "External prefix cache hits from KV connector."),
    ):
        family(name, "counter", help_text)
        lines += [f"{name}{labels(r)} {n}" for r, n in enumerate(hits)]
    return "\n".join(lines) + "\n"
