"""The proxy's HTTP surface (app factory).

Generation requests are served by :class:`pdserve.proxy.serving.generation.GenerationApp` (plain ASGI,
the hot path) through :class:`pdserve.proxy.flow.dispatcher.Dispatcher`; everything else is a small Quart
app: probes, metrics, what the router serves (/routing/served), the routing debug view, model
listing and profiler fan-out.
Every answer carries the request's ``X-Request-Id`` and every error is OpenAI-style JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from pdserve.proxy.admin.merge import merge_debug, merge_served
from pdserve.proxy.admin.readiness import local_engine_problem, sidecar_not_ready_reason
from pdserve.proxy.engine.upstream import Upstream
from pdserve.proxy.flow.admission import ADMISSION_POLL_S, AdmissionGate
from pdserve.proxy.flow.dispatcher import Dispatcher
from pdserve.proxy.flow.trace import Deadlines
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import make_policy
from pdserve.proxy.serving.generation import GenerationApp, client_key_problem, request_id_of
from pdserve.proxy.serving.server import Lifecycle
from pdserve.proxy.serving.worker_views import Views, WorkerViewsError, gather_views, serve_views
from pdserve.proxy.settings import ProxySettings
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.state.shared import SharedState
from pdserve.proxy.table.file import RoutingWatcher
from pdserve.proxy.table.served import ServedTable, SlotBuilder, endpoint_fields, served_view
from pdserve.routing import Instance, Role, build_slot_table
from pdserve.routing.sidecar import build_sidecar_slot_table
from pdserve.wire.headers import AUTHORIZATION, ERROR_REASON, REQUEST_ID
from pdserve.wire.openai import RequestError, error_body

log = logging.getLogger("pdserve.proxy")

# Probes, scraping and the served-table report stay open when --api-key is set (kubelet,
# Prometheus and the operator carry no key); none of them shows a secret.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/routing/served"})
ADMIN_TIMEOUT_S = 10.0

_HTTP_REASONS = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload), status=status, content_type="application/json")


def openai_error(status: int, message: str, reason: str) -> Response:
    """The router's own error: vLLM's body, pdserve's reason in the X-PDServe-Error header."""
    response = json_response(error_body(status, message), status)
    response.headers[ERROR_REASON] = reason
    return response


def refusal_response(exc: RequestError) -> Response:
    response = json_response(exc.body(), exc.status)
    response.headers[ERROR_REASON] = exc.reason
    return response


@dataclass(frozen=True)
class TableSource:
    """``run`` keeps the served table current; ``load_now`` (the file) reads once before serving."""

    run: Callable[[], Coroutine[Any, Any, None]]
    load_now: Callable[[], object] | None = None


def table_source(settings: ProxySettings, served: ServedTable, metrics: ProxyMetrics) -> TableSource:
    if settings.routing_configmap is not None:
        from pdserve.proxy.table.configmap import ConfigMapWatch  # only the ConfigMap source needs it

        assert settings.kube is not None
        return TableSource(ConfigMapWatch(settings.routing_configmap, settings.kube, served, metrics).run)
    assert settings.routing_file is not None
    watcher = RoutingWatcher(settings.routing_file, served, settings.reload_interval)
    return TableSource(watcher.run, lambda: watcher.poll(confirm_errors=False))


