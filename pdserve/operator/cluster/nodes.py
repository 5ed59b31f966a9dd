"""What the Node watch has shown: each node's allocatable resources and since when it is lost.

Why a watch and not a periodic LIST: the reconciler needs two things from nodes, the
allocatable GPUs per node (the per-node fit check of :mod:`pdserve.deployment.validate`) and
whether the node a pod is bound to has stopped answering (node loss: its pods must be replaced
and leave the routing table). The first changes rarely, the second must be seen at once; a
LIST every 30 s was both too slow for the second and wasteful for the first. kopf feeds every
Node event in here (:func:`pdserve.operator.control.handlers.node_event`), one LIST at startup seeds the
cache so that :meth:`NodeCache.ready_known` can say "every node is known".

A node is *lost* when its Ready condition is False or Unknown (the node lifecycle controller
sets Unknown when the kubelet's heartbeats stop for ``--node-monitor-grace-period``), since that
condition's ``lastTransitionTime``; or when the Node object was deleted, since the deletion was
seen (its pods are as gone as it is).

Ordering follows :mod:`pdserve.operator.cluster.cache`: each entry keeps the resourceVersion it came
with, and an older version never overwrites a newer one (nor resurrects a deleted node).

Thread-safe: kopf's event loop writes while reconcile threads read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pdserve.operator.cluster.cache import resource_version, version_number

Body = Mapping[str, Any]

#: How long a deleted node is remembered (its pods are force-deleted by the pod garbage
#: collector well within this); a name reused afterwards is a new node anyway.
TOMBSTONE_SECONDS = 3600.0


@dataclass(frozen=True)
class _Node:
    version: int | None
    allocatable: Mapping[str, Any] | None  # None: deleted
    lost_since: float | None  # None: Ready, or no Ready condition yet


def quantity(value: object) -> int:
    """Extended resources (GPUs) are whole numbers; anything else counts as none."""
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0


def parse_time(value: object) -> float | None:
    """An RFC 3339 timestamp as epoch seconds; None when absent or malformed."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def ready_condition(body: Body) -> Mapping[str, Any] | None:
    for condition in (body.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition
    return None


def lost_since(body: Body, now: float) -> float | None:
    """Since when the node's Ready condition is False or Unknown; None while Ready or unreported.

    A condition without a readable ``lastTransitionTime`` counts from ``now`` (first seen).
    """
    condition = ready_condition(body)
    if condition is None or condition.get("status") == "True":
        return None
    since = parse_time(condition.get("lastTransitionTime"))
    return since if since is not None else now


class NodeCache:
    """The watch-fed node view the reconciler reads: allocatable per node, lost nodes."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._synced = False
        self._unreadable = False
        self._next_prune = 0.0

    # --- writes (kopf's event loop, the startup LIST) ------------------------------------------

    def event(self, event_type: str | None, body: Body) -> bool:
        """A watch event (or one listed node); True when the node's lost state changed.

        "Changed" means :meth:`not_ready_since` now answers differently for it: a node turned
        NotReady or Unknown, became Ready again, was deleted, or was first seen already lost.
        """
        name = str((body.get("metadata") or {}).get("name") or "")
        if not name:
            return False
        now = self._clock()
        with self._lock:
            return self._put(name, event_type, body, now)

    def replace(self, items: Iterable[Body], list_version: str | int | None = None) -> list[str]:
        """A LIST of every node: seeds the cache (:meth:`ready_known`); returns the changed names.

        A node missing from the LIST is gone unless the watch already showed a newer version.
        """
        floor = version_number(list_version)
        now = self._clock()
        changed = []
        with self._lock:
            listed = set()
            for body in items:
                name = str((body.get("metadata") or {}).get("name") or "")
                if name:
                    listed.add(name)
                    if self._put(name, "LISTED", body, now):
                        changed.append(name)
            for name, node in list(self._nodes.items()):
                if name in listed or node.allocatable is None:
                    continue
                if node.version is None or floor is None or node.version <= floor:
                    since = now if node.lost_since is None else min(node.lost_since, now)
                    self._nodes[name] = _Node(floor, None, since)
                    changed.append(name)
            self._synced = True
            self._unreadable = False
        return changed

    def unreadable(self) -> None:
        """Nodes cannot be read (no RBAC for them): every question answers "unknown" (None)."""
        with self._lock:
            self._unreadable = True

    def _put(self, name: str, event_type: str | None, body: Body, now: float) -> bool:
        version = resource_version(body)
        current = self._nodes.get(name)
        if (
            current is not None
            and version is not None
            and current.version is not None
            and version <= current.version
        ):
            return False  # an older or repeated version never overwrites a newer one
        before = current.lost_since if current is not None else None
        if event_type == "DELETED":
            entry = _Node(version, None, now if before is None else min(before, now))
        else:
            allocatable = dict((body.get("status") or {}).get("allocatable") or {})
            since = lost_since(body, now)
            if (
                since is not None
                and before is not None
                and current is not None
                and current.allocatable is not None
            ):
                # Still lost (False -> Unknown moves lastTransitionTime): lost since the first of them.
                since = min(since, before)
            entry = _Node(version, allocatable, since)
        self._nodes[name] = entry
        self._prune(now)
        return before != entry.lost_since

    def _prune(self, now: float) -> None:
        """Forget deleted nodes after TOMBSTONE_SECONDS; scans at most once a minute."""
        if now < self._next_prune:
            return
        self._next_prune = now + 60.0
        for name, node in list(self._nodes.items()):
            if (
                node.allocatable is None
                and node.lost_since is not None
                and now - node.lost_since > TOMBSTONE_SECONDS
            ):
                del self._nodes[name]

    # --- reads (reconcile threads) -------------------------------------------------------------

    def allocatable(self, resource: str) -> list[int] | None:
        """Allocatable count of ``resource`` per existing node; None when nodes cannot be read
        or are not known yet (the per-node fit check is then skipped, not failed)."""
        with self._lock:
            if self._unreadable or not self._synced:
                return None
            return [
                quantity(n.allocatable.get(resource, 0))
                for n in self._nodes.values()
                if n.allocatable is not None
            ]

    def not_ready_since(self, node_name: str) -> float | None:
        """Epoch seconds since when the node is lost (Ready False/Unknown, or deleted).

        None when it is Ready, has not reported a Ready condition yet, is unknown to the
        cache, or nodes cannot be read.
        """
        with self._lock:
            if self._unreadable:
                return None
            node = self._nodes.get(node_name)
            return node.lost_since if node is not None else None

    def pending(self) -> bool:
        """Nodes can be read but have not been listed yet (the operator just started)."""
        with self._lock:
            return not self._synced and not self._unreadable

    def ready_known(self) -> bool:
        """Whether a node LIST went in: tells "no node info" apart from "the node is Ready"."""
        with self._lock:
            return self._synced and not self._unreadable
