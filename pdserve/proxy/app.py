"""The composition root: the router's parts, built from its settings and wired together.

Generation requests go to the plain-ASGI app of pdserve.proxy.serving.generation (the hot path)
and through the dispatcher (pdserve.proxy.flow); everything else to the admin app
(pdserve.proxy.admin). What runs in the background (the engine client's session, the table
source's watch) starts and stops with the admin app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quart import Quart

from pdserve.proxy.admin.kv_capacity import watch_kv_capacity
from pdserve.proxy.admin.routes import admin_app
from pdserve.proxy.admin.views import RouterState, local_views
from pdserve.proxy.engine.upstream import Upstream
from pdserve.proxy.flow.admission import ADMISSION_POLL_S, AdmissionGate
from pdserve.proxy.flow.dispatcher import Dispatcher, Slots
from pdserve.proxy.flow.legs import Engines
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import ByRole, Policy, PrefixAffinity, make_policies
from pdserve.proxy.serving.generation import GenerationApp
from pdserve.proxy.serving.server import Lifecycle
from pdserve.proxy.serving.worker_views import Views, WorkerInfo, serve_views
from pdserve.proxy.settings import ProxySettings, TableSettings
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.table.file import RoutingWatcher
from pdserve.proxy.table.served import ServedTable, SlotBuilder
from pdserve.routing import build_slot_table
from pdserve.routing.sidecar import LocalDecode, build_sidecar_slot_table

if TYPE_CHECKING:
    from pdserve.proxy.flow.spans import RequestTracer


def create_app(
    settings: ProxySettings,
    lifecycle: Lifecycle | None = None,
    worker: WorkerInfo | None = None,
) -> GenerationApp:
    """The router's ASGI app. ``worker``: this process as one of several worker processes
    (pdserve.proxy.serving.workers); None when it serves alone."""
    lifecycle = lifecycle or Lifecycle()
    shared = worker.shared if worker is not None else None
    metrics = ProxyMetrics(primary=worker is None or worker.index == 0)
    book = SlotBook(
        settings.retries.eject_seconds,
        shared=shared.ejections if shared is not None else None,
        shared_in_flight=shared.in_flight if shared is not None else None,
        shared_unreachable=shared.unreachable if shared is not None else None,
    )
    served = ServedTable(metrics, settings.table.source, build=slot_builder(settings.sidecar.local))
    upstream = Upstream(settings.deadlines.connect)
    policy = make_policies(
        settings.policy,
        settings.prefill_policy,
        shared.counters if shared is not None else None,
        settings.prefix,
        shared.prefix_log if shared is not None else None,
        metrics.enable_prefix() if settings.prefill_policy == PrefixAffinity.name else None,
    )
    served.listeners.append(lambda state: policy.table_changed(state.slots))  # the index follows
    admission = AdmissionGate(
        settings.admission.max_per_slot,  # router-wide: with workers the legs in flight are shared
        settings.admission.queue,
        settings.admission.timeout,
        metrics,
        # Room freed by another worker's leg wakes nobody here: look again this often.
        poll_seconds=ADMISSION_POLL_S if shared is not None else None,
    )
    dispatcher = Dispatcher(
        Slots(served, policy, book),
        Engines(upstream, settings.deadlines, settings.requests.backend_api_key),
        settings.retries,
        admission,
        metrics,
        shared,
    )

    def stopping() -> bool:
        return lifecycle.stopping or (shared is not None and shared.stopping())

    router = RouterState(served, book, dispatcher, settings.policy, policy.describe)
    admin = admin_app(settings, router, upstream, metrics, stopping, worker)
    source = table_source(settings.table, served, metrics)
    also = kv_capacity_watch(settings, policy, served, upstream)
    tracer = request_tracer(settings)
    run_in_background(admin, upstream, source, local_views(router, worker), worker, also, tracer)
    return GenerationApp(dispatcher, admin, settings.requests, settings.listen.admin_port, tracer)


def request_tracer(settings: ProxySettings) -> RequestTracer | None:
    """The spans' source when the router traces; without an endpoint OpenTelemetry is not loaded.
    Made in each process (a worker after its fork: the exporter's thread does not survive one)."""
    if settings.tracing.endpoint is None:
        return None
    from pdserve.proxy.flow.spans import RequestTracer

    return RequestTracer.start(settings.tracing, settings.policy, settings.prefill_policy)


def slot_builder(local: LocalDecode | None) -> SlotBuilder:
    """The slots of a table: every routable slot, or in a decode sidecar the local engine's."""
    if local is None:
        return build_slot_table
    return functools.partial(build_sidecar_slot_table, local=local)


def kv_capacity_watch(
    settings: ProxySettings, policy: Policy, served: ServedTable, upstream: Upstream
) -> list[Callable[[], Coroutine[Any, Any, None]]]:
    """With prefix-affinity and no index size given: size each slot's index from its engine."""
    prefix = policy.prefill if isinstance(policy, ByRole) else policy
    if not isinstance(prefix, PrefixAffinity) or settings.prefix.index_chunks:
        return []
    key = settings.requests.backend_api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return [lambda: watch_kv_capacity(served, prefix, lambda: upstream.session, headers)]


@dataclass(frozen=True)
class TableSource:
    """``run`` keeps the served table current; ``load_now`` (the file) reads once before serving."""

    run: Callable[[], Coroutine[Any, Any, None]]
    load_now: Callable[[], object] | None = None


def table_source(table: TableSettings, served: ServedTable, metrics: ProxyMetrics) -> TableSource:
    if table.routing_configmap is not None:
        from pdserve.proxy.table.configmap import ConfigMapWatch  # only the ConfigMap source needs it

        assert table.kube is not None
        return TableSource(ConfigMapWatch(table.routing_configmap, table.kube, served, metrics).run)
    assert table.routing_file is not None
    watcher = RoutingWatcher(table.routing_file, served, table.reload_interval)
    return TableSource(watcher.run, lambda: watcher.poll(confirm_errors=False))


def run_in_background(
    app: Quart,
    upstream: Upstream,
    source: TableSource,
    views: Views,
    worker: WorkerInfo | None,
    also: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    tracer: RequestTracer | None = None,
) -> None:
    """For as long as ``app`` serves: the engine client's session, the table's watch, ``also``
    (the engines' KV capacity, for prefix-affinity) and, with several workers, this worker's views
    for the others (pdserve.proxy.serving.worker_views); at the end the spans still buffered are
    exported."""
    tasks: list[asyncio.Task[None]] = []
    views_server: list[asyncio.AbstractServer] = []

    @app.before_serving
    async def start() -> None:
        await upstream.start()
        if source.load_now is not None:
            source.load_now()
        tasks.append(asyncio.create_task(source.run()))
        tasks.extend(asyncio.create_task(run()) for run in also)
        if worker is not None and worker.count > 1:
            views_server.append(await serve_views(worker, views))

    @app.after_serving
    async def stop() -> None:
        for server in views_server:
            server.close()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await upstream.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)
