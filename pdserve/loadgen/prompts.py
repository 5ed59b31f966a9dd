"""Prompt text for a trace record: shared hash ids become shared leading tokens.

Every block of :data:`~pdserve.loadgen.trace.BLOCK_TOKENS` words is its hash id's *marker* word
followed by the same fixed filler words. Under the simulator's tokenizer (one token per word, the
word's CRC-32; :mod:`pdserve.sim.tokenizer`) this makes sharing exact:

* the token at position ``512*j + r`` is the marker of ``hash_ids[j]`` when ``r == 0`` and filler
  word ``r - 1`` otherwise, so two prompts whose id lists agree on their first ``k`` ids share at
  least ``k*512`` leading tokens (their lengths allowing);
* markers are 4-byte words for ids below :data:`EXACT_IDS` (a digit, then three base-62 digits),
  and CRC-32 is one-to-one on 4-byte strings, so different ids give different first tokens: the
  prompts diverge at the first token of the first differing block, and share exactly ``k*512``;
* the last block of a prompt whose length is not a multiple of 512 is the first words of its
  block, so a partial block shares its leading tokens with the same id's full block.

With a real model's tokenizer the filler words (common English words) are one token each in the
usual BPE vocabularies, and a marker a few (digits and letters): about 2-4 tokens more per 512 (see
docs/benchmarking.md for a measured figure), and shared text still means shared tokens because the
words are separated by spaces. Servers add their own tokens (a BOS token, a chat template).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.loadgen.trace import BLOCK_TOKENS, TraceRequest

Endpoint = Literal["completions", "chat"]

_DIGITS = "0123456789"
_BASE62 = _DIGITS + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: Ids below this get a 4-byte marker (exactly one distinct sim token each); larger ids a longer
#: one, still one token but distinct only with CRC-32's odds (2**-32 per pair).
EXACT_IDS = 10 * 62**3

#: Words that are single tokens in common BPE vocabularies (GPT-2, Llama, Qwen, and the tiny test
#: model's tokenizer, which was trained on a corpus using them).
FILLER_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on")
_FILLER_SEED = 512


def marker(hash_id: int) -> str:
    """The first word of ``hash_id``'s block: a digit then base-62 digits, never a filler word."""
    if hash_id < 0:
        raise ValueError(f"hash ids are >= 0, got {hash_id}")
    head, rest = divmod(hash_id, 62**3)
    tail = ""
    for _ in range(3):
        rest, digit = divmod(rest, 62)
        tail = _BASE62[digit] + tail
    if head < 10:
        return _DIGITS[head] + tail
    return str(head) + tail  # longer than 4 bytes: past EXACT_IDS


def _filler() -> tuple[str, tuple[int, ...]]:
    """The 511 filler words as one string, and where its first n words end (n = 0..511)."""
    rng = random.Random(_FILLER_SEED)
    words = [rng.choice(FILLER_WORDS) for _ in range(BLOCK_TOKENS - 1)]
    text = " ".join(words)
    ends = [0]
    for w in words:
        ends.append(ends[-1] + len(w) + (1 if len(ends) > 1 else 0))
    return text, tuple(ends)


_FILLER_TEXT, _FILLER_ENDS = _filler()


def block_text(hash_id: int, words: int = BLOCK_TOKENS) -> str:
    """The first ``words`` words (1..512) of ``hash_id``'s block."""
    if not 1 <= words <= BLOCK_TOKENS:
        raise ValueError(f"a block has 1..{BLOCK_TOKENS} words, asked for {words}")
    if words == 1:
        return marker(hash_id)
    return marker(hash_id) + " " + _FILLER_TEXT[: _FILLER_ENDS[words - 1]]


def prompt_text(request: TraceRequest) -> str:
    """``input_length`` words: one block per hash id, the last one cut to what is left."""
    parts = []
    left = request.input_length
    for hash_id in request.hash_ids:
        if left <= 0:
            break
        n = min(left, BLOCK_TOKENS)
        parts.append(block_text(hash_id, n))
        left -= n
    if left > 0:  # complete_blocks() gives every block an id; a hand-made record may not
        raise ValueError(f"{left} of {request.input_length} prompt tokens have no hash id")
    return " ".join(parts)


@dataclass(frozen=True)
class BodyOptions:
    endpoint: Endpoint = "completions"
    model: str = ""
    #: vLLM's ``ignore_eos``: generate ``output_length`` tokens even when the model would stop.
    ignore_eos: bool = True


def request_body(request: TraceRequest, options: BodyOptions) -> dict[str, Any]:
    """A streaming OpenAI request for ``request`` (usage asked for in the last chunk)."""
    body: dict[str, Any] = {"model": options.model}
    text = prompt_text(request)
    if options.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body["max_tokens"] = request.output_length
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body
