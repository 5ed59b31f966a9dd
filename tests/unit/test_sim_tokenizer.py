"""The simulator's tokenizer: ids shared by every process, counts equal to the ids' length."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.sim.tokenizer import Endpoint, count_prompt_tokens, prompt_token_ids, word_id

BODIES: list[tuple[dict[str, Any], Endpoint, int]] = [
    ({"prompt": "a b c"}, "completions", 3),
    ({"prompt": [5, 6, 7, 8]}, "completions", 4),
    ({"prompt": ["a b", "c"]}, "completions", 3),
    ({"prompt": [[1, 2], [3]]}, "completions", 3),
    ({"messages": [{"role": "user", "content": "a b"}]}, "chat", 3),
    (
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [{"text": "y z"}]}]},
        "chat",
        5,
    ),
    ({"messages": [{"role": "user"}]}, "chat", 1),
]


@pytest.mark.parametrize(("body", "endpoint", "count"), BODIES)
def test_count_is_the_number_of_ids(body: dict[str, Any], endpoint: Endpoint, count: int) -> None:
    assert count_prompt_tokens(body, endpoint) == count
    assert len(prompt_token_ids(body, endpoint)) == count


def test_ids_are_the_same_in_another_process() -> None:
    code = "from pdserve.sim.tokenizer import word_id; print(word_id('hello'), word_id('<|user|>'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(word_id("hello")), str(word_id("<|user|>"))]


words = st.lists(st.text(alphabet="abcxyz", min_size=1, max_size=4), max_size=30)


@given(words, words, words)
def test_a_shared_leading_text_is_a_shared_leading_token_run(
    shared: list[str], a: list[str], b: list[str]
) -> None:
    ids_a = prompt_token_ids({"prompt": " ".join(shared + a)}, "completions")
    ids_b = prompt_token_ids({"prompt": " ".join(shared + b)}, "completions")
    assert ids_a[: len(shared)] == ids_b[: len(shared)]
    chat_a = prompt_token_ids(
        {
            "messages": [
                {"role": "system", "content": " ".join(shared)},
                {"role": "user", "content": " ".join(a)},
            ]
        },
        "chat",
    )
    assert chat_a[: len(shared) + 1] == prompt_token_ids(
        {"messages": [{"role": "system", "content": " ".join(shared)}]}, "chat"
    )
