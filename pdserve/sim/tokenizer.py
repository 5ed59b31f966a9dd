"""The simulator's tokenizer: one token per whitespace-separated word, with ids every process agrees on.

Why a tokenizer at all: prefix caching keys KV blocks by token ids, so a simulated engine needs
ids, and a prefill and a decode (two processes) and the load generator that builds prompts must
all get the same ids from the same text. A word's id is its CRC-32, stable across processes and
runs (Python's ``hash`` is salted per process). Two different words may share an id (one pair
in about four billion), which could only add a false prefix hit.

Chat requests are tokenized as vLLM's chat templates do in spirit: every message contributes a
role marker token, then its content's words (text content parts in order). A token-id prompt
(a list of ints) is taken as it is. So two requests share exactly the leading tokens of their
shared leading text, word for word, and :func:`count_prompt_tokens` is always
``len(prompt_token_ids(...))`` (at least 1).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]


def word_id(word: str) -> int:
    """The token id of one word."""
    return zlib.crc32(word.encode())


def text_token_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) for w in text.split()]


def role_token_id(role: object) -> int:
    """The marker token that opens a chat message of ``role``."""
    return word_id(f"<|{role}|>")


def prompt_token_ids(body: Mapping[str, Any], endpoint: Endpoint) -> list[int]:
    """The prompt's token ids (a batched ``prompt`` list: every prompt's, concatenated)."""
    if endpoint == "chat":
        ids: list[int] = []
        for message in body.get("messages") or []:
            if not isinstance(message, Mapping):
                continue
            ids.append(role_token_id(message.get("role")))
            content = message.get("content")
            if isinstance(content, str):
                ids.extend(text_token_ids(content))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, Mapping):
                        ids.extend(text_token_ids(str(part.get("text", ""))))
        return ids
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_token_ids(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):
        return [t for p in prompt for t in prompt_token_ids({"prompt": p}, "completions")]
    return []


def count_prompt_tokens(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """``len(prompt_token_ids(body, endpoint))``, at least 1, without hashing every word."""
    if endpoint == "chat":
        total = 0
        for message in body.get("messages") or []:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, str):
                total += len(content.split())
            elif isinstance(content, list):
                total += sum(len(str(p.get("text", "")).split()) for p in content if isinstance(p, Mapping))
            total += 1  # the role marker
        return max(1, total)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return max(1, sum(count_prompt_tokens({"prompt": p}, "completions") for p in prompt))
    return 1
