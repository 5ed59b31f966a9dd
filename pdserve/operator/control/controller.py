"""The asynchronous shell: turns a stream of triggers into coalesced, serialized reconciles.

Why coalesce: a rollout or a node event produces bursts of pod events (scheduled, IP assigned,
Ready) for many pods at once. Each trigger only *requests* a reconcile of its PDDeployment; a
request waits ``debounce`` seconds, and every request arriving meanwhile folds into it. So a
burst costs one reconcile and at most one ConfigMap write, while a lone readiness change still
reaches the routing table within tens of milliseconds. Runs for one PDDeployment never overlap
(a per-key lock), runs for different ones proceed in parallel on a small thread pool (the
Kubernetes client is synchronous).

Every watch event first goes into the :class:`ClusterCache`, so the run it requests can plan
from memory (see :mod:`pdserve.operator.reconcile.reconciler`).

With leader election, a follower keeps its watches and cache warm but runs nothing; the moment
it starts leading it runs a full pass of every PDDeployment it knows (the planner is level-based,
so a rollout continues where the pods' labels and annotations say it stands).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from pdserve.operator import metrics
from pdserve.operator.cluster.cache import ClusterCache
from pdserve.operator.cluster.nodes import NodeCache
from pdserve.operator.reconcile.reconciler import Reconciler
from pdserve.operator.reconcile.steps import Outcome

log = logging.getLogger("pdserve.operator")

Key = tuple[str, str]  # (namespace, name)

MAX_ERROR_BACKOFF = 60.0


class Coalescer:
    """Per-key debounced runs that never overlap; ``run`` returns when to run again (or None)."""

    def __init__(self, run: Callable[[Key], Awaitable[float | None]], debounce: float) -> None:
        self._run = run
        self._debounce = debounce
        self._scheduled: dict[Key, asyncio.Task[None]] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._rechecks: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._running: set[asyncio.Task[None]] = set()

    def request(self, key: Key) -> None:
        if key in self._scheduled:
            metrics.REQUESTS_COALESCED.inc()
            return
        task = asyncio.get_running_loop().create_task(self._after_debounce(key), name=f"reconcile {key}")
        self._scheduled[key] = task
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def request_later(self, key: Key, delay: float) -> None:
        """One pending timer per key, the earliest wins."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        current = self._rechecks.get(key)
        if current is not None:
            if current[0] <= due:
                return
            current[1].cancel()
        self._rechecks[key] = (due, loop.call_at(due, self._recheck, key))

    def forget(self, key: Key) -> None:
        if (recheck := self._rechecks.pop(key, None)) is not None:
            recheck[1].cancel()
        if (task := self._scheduled.pop(key, None)) is not None:
            task.cancel()
        self._locks.pop(key, None)

    async def close(self) -> None:
        for _, handle in self._rechecks.values():
            handle.cancel()
        self._rechecks.clear()
        for task in list(self._running):
            task.cancel()
        for task in list(self._running):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _recheck(self, key: Key) -> None:
        self._rechecks.pop(key, None)
        self.request(key)

    async def _after_debounce(self, key: Key) -> None:
        try:
            await asyncio.sleep(self._debounce)
        finally:
            # From here on, a new request schedules a new run (after this one), so nothing is lost.
            if self._scheduled.get(key) is asyncio.current_task():
                del self._scheduled[key]
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                again = await self._run(key)
            except Exception:
                log.exception("reconcile of %s/%s crashed", *key)
                again = MAX_ERROR_BACKOFF
        if again is not None:
            self.request_later(key, again)


