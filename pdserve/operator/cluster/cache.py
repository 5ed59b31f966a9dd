"""What the watches have shown: each PDDeployment's body, its instance pods, its router's availability.

Why: the path from a pod's readiness change to the routing table must not wait on API reads.
kopf's handlers already receive every watch event with the full object; feeding them in here
lets a pass triggered by a pod event plan from memory and only write. Full passes (spec change,
periodic resync, first sight of a deployment) still GET and LIST, and :meth:`ClusterCache.
replace_pods` folds that listing in, which corrects any drift.

Ordering: a LIST answer, a write's response and a watch event about the same object can reach
us in any order. Every entry keeps the ``resourceVersion`` it came with, and an older version
never overwrites a newer one (nor resurrects a deleted pod). Kubernetes documents resource
versions as opaque; every API server in practice serves etcd revisions, integers that grow with
each write, and a version that does not parse as one is simply taken as the newest.

Deletion: a PDDeployment whose DELETED event or ``deletionTimestamp`` was seen is marked gone,
so a late pod event can never make a pass recreate its pods.

Thread-safe: kopf's event loop writes while reconcile threads read. Bodies are stored as given
and must not be mutated by readers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment.render.names import DEPLOYMENT_LABEL

Key = tuple[str, str]  # (namespace, PDDeployment name)
Body = Mapping[str, Any]


def version_number(value: object) -> int | None:
    """A resourceVersion as an integer; None when absent or not a number."""
    try:
        return int(str(value))
    except ValueError:
        return None


def resource_version(body: Body) -> int | None:
    return version_number((body.get("metadata") or {}).get("resourceVersion"))


def owner_key(body: Body) -> Key | None:
    """The PDDeployment an object belongs to, by its ``pdserve.io/deployment`` label; None if none."""
    meta = body.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(DEPLOYMENT_LABEL)
    return (str(meta.get("namespace") or ""), str(owner)) if owner else None


def _older(incoming: int | None, current: int | None) -> bool:
    """Whether ``incoming`` is known to be no newer than ``current`` (unknowns are newest)."""
    return incoming is not None and current is not None and incoming <= current


@dataclass
class _Versioned:
    version: int | None
    body: Body | None  # None: deleted


@dataclass
class _PodSet:
    pods: dict[str, _Versioned] = field(default_factory=dict)  # by pod name, deletions included
    floor: int | None = None  # version of the last LIST: nothing older can add to it
    seeded: bool = False  # a LIST went in: the set is complete, not just what events showed


class ClusterCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deployments: dict[Key, _Versioned] = {}
        self._pods: dict[Key, _PodSet] = {}
        self._routers: dict[Key, tuple[int | None, int | None]] = {}  # (version, available; None: gone)
        #: Backend lws: the deployment's LeaderWorkerSets by name, as last listed, created or deleted.
        self._sets: dict[Key, dict[str, Body]] = {}

    # --- PDDeployments -----------------------------------------------------------------------

    def deployment_event(self, event_type: str | None, body: Body) -> Key:
        """A watch event, a GET or a write's response; a deletion in progress counts as deleted."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        deleted = event_type == "DELETED" or bool(meta.get("deletionTimestamp"))
        with self._lock:
            current = self._deployments.get(key)
            version = resource_version(body)
            if current is None or not _older(version, current.version):
                self._deployments[key] = _Versioned(version, None if deleted else body)
        return key

    def deployment_absent(self, key: Key) -> None:
        """A GET answered 404: the object is gone, whatever an older event said."""
        with self._lock:
            current = self._deployments.get(key)
            self._deployments[key] = _Versioned(current.version if current else None, None)

    def deployment(self, key: Key) -> Body | None:
        """The newest body seen; None when never seen or deleted (see :meth:`deleted`)."""
        with self._lock:
            entry = self._deployments.get(key)
            return entry.body if entry is not None else None

    def deleted(self, key: Key) -> bool:
        with self._lock:
            entry = self._deployments.get(key)
            return entry is not None and entry.body is None

    # --- instance pods -----------------------------------------------------------------------

    def pod_event(self, event_type: str | None, body: Body) -> Key | None:
        """A watch event or a write's response for one instance pod; returns its deployment."""
        key = owner_key(body)
        if key is None:
            return None
        with self._lock:
            self._put_pod(self._pods.setdefault(key, _PodSet()), event_type, body)
        return key

    def replace_pods(self, key: Key, items: Iterable[Body], list_version: int | None) -> None:
        """A LIST of the deployment's pods at ``list_version``: what it lacks is gone, unless newer."""
        with self._lock:
            pods = self._pods.setdefault(key, _PodSet())
            listed = set()
            for body in items:
                listed.add(str((body.get("metadata") or {}).get("name") or ""))
                self._put_pod(pods, "LISTED", body)
            for name, entry in list(pods.pods.items()):
                # Kept when newer than the LIST: created after it, or a deletion that must
                # still outrank late events of the deleted pod.
                if name not in listed and _older(entry.version, list_version):
                    del pods.pods[name]
            pods.floor = list_version
            pods.seeded = True

    def pods(self, key: Key) -> list[Body] | None:
        """Every live instance pod of the deployment; None until a LIST has seeded the set."""
        with self._lock:
            pods = self._pods.get(key)
            if pods is None or not pods.seeded:
                return None
            return [e.body for e in pods.pods.values() if e.body is not None]

    def deployments_on_node(self, node: str) -> set[Key]:
        """The PDDeployments with a live instance pod bound to ``node`` (its ``spec.nodeName``)."""
        with self._lock:
            return {
                key
                for key, pods in self._pods.items()
                if any(
                    e.body is not None and (e.body.get("spec") or {}).get("nodeName") == node
                    for e in pods.pods.values()
                )
            }

    @staticmethod
    def _put_pod(pods: _PodSet, event_type: str | None, body: Body) -> None:
        name = str((body.get("metadata") or {}).get("name") or "")
        version = resource_version(body)
        if _older(version, pods.floor):
            return  # the last LIST already reflects this version or a newer one
        current = pods.pods.get(name)
        if current is not None and _older(version, current.version):
            return
        pods.pods[name] = _Versioned(version, None if event_type == "DELETED" else body)

    # --- the router Deployment ---------------------------------------------------------------

    def router_event(self, event_type: str | None, body: Body) -> Key | None:
        key = owner_key(body)
        if key is None:
            return None
        version = resource_version(body)
        available = None
        if event_type != "DELETED":
            available = int((body.get("status") or {}).get("availableReplicas") or 0)
        with self._lock:
            current = self._routers.get(key)
            if current is None or not _older(version, current[0]):
                self._routers[key] = (version, available)
        return key

    def router_available(self, key: Key) -> int | None:
        """Available router replicas; None when unknown or the router Deployment is gone."""
        with self._lock:
            current = self._routers.get(key)
            return current[1] if current is not None else None

    # --- LeaderWorkerSets (backend lws) -------------------------------------------------------

    def replace_sets(self, key: Key, items: Iterable[Body]) -> None:
        """A LIST of the deployment's LeaderWorkerSets (a full pass)."""
        with self._lock:
            self._sets[key] = {str(b["metadata"]["name"]): b for b in items}

    def set_event(self, event_type: str, body: Body) -> None:
        """One the operator created (ADDED) or deleted (DELETED)."""
        key = owner_key(body)
        if key is None:
            return
        name = str((body.get("metadata") or {}).get("name"))
        with self._lock:
            sets = self._sets.setdefault(key, {})
            if event_type == "DELETED":
                sets.pop(name, None)
            else:
                sets[name] = body

    def sets(self, key: Key) -> list[Body]:
        with self._lock:
            return list(self._sets.get(key, {}).values())

    # --- housekeeping ------------------------------------------------------------------------

    def forget(self, key: Key) -> None:
        """Drop the pods and router kept for a deployment that is gone.

        Its deletion mark stays (a few bytes): a late event of the old object must not bring its
        body back, while a new object of the same name, with a newer version, replaces it.
        """
        with self._lock:
            self._pods.pop(key, None)
            self._routers.pop(key, None)
            self._sets.pop(key, None)
