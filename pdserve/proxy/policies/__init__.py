"""Routing policies by name; a new policy is one module plus one line here.

``--policy`` orders both roles' slots (flat-interleaved, least-outstanding); ``--prefill-policy``
may order the prefill slots differently (flat-interleaved, prefix-affinity), the decode slots
keeping ``--policy``'s order (:class:`ByRole`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pdserve.proxy.metrics import PrefixMetrics
from pdserve.proxy.policies.base import OrderOnly, Policy, RequestView
from pdserve.proxy.policies.counters import Counters
from pdserve.proxy.policies.flat_interleaved import FlatInterleaved
from pdserve.proxy.policies.least_outstanding import LeastOutstanding
from pdserve.proxy.policies.prefix_affinity import PrefixAffinity, PrefixOptions
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.prefix_log import PrefixLog
from pdserve.routing import Role, Slot, SlotTable

POLICIES: dict[str, type[Policy]] = {
    FlatInterleaved.name: FlatInterleaved,
    LeastOutstanding.name: LeastOutstanding,
}
DEFAULT_POLICY = FlatInterleaved.name
#: What ``--prefill-policy`` (``spec.router.prefillPolicy``) may name.
PREFILL_POLICIES = (FlatInterleaved.name, PrefixAffinity.name)


def make_policy(name: str, counters: Counters | None = None) -> Policy:
    """The policy ``name``; ``counters`` shared by every worker (default: this process's own)."""
    try:
        return POLICIES[name](counters)  # type: ignore[call-arg]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def make_policies(
    name: str,
    prefill: str | None = None,
    counters: Counters | None = None,
    prefix: PrefixOptions | None = None,
    log: PrefixLog | None = None,
    metrics: PrefixMetrics | None = None,
) -> Policy:
    """The router's policy: ``name`` for both roles, or with ``prefill`` another for the prefill
    slots (``prefix``, ``log`` and ``metrics`` are prefix-affinity's options, shared index log
    between workers, and metrics)."""
    both = make_policy(name, counters)
    if prefill is None or prefill == name:
        return both
    if prefill == PrefixAffinity.name:
        return ByRole(PrefixAffinity(counters, prefix, log, metrics), both)
    if prefill in POLICIES:
        return ByRole(make_policy(prefill, counters), both)
    raise ValueError(f"unknown prefill policy {prefill!r}; choose one of {', '.join(PREFILL_POLICIES)}")


class ByRole:
    """One policy for the prefill slots, another for the decode slots (one counters object: its
    counters are per role already)."""

    name: ClassVar[str] = "by-role"

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode
        self.reads_requests = prefill.reads_requests

    def _of(self, role: Role) -> Policy:
        return self.prefill if role is Role.PREFILL else self.decode

    def turn(self, role: Role, group: str = "") -> int:
        return self._of(role).turn(role, group)

    def candidates(
        self, role: Role, slots: Sequence[Slot], book: SlotBook, turn: int, request: RequestView | None = None
    ) -> list[Slot]:
        return self._of(role).candidates(role, slots, book, turn, request)

    def view(self, endpoint: str, body: Mapping[str, Any]) -> RequestView:
        return self.prefill.view(endpoint, body)

    def sent(self, role: Role, slot: Slot, request: RequestView) -> None:
        self._of(role).sent(role, slot, request)

    def table_changed(self, slots: SlotTable) -> None:
        self.prefill.table_changed(slots)
        self.decode.table_changed(slots)

    def describe(self) -> dict[str, Any]:
        return self.prefill.describe() or self.decode.describe()


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "PREFILL_POLICIES",
    "ByRole",
    "OrderOnly",
    "Policy",
    "PrefixAffinity",
    "PrefixOptions",
    "RequestView",
    "make_policies",
    "make_policy",
]
