"""A prompt as the router sees it, cut into fixed chunks whose hashes are chained.

The text is the prompt before the engine's tokenizer and chat template: a completion's
``prompt`` string, or a chat's messages in order, each opened by its role (and a tool list, when
the request has one, first: chat templates render it at the top). Chunk ``i`` covers characters
``[i*C, (i+1)*C)``; only full chunks count, as only full blocks count in vLLM's prefix cache. A
chunk's hash folds in the hash of the one before, so equal hashes at position ``i`` mean equal
text up to the end of chunk ``i`` (a 64-bit collision aside): one dictionary probe per chunk
says how far two prompts agree, with no tree to walk.

A token-id prompt (a list of ints) is chunked as its ids, ``C / 4`` ids a chunk (about as many
tokens as ``C`` characters of English text hold).

The hashes are Python's own (SipHash over the chunk, then over the pair with the previous
hash): several times cheaper than a cryptographic hash on a prompt of tens of kilobytes, and
the same in every worker process, which are forked from one supervisor and so share its hash
secret. They are NOT the same in another router: what replicas must agree on without talking
uses :func:`stable_hash` (of the prompt's head, for rendezvous hashing).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.proxy.policies.base import RequestView

#: Why a prompt could not be chunked (``pdserve_proxy_prefix_unchunkable_total{reason}``).
EMPTY = "empty"
NON_TEXT = "non_text"
UNREADABLE = "unreadable"

_SEPARATOR = "\x00"  # between a role and its content, and between messages: never in JSON text


@dataclass
class Chunked(RequestView):
    """One sequence's prompt, cut: its chained chunk hashes and its length; or, with ``reason``,
    why it could not be cut (no hashes)."""

    hashes: list[int]
    chars: int  # the prompt's length (characters, or ids x 4 for a token-id prompt)
    #: The prompt's first ``head_chunks`` full chunks (fewer if it has fewer), for stable_hash:
    #: what several routers agree on without talking. Empty without a full chunk.
    head: bytes = b""
    reason: str | None = None
    #: Filled by the policy when it chooses: the match depth (in chunks) of every live slot that
    #: matched at least one chunk, and how the choice was made.
    depths: dict[str, int] = field(default_factory=dict)
    how: str = ""
    #: The request's turns, taken once each when first needed (flat interleave, tie-breaks).
    turn: int | None = None
    tie_turn: int | None = None


@dataclass(frozen=True)
class Unchunkable:
    """Why a prompt has no text to chunk."""

    reason: str


def prompt_text(endpoint: str, body: Mapping[str, Any]) -> str | Sequence[int] | Unchunkable:
    """The prompt as one string (or a token-id list), or why there is none to chunk."""
    if endpoint == "chat":
        return _chat_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt if prompt else Unchunkable(EMPTY)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt if prompt else Unchunkable(EMPTY)
    return Unchunkable(UNREADABLE)


def _chat_text(body: Mapping[str, Any]) -> str | Unchunkable:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return Unchunkable(UNREADABLE)
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(json.dumps(tools, sort_keys=True, separators=(",", ":")))
    has_text = False
    for message in messages:
        if not isinstance(message, Mapping):
            return Unchunkable(UNREADABLE)
        parts.append(str(message.get("role")))
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
            has_text = has_text or bool(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping) or part.get("type", "text") != "text":
                    return Unchunkable(NON_TEXT)  # an image's tokens are not in the text
                text = part.get("text")
                if not isinstance(text, str):
                    return Unchunkable(NON_TEXT)
                parts.append(text)
                has_text = has_text or bool(text)
        elif content is not None:
            return Unchunkable(UNREADABLE)
        calls = message.get("tool_calls")
        if calls:
            parts.append(json.dumps(calls, sort_keys=True, separators=(",", ":")))
            has_text = True
    if not has_text:
        return Unchunkable(EMPTY)
    return _SEPARATOR.join(parts)


def chunk_hashes(text: str | bytes, chunk: int) -> list[int]:
    """The chained hashes of ``text``'s full chunks of ``chunk`` characters (bytes)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(text) - chunk + 1, chunk):
        previous = hash((previous, text[start : start + chunk]))
        hashes.append(previous)
    return hashes


def chunk_prompt(endpoint: str, body: Mapping[str, Any], chunk_chars: int, head_chunks: int = 1) -> Chunked:
    """``body``'s prompt (one sequence's) cut into chunks of ``chunk_chars`` characters."""
    text = prompt_text(endpoint, body)
    if isinstance(text, Unchunkable):
        return Chunked([], 0, reason=text.reason)
    if isinstance(text, str):
        hashes = chunk_hashes(text, chunk_chars)
        head = text[: chunk_chars * min(head_chunks, len(hashes))].encode()
        return Chunked(hashes, len(text), head)
    try:
        ids = array("q", text).tobytes()
    except OverflowError:
        return Chunked([], 0, reason=UNREADABLE)
    step = max(8, chunk_chars // 4 * 8)  # chunk_chars / 4 ids of 8 bytes
    hashes = chunk_hashes(ids, step)
    return Chunked(hashes, len(text) * 4, ids[: step * min(head_chunks, len(hashes))])


def stable_hash(data: bytes, salt: str = "") -> int:
    """A 64-bit hash every process and every router computes alike."""
    digest = hashlib.blake2b(data, digest_size=8, person=salt.encode()[:16]).digest()
    return int.from_bytes(digest, "little")
