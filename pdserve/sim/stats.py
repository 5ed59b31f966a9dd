"""The simulator's counters, read by tests through ``GET /sim/stats``.

Why a record per request (``recent``): proxy tests check what each leg actually received
(rank, request id, transfer id, kv_transfer_params, max_tokens), not just totals.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

RECENT_LIMIT = 256


@dataclass
class SimStats:
    role: str
    dp_size: int  # the ranks this process counts (a node of a multi-node group: its own)
    first_rank: int = 0  # the global rank of index 0: counts are keyed by global rank
    requests: int = 0
    # Wall-clock arrival of the newest request: end-to-end tests compare it with pod deletion times.
    last_request_at: float | None = None
    by_rank: list[int] = field(default_factory=list)
    by_leg: Counter[str] = field(default_factory=Counter)
    without_rank_header: int = 0
    in_flight: list[int] = field(default_factory=list)
    completed: int = 0
    cancelled: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    malformed_handoff: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    profile_calls: int = 0
    success: list[Counter[str]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    generation_tokens: list[int] = field(default_factory=list)
    #: Prompt tokens of decode legs, as vLLM's decode counts the KV its connector brought.
    external_hits: list[int] = field(default_factory=list)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_LIMIT))

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every counter; requests still running stay counted in ``in_flight``."""
        self.requests = 0
        self.by_rank = [0] * self.dp_size
        self.by_leg = Counter()
        self.without_rank_header = 0
        if len(self.in_flight) != self.dp_size:
            self.in_flight = [0] * self.dp_size
        self.completed = 0
        self.cancelled = 0
        self.rejected = Counter()
        self.malformed_handoff = 0
        self.faults = Counter()
        self.profile_calls = 0
        self.success = [Counter() for _ in range(self.dp_size)]
        self.prompt_tokens = [0] * self.dp_size
        self.generation_tokens = [0] * self.dp_size
        self.external_hits = [0] * self.dp_size
        self.recent.clear()

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "dp_size": self.dp_size,
            "requests": self.requests,
            "last_request_at": self.last_request_at,
            "by_rank": {str(self.first_rank + r): n for r, n in enumerate(self.by_rank)},
            "without_rank_header": self.without_rank_header,
            "by_leg": {leg: self.by_leg.get(leg, 0) for leg in ("prefill", "decode", "plain")},
            "in_flight": sum(self.in_flight),
            "in_flight_by_rank": {str(self.first_rank + r): n for r, n in enumerate(self.in_flight)},
            "completed": self.completed,
            "cancelled": self.cancelled,
            "rejected": dict(self.rejected),
            "malformed_handoff": self.malformed_handoff,
            "faults": dict(self.faults),
            "profile_calls": self.profile_calls,
            "recent": list(self.recent),
        }
