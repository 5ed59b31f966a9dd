"""kopf handlers: each one only tells the controller which PDDeployment to look at.

There are deliberately no ``on.create``/``on.update``/``on.delete`` handlers and no kopf timers:
those store diff-bases on the object and (timers, deletion handlers) add a finalizer, which
would block ``kubectl delete`` whenever the operator is down. Watching events is enough for a
level-based reconciler; deletion is left to the garbage collector through owner references.

Usable as ``pdserve operator`` (see :mod:`pdserve.operator.cli`, which passes the options in
the memo) or directly as ``kopf run -m pdserve.operator.handlers`` with the defaults.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import kopf

from pdserve.deployment.objects import DEPLOYMENT_LABEL, ROLE_LABEL
from pdserve.deployment.spec import GROUP, PLURAL, VERSION
from pdserve.operator.cache import ClusterCache
from pdserve.operator.controller import Controller
from pdserve.operator.kube import Kube
from pdserve.operator.reconcile import Reconciler


@dataclass(frozen=True)
class OperatorOptions:
    resync_seconds: float = 30.0
    debounce_seconds: float = 0.05
    workers: int = 64
    kubeconfig: str | None = None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options: OperatorOptions = memo.get("options") or OperatorOptions()
    configure_settings(settings)
    cache = ClusterCache()
    controller = Controller(
        Reconciler(Kube(options.kubeconfig), cache),
        cache,
        debounce=options.debounce_seconds,
        workers=options.workers,
    )
    memo["controller"] = controller
    memo["resync"] = asyncio.create_task(controller.resync_forever(options.resync_seconds), name="resync")


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
    resync = memo.get("resync")
    if resync is not None:
        resync.cancel()
    controller: Controller | None = memo.get("controller")
    if controller is not None:
        await controller.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    controller: Controller = memo["controller"]
    controller.deployment_event(event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={DEPLOYMENT_LABEL: kopf.PRESENT, ROLE_LABEL: kopf.PRESENT})
async def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """The full pod goes into the cache: the pass it triggers reads nothing from the API."""
    controller: Controller = memo["controller"]
    controller.pod_event(event.get("type"), event["object"])


@kopf.on.event("apps", "v1", "deployments", labels={DEPLOYMENT_LABEL: kopf.PRESENT})
async def router_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """The router's availability is part of Ready, and the Deployment controller reports it late."""
    controller: Controller = memo["controller"]
    controller.router_event(event.get("type"), event["object"])
