"""kopf handlers: each one only tells the controller which PDDeployment to look at.

There are deliberately no ``on.create``/``on.update``/``on.delete`` handlers and no kopf timers:
those store diff-bases on the object and (timers, deletion handlers) add a finalizer, which
would block ``kubectl delete`` whenever the operator is down. Watching events is enough for a
level-based reconciler; deletion is left to the garbage collector through owner references.

Nodes are watched too (node loss, allocatable GPUs), but only when the operator may list and
watch them: the startup handler asks the API server (a SelfSubjectAccessReview) and registers
:func:`node_event` only then. kopf retries a forbidden watch forever, logging an error at every
attempt; asking first turns a missing grant into one warning, and the reconciler then skips what
needs nodes (:class:`~pdserve.operator.cluster.nodes.NodeCache` answers None).

Usable as ``pdserve operator`` (see :mod:`pdserve.operator.cli`, which passes the options in
the memo) or directly as ``kopf run -m pdserve.operator.control.handlers`` with the defaults.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import kopf

from pdserve.deployment.render.names import DEPLOYMENT_LABEL, ROLE_LABEL
from pdserve.deployment.spec.pddeployment import DEFAULT_IMAGE, GROUP, PLURAL, VERSION
from pdserve.operator.cluster.cache import ClusterCache
from pdserve.operator.cluster.kube import Kube, KubeError
from pdserve.operator.cluster.nodes import NodeCache
from pdserve.operator.control.controller import Controller
from pdserve.operator.control.leader import LeaderElector
from pdserve.operator.reconcile.reconciler import Reconciler

log = logging.getLogger("pdserve.operator")


@dataclass(frozen=True)
class OperatorOptions:
    resync_seconds: float = 30.0
    debounce_seconds: float = 0.05
    workers: int = 64
    kubeconfig: str | None = None
    #: None: no election, this process reconciles from the start (a single replica).
    elector: LeaderElector | None = None
    #: kopf's stop flag (``kopf.run(stop_flag=...)``): set when leadership is lost.
    stop: asyncio.Event | None = None
    #: The image of routers and ``engine: sim`` pods whose spec names none (--pdserve-image).
    pdserve_image: str = DEFAULT_IMAGE
    #: ``--otlp-traces-endpoint``: the reconcile passes as spans (pdserve.operator.reconcile.tracing).
    traces_endpoint: str | None = None


#: After losing the lease the process ends within this many seconds, even if kopf's shutdown hangs.
LOST_EXIT_SECONDS = 10.0


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options: OperatorOptions = memo.get("options") or OperatorOptions()
    configure_settings(settings)
    cache = ClusterCache()
    nodes = NodeCache()
    elector = options.elector
    kube = Kube(options.kubeconfig, fence=elector.refusal if elector else None)
    # Before the controller exists: a retried startup (the API server not answering yet) must
    # not leave a controller and a resync task behind.
    if await asyncio.to_thread(seed_nodes, kube, nodes):
        watch_nodes()
    tracer = None
    if options.traces_endpoint:
        from pdserve.operator.reconcile.tracing import PassTracer  # OpenTelemetry only when asked for

        tracer = memo["tracer"] = PassTracer.start(options.traces_endpoint)
    controller = Controller(
        Reconciler(kube, cache, nodes=nodes, pdserve_image=options.pdserve_image, tracer=tracer),
        cache,
        nodes=nodes,
        debounce=options.debounce_seconds,
        workers=options.workers,
        leading=elector is None,
    )
    memo["controller"] = controller
    memo["resync"] = asyncio.create_task(controller.resync_forever(options.resync_seconds), name="resync")
    if elector is not None:
        loop = asyncio.get_running_loop()

        def started() -> None:
            loop.call_soon_threadsafe(controller.start_leading)

        def lost(reason: str) -> None:
            """client-go's OnStoppedLeading: end the process, Kubernetes restarts it as a follower.

            The fence already refuses every write; kopf stops gracefully, or the timer ends it.
            """
            loop.call_soon_threadsafe(controller.stop_leading)
            if options.stop is not None:
                loop.call_soon_threadsafe(options.stop.set)
            timer = threading.Timer(LOST_EXIT_SECONDS, os._exit, (1,))
            timer.daemon = True
            timer.start()

        # The watches start after the startup handlers: they fill the cache while this replica
        # follows, and whatever they deliver after it starts leading is reconciled as it comes.
        elector.start(on_started=started, on_stopped=lost)


def seed_nodes(kube: Kube, nodes: NodeCache) -> bool:
    """Whether nodes can be watched; if so, one LIST seeds the cache (kopf's watch follows).

    A failure other than "forbidden" raises: kopf retries the startup handler.
    """
    try:
        allowed = kube.allowed("list", "nodes") and kube.allowed("watch", "nodes")
        if allowed:
            items, version = kube.list_nodes()
            nodes.replace(items, version)
            return True
    except KubeError as exc:
        if exc.status != 403:
            raise kopf.TemporaryError(f"cannot read nodes: {exc}", delay=5) from exc
    log.warning(
        "cannot list and watch nodes (RBAC): the per-node GPU fit check is skipped and lost "
        "nodes are only seen through their pods' status; grant list and watch on nodes (see "
        "deploy/rbac) to enable both"
    )
    nodes.unreadable()
    return False


def watch_nodes() -> None:
    """Registers the Node event handler (once): kopf opens the watch after the startup handlers."""
    if not _node_watch:
        kopf.on.event("", "v1", "nodes", id="node_event")(node_event)
        _node_watch.append(True)


def configure_settings(settings: kopf.OperatorSettings) -> None:
    # No kopf bookkeeping in status (our status schema is structural) and no extra CRDs.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="pdserve.io", key="last-handled-configuration"
    )
    settings.persistence.finalizer = "pdserve.io/finalizer"
    settings.peering.standalone = True
    # Only the namespaces and resources given at start; no need to list CRDs or namespaces.
    settings.scanning.disabled = True
    # kopf would post each of its per-handler log lines as an Event on every pod; the reconciler
    # posts the meaningful ones (creates, deletes, drains, errors) on the PDDeployment itself.
    settings.posting.enabled = False
    # Watches end server-side every few minutes and reconnect; a silent stream is dropped sooner.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Only our pods reach the operator at all, filtered by the API server.
    settings.watching.label_selectors["v1", "pods"] = DEPLOYMENT_LABEL
    settings.watching.label_selectors["apps", "deployments"] = DEPLOYMENT_LABEL
    settings.networking.request_timeout = 60


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop writing, let running passes end, then hand the lease over (it is free at once)."""
    options: OperatorOptions = memo.get("options") or OperatorOptions()
    if options.elector is not None:
        options.elector.step_down()
    resync = memo.get("resync")
    if resync is not None:
        resync.cancel()
    controller: Controller | None = memo.get("controller")
    if controller is not None:
        await controller.close()
    tracer = memo.get("tracer")
    if tracer is not None:  # the spans still buffered go out
        await asyncio.to_thread(tracer.shutdown)
    if options.elector is not None:
        await asyncio.get_running_loop().run_in_executor(None, options.elector.release)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    controller: Controller = memo["controller"]
    controller.deployment_event(event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={DEPLOYMENT_LABEL: kopf.PRESENT, ROLE_LABEL: kopf.PRESENT})
async def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """The full pod goes into the cache: the pass it triggers reads nothing from the API."""
    controller: Controller = memo["controller"]
    controller.pod_event(event.get("type"), event["object"])


_node_watch: list[bool] = []  # non-empty once registered (kopf has no "unregister")


async def node_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Registered by :func:`watch_nodes`; every node's events, readiness and allocatable alike."""
    controller: Controller = memo["controller"]
    controller.node_event(event.get("type"), event["object"])


@kopf.on.event("apps", "v1", "deployments", labels={DEPLOYMENT_LABEL: kopf.PRESENT})
async def router_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """The router's availability is part of Ready, and the Deployment controller reports it late."""
    controller: Controller = memo["controller"]
    controller.router_event(event.get("type"), event["object"])