def create_app(
    settings: ProxySettings, lifecycle: Lifecycle | None = None, shared: SharedState | None = None
) -> GenerationApp:
    """``shared``: the state worker processes share (pdserve.proxy.serving.workers); None in one process."""
    """The proxy's ASGI app: the generation endpoints, with a Quart app for everything else."""
    lifecycle = lifecycle or Lifecycle()
    app = Quart("pdserve.proxy")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # streams last minutes; the stream-idle deadline guards them
        BODY_TIMEOUT=60,
    )
    metrics = ProxyMetrics(primary=settings.worker is None or settings.worker.index == 0)
    book = SlotBook(
        settings.eject_seconds,
        shared=shared.ejections if shared is not None else None,
        shared_in_flight=shared.in_flight if shared is not None else None,
        shared_unreachable=shared.unreachable if shared is not None else None,
    )
    local = settings.local_decode
    build: SlotBuilder = build_slot_table
    if local is not None:
        build = functools.partial(build_sidecar_slot_table, local=local)
    served = ServedTable(metrics, settings.source, build=build)
    source = table_source(settings, served, metrics)
    upstream = Upstream(settings.connect_timeout)
    deadlines = Deadlines(
        settings.prefill_ttfb_timeout, settings.decode_ttfb_timeout, settings.stream_idle_timeout
    )
    dispatcher = Dispatcher(
        served,
        make_policy(settings.policy, shared.counters if shared is not None else None),
        book,
        upstream,
        metrics,
        deadlines,
        settings.max_retries,
        settings.backend_api_key,
        settings.kv_lease_seconds,
        settings.max_fan_out,
        AdmissionGate(
            settings.max_per_slot,  # router-wide: with workers the legs in flight are shared
            settings.admission_queue,
            settings.admission_timeout,
            metrics,
            # Room freed by another worker's leg wakes nobody here: look again this often.
            poll_seconds=ADMISSION_POLL_S if shared is not None else None,
        ),
        shared,
    )
    tasks: list[asyncio.Task[None]] = []

    views_server: list[asyncio.AbstractServer] = []

    @app.before_serving
    async def start() -> None:
        await upstream.start()
        if source.load_now is not None:
            source.load_now()
        tasks.append(asyncio.create_task(source.run()))
        if worker is not None and worker.count > 1:
            views_server.append(await serve_views(worker, local_views))

    @app.after_serving
    async def stop() -> None:
        for server in views_server:
            server.close()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await upstream.close()

    @app.before_request
    async def identify_and_authorize() -> Response | None:
        g.request_id = request_id_of(request.headers.get(REQUEST_ID))
        if request.path not in OPEN_PATHS:
            problem = client_key_problem(settings.api_key, request.headers.get(AUTHORIZATION))
            if problem is not None:
                return refusal_response(problem)
        return None

    @app.after_request
    async def tag(response: Response) -> Response:
        response.headers[REQUEST_ID] = g.get("request_id") or uuid.uuid4().hex
        return response

    @app.errorhandler(RequestError)
    async def refused(exc: RequestError) -> Response:
        return refusal_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {
            404: f"no such endpoint: {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: f"request body is larger than {settings.max_body_bytes} bytes",
        }.get(status, exc.description or exc.name)
        return openai_error(status, message, _HTTP_REASONS.get(status, f"http_{status}"))

    @app.errorhandler(Exception)
    async def crashed(exc: Exception) -> Response:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return openai_error(500, "internal proxy error", "internal_error")

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        state = served.current
        if local is None:
            reason = served.not_ready_reason()
        else:  # decode sidecar: its own engine, and a prefill of its revision (sidecar.py)
            reason = sidecar_not_ready_reason(served, local)
            if reason is None:
                reason = await local_engine_problem(upstream.session, local)
        if lifecycle.stopping or (shared is not None and shared.stopping()):
            reason = "shutting down (SIGTERM): finishing in-flight requests, taking no new ones"
        payload: dict[str, Any] = {
            "ready": reason is None,
            "generation": state.generation if state else None,
            "prefill_slots": len(state.slots.prefill) if state else 0,
            "decode_slots": len(state.slots.decode) if state else 0,
        }
        if local is not None:
            payload["local_decode"] = local.url
        if reason is not None:
            payload["reason"] = reason
        return json_response(payload, 200 if reason is None else 503)

    worker = settings.worker

    def debug_view() -> dict[str, Any]:
        state = served.current
        out: dict[str, Any] = {
            "source": served.source,
            "policy": settings.policy,
            "last_reload_error": served.rejected,
            "source_problem": served.problem,
            "generation": state.generation if state else None,
            "table": state.slots.table.to_dict() if state else None,
            "revisions": state.slots.revisions() if state else {},
            "unpaired": [u.describe() for u in state.slots.unpaired] if state else [],
            "unreachable": dispatcher.unreachable.snapshot(),
            # Client requests answered, by outcome: a request retried on another slot counts once
            # here and once per slot tried below.
            "requests": metrics.request_outcomes(),
            "slots": {},
        }
        for role in Role:
            rows = []
            for slot in state.slots.slots(role) if state else ():
                s = book.state(role, slot.key)
                rows.append(
                    {
                        "slot": slot.key,
                        "url": slot.url,
                        "revision": slot.revision,
                        "dp_rank": slot.dp_rank,
                        "rank_header": slot.rank_header,
                        **endpoint_fields(slot),
                        "requests": s.requests,
                        "in_flight": s.in_flight,
                        "pinned": s.pinned,
                        "errors": s.errors,
                        "ejections": s.ejections,
                        "ejected_for_seconds": round(book.ejected_for(role, slot.key), 3),
                    }
                )
            out["slots"][role.value] = rows
        return out

    local_views: Views = {
        "served": lambda: {
            **served_view(served, book),
            "worker": worker.index if worker else 0,
            "requests": dispatcher.served_requests,
        },
        "debug": lambda: {
            **debug_view(),
            "worker": worker.index if worker else 0,
            "loaded_at": served.loaded_at,
        },
    }

    async def router_view(name: str, merge: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> Response:
        """This worker's view, or with several workers every worker's, merged (fanin.py)."""
        if worker is None or worker.count == 1:
            view = local_views[name]()
            view.pop("worker", None)
            view.pop("requests", None)
            if name == "debug":
                view.pop("loaded_at", None)
            return json_response(view)
        try:
            return json_response(merge(await gather_views(worker, name, local_views[name])))
        except WorkerViewsError as exc:
            return openai_error(503, f"cannot answer for the whole router: {exc}", "fan_in_failed")

    @app.get("/routing/served")
    async def routing_served() -> Response:
        return await router_view("served", merge_served)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/debug/routing")
    async def debug_routing() -> Response:
        return await router_view("debug", merge_debug)

    @app.get("/v1/models")
    async def models() -> Response:
        state = served.current
        instances = _unique(state.slots.decode) if state else []
        for inst in instances:
            try:
                async with asyncio.timeout(ADMIN_TIMEOUT_S):
                    async with upstream.session.get(
                        inst.url + "/v1/models", headers=_admin_headers()
                    ) as resp:
                        body = await resp.read()
                        if resp.status == 200:
                            return Response(body, content_type=resp.content_type or "application/json")
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("GET /v1/models from %s failed: %s", inst.name, exc)
        return openai_error(503, "no ready decode instance answered /v1/models", "no_decode_slot")

    def _admin_headers() -> dict[str, str]:
        if settings.backend_api_key:
            return {AUTHORIZATION: f"Bearer {settings.backend_api_key}"}
        auth = request.headers.get(AUTHORIZATION)
        return {AUTHORIZATION: auth} if auth else {}

    async def fan_out(path: str) -> Response:
        state = served.current
        instances = [*state.slots.table.prefill, *state.slots.table.decode] if state else []
        headers = _admin_headers()

        async def one(name: str, url: str) -> tuple[str, dict[str, Any]]:
            try:
                async with asyncio.timeout(ADMIN_TIMEOUT_S):
                    async with upstream.session.post(url + path, headers=headers) as resp:
                        await resp.read()
                        return name, {"status": resp.status}
            except (TimeoutError, aiohttp.ClientError) as exc:
                return name, {"error": str(exc) or type(exc).__name__}

        # every API server: one per instance, one per node of a multi-node instance (name/node)
        targets = [
            (inst.name if len(inst.api_urls()) == 1 else f"{inst.name}/node{n}", url)
            for inst in instances
            for n, url in enumerate(inst.api_urls())
        ]
        results = dict(await asyncio.gather(*(one(name, url) for name, url in targets)))
        ok = bool(results) and all(r.get("status") == 200 for r in results.values())
        return json_response({"instances": results}, 200 if ok else 502)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await fan_out("/start_profile")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await fan_out("/stop_profile")

    return GenerationApp(dispatcher, app, settings.api_key, settings.max_body_bytes, settings.admin_port)


def _unique(slots: Any) -> list[Instance]:
    seen: dict[str, Instance] = {}
    for slot in slots:
        seen.setdefault(slot.instance.name, slot.instance)
    return list(seen.values())