class Controller:
    """Owns the reconciler, the coalescer, the watch-fed caches and the known PDDeployments."""

    def __init__(
        self,
        reconciler: Reconciler,
        cache: ClusterCache,
        *,
        nodes: NodeCache | None = None,
        debounce: float = 0.05,
        workers: int = 64,
        leading: bool = True,
    ) -> None:
        self._reconciler = reconciler
        self._leading = leading
        self._cache = cache
        self._nodes = nodes or NodeCache()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reconcile")
        self._coalescer = Coalescer(self._run, debounce)
        self._known: set[Key] = set()
        self._failures: dict[Key, int] = {}
        # Keys whose next run re-reads everything (spec change, resync, error).
        self._full: set[Key] = set()
        self._generations: dict[Key, int] = {}

    def deployment_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Reconcile when it is new, its spec changed or its deletion began (not on status writes)."""
        key = self._cache.deployment_event(event_type, body)
        if event_type == "DELETED":
            self.deployment_gone(key)
            return
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            self.request(key)  # the pass sees the mark and lets go, creating nothing
            return
        self._known.add(key)
        generation = int(meta.get("generation") or 0)
        if self._generations.get(key) != generation:
            self._generations[key] = generation
            self.request(key, full=True)

    def pod_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = self._cache.pod_event(event_type, body)
        if key is not None:
            self.request(key)

    def node_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A Node event: when the node was lost or came back, its PDDeployments take a look."""
        if not self._nodes.event(event_type, body):
            return
        name = str((body.get("metadata") or {}).get("name") or "")
        affected = self.nodes_changed([name])
        since = self._nodes.not_ready_since(name)
        # A warning only when pods of ours are there: nodes come and go (autoscaling).
        level = logging.WARNING if affected and since is not None else logging.INFO
        if since is None:
            state = "Ready"
        else:
            lost = "deleted" if event_type == "DELETED" else "not Ready"
            state = f"{lost} (lost since {datetime.fromtimestamp(since, UTC).isoformat()})"
        log.log(level, "node %s is %s; PDDeployments with pods there: %d", name, state, len(affected))

    def nodes_changed(self, names: Iterable[str]) -> set[Key]:
        """Reconcile every PDDeployment with an instance pod on one of these nodes; returns them.

        Light passes: the pods did not change, only what the reconciler reads from the node view.
        """
        keys: set[Key] = set()
        for name in names:
            keys |= self._cache.deployments_on_node(name)
        for key in sorted(keys):
            self.request(key)
        return keys

    def router_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Its availability is part of Ready; a deleted router needs a full pass to come back."""
        key = self._cache.router_event(event_type, body)
        if key is not None:
            self.request(key, full=event_type == "DELETED")

    def deployment_gone(self, key: Key) -> None:
        self._known.discard(key)
        self._generations.pop(key, None)
        self._failures.pop(key, None)
        self._full.discard(key)
        self._coalescer.forget(key)
        self._reconciler.deployment_gone(*key)
        self._cache.forget(key)

    def request(self, key: Key, full: bool = False) -> None:
        """``full``: re-read everything instead of trusting the cache (see reconcile.Verified)."""
        if full:
            self._full.add(key)
        if self._leading:  # a follower only keeps its cache warm
            self._coalescer.request(key)

    @property
    def leading(self) -> bool:
        return self._leading

    def start_leading(self) -> None:
        """This replica now holds the lease: a full pass of every known PDDeployment, at once."""
        self._leading = True
        for key in sorted(self._known):
            self.request(key, full=True)

    def stop_leading(self) -> None:
        """Nothing new starts; a pass already running has its writes refused by the fence."""
        self._leading = False

    async def resync_forever(self, interval: float) -> None:
        """Level-based safety net: every known PDDeployment gets a full reconcile this often.

        Spread evenly over the interval, so a resync never competes in one burst with the pod
        events whose readiness must reach the routing table quickly.
        """
        while True:
            keys = sorted(self._known)
            if not keys:
                await asyncio.sleep(interval)
                continue
            for key in keys:
                await asyncio.sleep(interval / len(keys))
                if key in self._known:
                    self.request(key, full=True)

    async def close(self) -> None:
        await self._coalescer.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reconciler.close()

    async def _run(self, key: Key) -> float | None:
        if not self._leading:
            return None
        loop = asyncio.get_running_loop()
        full = key in self._full
        self._full.discard(key)
        outcome: Outcome = await loop.run_in_executor(self._pool, self._reconciler.reconcile, *key, full)
        if outcome.result == "gone":
            if self._cache.deleted(key):
                self.deployment_gone(key)
                return None
            self._full.add(key)  # created again under the same name while the pass ran
            return 0.0
        if outcome.result == "error":
            self._full.add(key)
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            return min(MAX_ERROR_BACKOFF, 0.5 * 2.0**failures)
        self._failures.pop(key, None)
        return outcome.recheck_after
