"""Watch the routing file and swap in each valid new table atomically.

The file is usually a mounted ConfigMap: the kubelet writes a new ``..<timestamp>`` directory
and atomically repoints the ``..data`` symlink, so the watched path keeps its name while the
file behind it changes. We therefore poll the *resolved* target (real path, inode, mtime,
size) rather than waiting for events on the path itself; this also catches a plainly
rewritten file. Requests take one snapshot of the state when they start, so in-flight
requests (and their retries) finish on the table they started with.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.proxy.connectors import Connector, make_connector
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.routing import Role, RoutingTableError, SlotTable, build_slot_table, load_routing_table

log = logging.getLogger("pdserve.proxy.reload")

FileSignature = tuple[str, int, int, int, int]


@dataclass(frozen=True)
class RoutingState:
    """One served generation: its slots and the connector that speaks its protocol."""

    slots: SlotTable
    connector: Connector

    @property
    def generation(self) -> int:
        return self.slots.table.generation


def file_signature(path: Path) -> FileSignature:
    """What identifies the file's current content without reading it (all -1 when absent)."""
    try:
        st = os.stat(path)  # follows the ..data symlink chain
    except OSError:
        return (os.path.realpath(path), -1, -1, -1, -1)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class RoutingWatcher:
    def __init__(self, path: Path, metrics: ProxyMetrics, interval: float = 0.2) -> None:
        self.path = path
        self.metrics = metrics
        self.interval = interval
        self.current: RoutingState | None = None
        self.last_error: str | None = None
        self._seen: FileSignature | None = None
        self._suspect: FileSignature | None = None

    def poll(self, confirm_errors: bool = True) -> bool:
        """Load the file if it changed; True when a new table is now served.

        With ``confirm_errors`` a bad file must look the same on two polls in a row before it
        counts as an error, so a writer caught half-way through a plain rewrite is not one.
        """
        signature = file_signature(self.path)
        if signature == self._seen:
            return False
        try:
            text = self.path.read_bytes()
            table = load_routing_table(text)
            state = RoutingState(build_slot_table(table), make_connector(table.connector))
        except (OSError, RoutingTableError, ValueError) as exc:
            if confirm_errors and self._suspect != signature:
                self._suspect = signature  # look again next poll before calling it an error
                return False
            self._seen = signature
            self._record_error(
                f"routing file {self.path} rejected, keeping generation "
                f"{self.current.generation if self.current else 'none'}: {exc}"
            )
            return False
        self._seen = signature
        self._suspect = None
        old = self.current
        if old is not None and old.generation == table.generation and old.slots.table.same_content(table):
            return False
        self.current = state
        self.last_error = None
        self.metrics.reloads.inc()
        self.metrics.generation.set(table.generation)
        for role in Role:
            self.metrics.slots.labels(role.value).set(len(state.slots.slots(role)))
        self.metrics.set_unpaired((u.role.value, u.revision, u.slots) for u in state.slots.unpaired)
        log.info(
            "routing table loaded: deployment=%s generation=%d connector=%s prefill_slots=%d decode_slots=%d",
            table.deployment,
            table.generation,
            state.connector.name,
            len(state.slots.prefill),
            len(state.slots.decode),
        )
        for unpaired in state.slots.unpaired:
            log.warning("routing table generation %d: %s", table.generation, unpaired.describe())
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.poll()
            except Exception:  # the watcher must outlive any surprise; the last good table stays
                log.exception("routing file watcher failed; retrying")

    def _record_error(self, message: str, count: bool = True) -> None:
        self.last_error = message
        if count:
            self.metrics.reload_errors.inc()
        log.error("%s", message)
