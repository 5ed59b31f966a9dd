"""One sequence in an engine rank: its token ids, how far it is computed, its timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.sim.engine.blocks import ROOT_HASH, chain_hashes
from pdserve.sim.tokenizer import word_id


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a decode leg, its KV being pulled
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class Kind(enum.Enum):
    PLAIN = "plain"
    PREFILL = "prefill"  # a P/D prefill leg: its blocks are held for the decode after it finishes
    DECODE = "decode"  # a P/D decode leg: its prompt's KV comes from the prefill


_OUTPUT_IDS: list[int] = []


def output_token_id(index: int) -> int:
    """The id of generated token ``index`` (the sim's text " tok<index>")."""
    while len(_OUTPUT_IDS) <= index:
        _OUTPUT_IDS.append(word_id(f"tok{len(_OUTPUT_IDS)}"))
    return _OUTPUT_IDS[index]


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # the prompt's; generated tokens are appended
    max_tokens: int
    arrival: float
    kind: Kind = Kind.PLAIN
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    status: Status = Status.WAITING
    #: Prompt tokens found computed when first scheduled (-1: not yet): usage's cached_tokens.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    #: Decode legs: prompt tokens pulled from the prefill (set when its blocks are allocated).
    num_external_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    previous_token: float | None = None  # the metrics' mark, for inter-token latency
    finished: float | None = None
    finish_reason: str = "length"
    blocks_at_finish: list[int] = field(default_factory=list)  # what a finished leg's answer names

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def hash_blocks(self, num_tokens: int, block_size: int) -> int:
        """Make sure ``block_hashes`` covers the full blocks among the first ``num_tokens`` tokens
        (hashing only the new ones); their number."""
        want = num_tokens // block_size
        have = len(self.block_hashes)
        if want > have:
            parent = self.block_hashes[-1] if have else ROOT_HASH
            end = want * block_size
            self.block_hashes += chain_hashes(self.token_ids[:end], block_size, parent, have)
        return want

    def append_output(self) -> None:
        self.token_ids.append(output_token_id(self.num_output_tokens))
        self.num_output_tokens += 1
