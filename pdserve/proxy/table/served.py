"""The routing table this router serves, whichever source feeds it, and what it says about it.

Both table sources (the routing file and the ConfigMap watch) hand their text to
:meth:`ServedTable.offer`: one parse, one validation, one atomic swap, one log line and one set
of metrics, so a malformed table is refused the same way whatever it came from and the last
good one keeps serving. Requests take one snapshot (:attr:`ServedTable.current`) when they
start, so in-flight requests and their retries finish on the table they started with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve import kv
from pdserve.kv.base import Route
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import (
    Role,
    RoutingTable,
    RoutingTableError,
    Slot,
    SlotTable,
    build_slot_table,
    load_routing_table,
)
from pdserve.routing.slots import split_slot_key

#: Turns a parsed table into the slots this router routes to: every slot of the table for a
#: standalone router, the prefills plus its own engine for a decode sidecar (pdserve.routing.sidecar).
SlotBuilder = Callable[[RoutingTable], SlotTable]

log = logging.getLogger("pdserve.proxy.reload")


@dataclass(frozen=True)
class RoutingState:
    """One served generation: its slots and the connector that speaks its protocol (built once
    per table, so a request looks nothing up)."""

    slots: SlotTable
    connector: Route

    @property
    def generation(self) -> int:
        return self.slots.table.generation


def parse_state(text: str | bytes, build: SlotBuilder = build_slot_table) -> RoutingState:
    """A servable state from a routing table's JSON text; RoutingTableError/ValueError if not."""
    table = load_routing_table(text)
    return RoutingState(build(table), kv.by_table(table.connector.type).route(table.connector.transfer_mode))


class ServedTable:
    """The served state plus why the source may be stuck: ``rejected`` is the last table refused
    (cleared by the next good one), ``problem`` what stops the source from being read now."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        source: str,
        clock: Callable[[], float] = time.time,
        build: SlotBuilder = build_slot_table,
    ) -> None:
        self.metrics = metrics
        self.source = source
        self.build = build
        self.current: RoutingState | None = None
        self.loaded_at: float | None = None
        self.rejected: str | None = None
        self.problem: str | None = None
        self._clock = clock
        #: Called with every state newly served (the prefill policy's index follows the table).
        self.listeners: list[Callable[[RoutingState], None]] = []
        metrics.source_up.set(1)

    @property
    def generation(self) -> int | None:
        return self.current.generation if self.current else None

    def offer(self, text: str | bytes, origin: str) -> bool:
        """Serve ``text`` if it is a valid table; True when a new table is now served."""
        try:
            state = parse_state(text, self.build)
        except (RoutingTableError, ValueError) as exc:
            self.reject(origin, str(exc))
            return False
        return self.swap(state)

    def swap(self, state: RoutingState) -> bool:
        self.rejected = None
        old = self.current
        table = state.slots.table
        if old is not None and old.generation == table.generation and old.slots.table.same_content(table):
            return False
        self.current = state
        self.loaded_at = self._clock()
        self.metrics.reloads.inc()
        self.metrics.generation.set(table.generation)
        self.metrics.loaded_at.set(self.loaded_at)
        for role in Role:
            self.metrics.slots.labels(role.value).set(len(state.slots.slots(role)))
        self.metrics.set_unpaired((u.role.value, u.revision, u.slots) for u in state.slots.unpaired)
        log.info(
            "routing table loaded from %s: deployment=%s generation=%d connector=%s prefill_slots=%d "
            "decode_slots=%d",
            self.source,
            table.deployment,
            table.generation,
            state.connector.name,
            len(state.slots.prefill),
            len(state.slots.decode),
        )
        for unpaired in state.slots.unpaired:
            log.warning("routing table generation %d: %s", table.generation, unpaired.describe())
        for listener in self.listeners:
            listener(state)
        return True

    def reject(self, origin: str, reason: str) -> None:
        """Refuse a table (counted, logged); the last good one keeps serving."""
        kept = self.generation if self.current else "none"
        self.rejected = f"{origin} rejected, keeping generation {kept}: {reason}"
        self.metrics.reload_errors.inc()
        log.error("%s", self.rejected)

    def set_problem(self, message: str | None) -> None:
        """What keeps the source from being read (None once it reads again); logged on change."""
        if message == self.problem:
            return
        self.problem = message
        self.metrics.source_up.set(0 if message else 1)
        if message:
            log.error("%s", message)
        else:
            log.info("routing table source %s is read again", self.source)

    @property
    def last_error(self) -> str | None:
        return self.problem or self.rejected

    def not_ready_reason(self) -> str | None:
        """None when the served table has a routable slot of each role, else why not."""
        state = self.current
        missing = [role.value for role in Role if state is None or not state.slots.slots(role)]
        if not missing:
            return None
        causes = [c for c in (self.problem, self.rejected) if c]
        if state is None:
            head = f"no routing table loaded yet from {self.source}"
        else:
            table = state.slots.table
            absent = [r.value for r in Role if not any(i.routable for i in table.instances(r))]
            head = (
                f"generation {state.generation} has no routable {' or '.join(absent)} instance"
                if absent
                else f"generation {state.generation} has no prefill and decode of the same revision"
            )
        return "; ".join([head, *causes])


def served_view(served: ServedTable, book: SlotBook) -> dict[str, Any]:
    """``GET /routing/served``: the generation served and who is in use, per instance and slot.

    Instances that left the table stay listed (``in_table: false``) while requests that
    started on an earlier generation still use them. No URLs, keys or headers: the endpoint
    is open.
    """
    state = served.current
    table = state.slots.table if state else None
    instances: dict[str, dict[str, Any]] = {}
    slots: dict[tuple[Role, str], dict[str, Any]] = {}
    for role in Role:
        for inst in table.instances(role) if table else ():
            instances[inst.name] = _instance_row(role, True, inst.routable)
        for slot in state.slots.slots(role) if state else ():
            slots[(role, slot.key)] = {
                **_slot_row(role, slot.instance.name, slot.dp_rank),
                **endpoint_fields(slot),
            }
    for role, key, count in sorted(book.busy_slots()):
        name, rank = split_slot_key(key)
        instances.setdefault(name, _instance_row(role, False, False))["in_flight"] += count
        slots.setdefault((role, key), _slot_row(role, name, rank))["in_flight"] = count
    return {
        "deployment": table.deployment if table else None,
        "generation": table.generation if table else None,
        "source": served.source,
        "loaded_at": served.loaded_at,
        "routable": {role.value: len(state.slots.slots(role)) if state else 0 for role in Role},
        "instances": instances,
        "slots": list(slots.values()),
        "error": served.last_error,
    }


def _instance_row(role: Role, in_table: bool, routable: bool) -> dict[str, Any]:
    return {"role": role.value, "in_table": in_table, "routable": routable, "in_flight": 0}


def endpoint_fields(slot: Slot) -> dict[str, Any]:
    """A slot of a multi-node instance: its node's API server (the endpoint's first rank, no URL:
    /routing/served is open) and the rank as that server numbers it. Nothing for other slots."""
    endpoint = slot.endpoint
    if endpoint is None:
        return {}
    return {"endpoint_first_rank": endpoint.first_rank, "local_rank": slot.local_rank}


def _slot_row(role: Role, instance: str, dp_rank: int) -> dict[str, Any]:
    return {"role": role.value, "instance": instance, "dp_rank": dp_rank, "in_flight": 0}
