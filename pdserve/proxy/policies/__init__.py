"""Routing policies by ``--policy`` name; a new policy is one module plus one line here."""

from __future__ import annotations

from pdserve.proxy.policies.base import Policy
from pdserve.proxy.policies.counters import Counters
from pdserve.proxy.policies.flat_interleaved import FlatInterleaved
from pdserve.proxy.policies.least_outstanding import LeastOutstanding

POLICIES: dict[str, type[Policy]] = {
    FlatInterleaved.name: FlatInterleaved,
    LeastOutstanding.name: LeastOutstanding,
}
DEFAULT_POLICY = FlatInterleaved.name


def make_policy(name: str, counters: Counters | None = None) -> Policy:
    """The policy ``name``; ``counters`` shared by every worker (default: this process's own)."""
    try:
        return POLICIES[name](counters)  # type: ignore[call-arg]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "make_policy"]
