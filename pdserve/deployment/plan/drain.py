"""When a draining pod may go: once every Ready router has stopped using it, or at the bound.

A drain starts by writing a routing table in which the pod is not routable (generation ``G``).
The routers learn it through their ConfigMap watch, and requests that started on an older table
still finish on the pod. So the pod may be deleted once every Ready router of the deployment
serves a generation ``>= G``, does not route to the pod, and reports 0 requests in flight to it
(``GET /routing/served``, :func:`parse_served`): reason ``routers-idle``. With no Ready router at
all, nothing can send it work: ``no-routers``. ``spec.rollout.drainSeconds`` is the upper bound
(``timeout``): a router that does not answer, or a request that never ends, only delays the
deletion until then.

Pure: the operator (pdserve.operator.dataplane.routers) and ``pdserve up`` fetch the reports with their own
HTTP clients (:func:`read_served` takes the GET) and perform the verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pdserve.deployment.plan.fetch import Get, get_json


@dataclass(frozen=True)
class RouterReport:
    """What one Ready router pod said it serves, or why it could not be read (``error``)."""

    pod: str
    generation: int | None = None
    deployment: str | None = None
    in_flight: Mapping[str, int] = field(default_factory=dict)  # per instance name
    routable: frozenset[str] = frozenset()  # instances it would send new requests to
    error: str | None = None

    @property
    def answered(self) -> bool:
        return self.error is None


async def read_served(get: Get, deployment: str, routers: Sequence[tuple[str, str]]) -> list[RouterReport]:
    """Every router's ``GET /routing/served`` at once; ``routers`` are (pod, base URL)."""

    async def one(pod: str, base: str) -> RouterReport:
        doc, problem = await get_json(get, f"{base}/routing/served")
        return RouterReport(pod, error=problem) if problem else parse_served(pod, doc, deployment)

    return list(await asyncio.gather(*(one(p, u) for p, u in routers)))


def parse_served(pod: str, doc: object, deployment: str) -> RouterReport:
    """A report from a ``/routing/served`` answer; one for another deployment counts as an error
    (a stale pod IP now used by someone else's router must not end a drain)."""
    if not isinstance(doc, Mapping):
        return RouterReport(pod, error="/routing/served did not answer a JSON object")
    served_for = doc.get("deployment")
    if served_for is not None and served_for != deployment:
        return RouterReport(pod, error=f"serves deployment {served_for!r}, not {deployment!r}")
    generation = doc.get("generation")
    if generation is not None and (not isinstance(generation, int) or isinstance(generation, bool)):
        return RouterReport(pod, error=f"unreadable generation {generation!r}")
    instances = doc.get("instances")
    if not isinstance(instances, Mapping):
        return RouterReport(pod, error="/routing/served has no instances object")
    in_flight: dict[str, int] = {}
    routable: set[str] = set()
    for name, row in instances.items():
        if not isinstance(row, Mapping):
            return RouterReport(pod, error=f"unreadable row for instance {name!r}")
        count = row.get("in_flight", 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return RouterReport(pod, error=f"unreadable in_flight for instance {name!r}")
        in_flight[str(name)] = count
        if row.get("in_table") and row.get("routable"):
            routable.add(str(name))
    return RouterReport(pod, generation, served_for, in_flight, frozenset(routable))


class DrainReason(StrEnum):
    ROUTERS_IDLE = "routers-idle"
    TIMEOUT = "timeout"
    NO_ROUTERS = "no-routers"
    WAITING = "waiting"


@dataclass(frozen=True)
class DrainVerdict:
    done: bool
    reason: DrainReason
    routers: int  # Ready routers asked
    waiting_for: tuple[str, ...] = ()  # why each router that is not done yet is not

    def describe(self) -> str:
        head = f"{self.reason.value}, {self.routers} router{'s' if self.routers != 1 else ''}"
        return head + (f" ({'; '.join(self.waiting_for)})" if self.waiting_for else "")


def drain_verdict(
    instance: str,
    left_generation: int | None,
    draining_since: float,
    now: float,
    drain_seconds: float,
    reports: Sequence[RouterReport],
) -> DrainVerdict:
    """Done or not for the draining ``instance``; ``reports`` are those of every Ready router.

    ``left_generation`` is the first generation written without it (None: not known yet, e.g.
    right after an operator restart: the routers cannot be shown to be past it).
    """
    if not reports:
        return DrainVerdict(True, DrainReason.NO_ROUTERS, 0)
    waiting = tuple(w for w in (_waiting_for(r, instance, left_generation) for r in reports) if w)
    if not waiting:
        return DrainVerdict(True, DrainReason.ROUTERS_IDLE, len(reports))
    if now - draining_since >= drain_seconds:
        return DrainVerdict(True, DrainReason.TIMEOUT, len(reports), waiting)
    return DrainVerdict(False, DrainReason.WAITING, len(reports), waiting)


def _waiting_for(report: RouterReport, instance: str, left_generation: int | None) -> str | None:
    if report.error is not None:
        return f"{report.pod}: {report.error}"
    if report.generation is None:
        return f"{report.pod}: serves no table yet"
    if left_generation is None:
        return f"{report.pod}: the generation without {instance} is not known yet"
    if report.generation < left_generation:
        return f"{report.pod}: serves generation {report.generation} < {left_generation}"
    if instance in report.routable:
        return f"{report.pod}: still routes to {instance}"
    count = report.in_flight.get(instance, 0)
    if count:
        return f"{report.pod}: {count} in flight to {instance}"
    return None


@dataclass(frozen=True)
class RoutersSummary:
    """What status shows: Ready routers, those serving the written generation, the oldest served."""

    ready: int
    current: int
    served_generation: int | None  # None: no Ready router answered
    behind: int = 0  # routers that answer but serve an older table (or none yet)

    def to_status(self) -> dict[str, Any]:
        return {"ready": self.ready, "current": self.current, "summary": f"{self.current}/{self.ready}"}


def summarize(reports: Sequence[RouterReport], written: int | None) -> RoutersSummary:
    """``current`` counts routers serving ``written`` or newer; ``behind`` those that answer with an
    older table, which the operator asks again soon (an unreachable one is not asked again early)."""
    answered = [r for r in reports if r.answered]
    served = [r.generation for r in answered if r.generation is not None]
    current = sum(1 for g in served if written is not None and g >= written)
    return RoutersSummary(len(reports), current, min(served) if served else None, len(answered) - current)
