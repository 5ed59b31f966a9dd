"""Prompts built from hash ids share exactly the tokens their ids say, under the simulator's
tokenizer: k shared leading ids are k*512 shared leading tokens, a different id differs at its
block's first token, and a partial last block is the head of its full block."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.loadgen.prompts import (
    EXACT_IDS,
    FILLER_WORDS,
    BodyOptions,
    block_text,
    marker,
    prompt_text,
    request_body,
)
from pdserve.loadgen.trace import BLOCK_TOKENS, TraceRequest
from pdserve.sim.tokenizer import prompt_token_ids, text_token_ids


def _tokens(request: TraceRequest) -> list[int]:
    return text_token_ids(prompt_text(request))


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _req(ids: tuple[int, ...], length: int | None = None) -> TraceRequest:
    return TraceRequest(0, length if length is not None else BLOCK_TOKENS * len(ids), 1, ids)


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_k_shared_hash_ids_are_exactly_k_blocks_of_shared_tokens(k: int) -> None:
    common = tuple(range(100, 100 + k))
    a = _tokens(_req((*common, 1, 2)))
    b = _tokens(_req((*common, 3, 4)))
    assert len(a) == len(b) == BLOCK_TOKENS * (k + 2)
    assert _shared(a, b) == k * BLOCK_TOKENS
    assert a[k * BLOCK_TOKENS] != b[k * BLOCK_TOKENS], "different ids differ at their block's first token"


def test_every_block_is_512_tokens_and_the_prompt_input_length() -> None:
    request = TraceRequest(0, 3 * BLOCK_TOKENS + 7, 1, (9, 8, 7, 6))
    tokens = _tokens(request)
    assert len(tokens) == request.input_length
    for j, hash_id in enumerate(request.hash_ids):
        assert tokens[j * BLOCK_TOKENS] == zlib.crc32(marker(hash_id).encode())


def test_a_partial_last_block_is_the_head_of_its_full_block() -> None:
    short = _tokens(_req((1, 2, 3), 2 * BLOCK_TOKENS + 76))
    long = _tokens(_req((1, 2, 3, 4)))
    assert len(short) == 2 * BLOCK_TOKENS + 76
    assert _shared(short, long) == len(short)
    other = _tokens(_req((1, 2, 5), 2 * BLOCK_TOKENS + 76))
    assert _shared(other, long) == 2 * BLOCK_TOKENS
    assert block_text(3, 1) == marker(3)
    assert len(block_text(3, 200).split()) == 200


id_lists = st.lists(st.integers(0, 3 * 62**3), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(
    common=st.lists(st.integers(0, 50), max_size=3, unique=True),
    a_tail=id_lists,
    b_tail=id_lists,
    a_cut=st.integers(0, BLOCK_TOKENS - 1),
    b_cut=st.integers(0, BLOCK_TOKENS - 1),
)
def test_shared_tokens_are_min_of_shared_blocks_and_lengths(
    common: list[int], a_tail: list[int], b_tail: list[int], a_cut: int, b_cut: int
) -> None:
    a_ids, b_ids = (*common, *a_tail), (*common, *b_tail)
    k = 0
    while k < min(len(a_ids), len(b_ids)) and a_ids[k] == b_ids[k]:
        k += 1
    a = _req(a_ids, BLOCK_TOKENS * len(a_ids) - a_cut)
    b = _req(b_ids, BLOCK_TOKENS * len(b_ids) - b_cut)
    expected = min(k * BLOCK_TOKENS, a.input_length, b.input_length)
    assert _shared(_tokens(a), _tokens(b)) == expected


def test_markers_are_four_bytes_with_distinct_token_ids_and_never_filler() -> None:
    ids = [*range(0, 50_000), *range(EXACT_IDS - 1000, EXACT_IDS)]
    markers = [marker(i) for i in ids]
    assert all(len(m) == 4 and m[0].isdigit() for m in markers)
    assert len({zlib.crc32(m.encode()) for m in markers}) == len(ids)  # CRC-32 is 1:1 on 4 bytes
    assert not set(markers) & set(FILLER_WORDS)
    assert len(marker(EXACT_IDS)) > 4 and marker(EXACT_IDS) != marker(0)
    with pytest.raises(ValueError):
        marker(-1)


def test_completion_and_chat_bodies() -> None:
    request = _req((1, 2), 700)
    body = request_body(request, BodyOptions("completions", "m"))
    assert body == {
        "model": "m",
        "prompt": prompt_text(request),
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat = request_body(request, BodyOptions("chat", "m", ignore_eos=False))
    assert "ignore_eos" not in chat and chat["messages"] == [
        {"role": "user", "content": prompt_text(request)}
    ]
    # a chat prompt is the role token, then the same tokens
    assert prompt_token_ids(chat, "chat")[1:] == prompt_token_ids(body, "completions")
    assert len(prompt_token_ids(body, "completions")) == 700
