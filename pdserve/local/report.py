"""What `pdserve up` tells its user about the run, in words: the events as they happen, and
the few lines that say which routers run, what the routing table holds and the autoscaler's
bounds.

Apart from the loop (:mod:`pdserve.local.runner`) and the processes
(:mod:`pdserve.local.supervisor`) so that both say things the same way, and so that the live
view (:mod:`pdserve.local.view`), which overrides :class:`Reporter`, needs neither.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.deployment.plan.autoscale import ROLES
from pdserve.local.plan import LocalPlan
from pdserve.local.scaler import LocalScaler
from pdserve.routing import Instance as TableInstance
from pdserve.routing import RoutingTable


class Reporter:
    """Where the runner's events go; the live view overrides this to show them in its frame."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self.scaling_lines: list[str] = []

    def event(self, text: str) -> None:
        print(f"[pdserve up {time.monotonic() - self._t0:6.1f}s] {text}", flush=True)

    def scaling(self, lines: Sequence[str]) -> None:
        """The autoscaler's state after a decision (the live view shows it above the slots, the
        summary lines after their figures)."""
        self.scaling_lines = list(lines)

    def final(self, text: str) -> None:
        """The last word, once nothing is drawn any more (the live view prints it under its frame)."""
        self.event(text)


def describe_bounds(scaler: LocalScaler) -> str:
    return ", ".join(
        f"{role} {scaler.spec.bounds(role).min_instances}-{scaler.spec.bounds(role).max_instances}"
        for role in ROLES
    )


def describe_routers(plan: LocalPlan, running: int | None = None) -> str:
    """Which placement runs, in a few words (the first lines of output say it); ``running``: the
    sidecars started (with spec.autoscaling, those of the decode instances it runs)."""
    if plan.sidecars:
        count = len(plan.routers) if running is None else running
        return (
            f"{count} sidecar router(s), one per decode instance (placement decode-sidecar; "
            f"{plan.url} spreads requests over them in turn)"
        )
    return "the router (placement deployment)"


def describe_table(table: RoutingTable) -> str:
    def role(instances: Sequence[TableInstance]) -> str:
        ready = sum(i.dp_size for i in instances if i.routable)
        total = sum(i.dp_size for i in instances)
        return f"{ready}/{total} slots ready"

    return f"prefill {role(table.prefill)}, decode {role(table.decode)}"
