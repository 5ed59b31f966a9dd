"""The admin app: every endpoint but generation, in Quart, where speed does not matter.

Probes (``/health``, ``/ready``), metrics, what the router serves (``/routing/served``), the
routing debug view, model listing and the profiler broadcast. Every answer carries the
request's ``X-Request-Id`` and every error is OpenAI-style JSON with pdserve's reason in
``X-PDServe-Error``. Which of these the client port refuses is pdserve.proxy.serving.ports's.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from pdserve.proxy.admin.engines import admin_headers, broadcast, model_list
from pdserve.proxy.admin.readiness import readiness
from pdserve.proxy.admin.views import DEFAULT_LOAD_WINDOW_S, RouterState, local_views, router_view
from pdserve.proxy.engine.upstream import Upstream
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.serving.generation import client_key_problem, request_id_of
from pdserve.proxy.serving.worker_views import WorkerInfo, WorkerViewsError
from pdserve.proxy.settings import ProxySettings
from pdserve.wire.headers import AUTHORIZATION, ERROR_REASON, REQUEST_ID
from pdserve.wire.load import HISTORY_SECONDS
from pdserve.wire.openai import RequestError, error_body

log = logging.getLogger("pdserve.proxy")

View = Callable[[], Awaitable[Response]]

# Probes, scraping and the served-table report stay open when --api-key is set (kubelet,
# Prometheus and the operator carry no key); none of them shows a secret.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/routing/served", "/load"})

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


def admin_app(
    settings: ProxySettings,
    router: RouterState,
    upstream: Upstream,
    metrics: ProxyMetrics,
    stopping: Callable[[], bool],
    worker: WorkerInfo | None = None,
) -> Quart:
    """``stopping``: SIGTERM has come (/ready turns 503); ``worker``: this process as one of
    several workers (its views are served to the others by pdserve.proxy.app)."""
    app = Quart("pdserve.proxy")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.requests.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # streams last minutes; the stream-idle deadline guards them
        BODY_TIMEOUT=60,
    )
    views = local_views(router, worker)

    @app.before_request
    async def identify_and_authorize() -> Response | None:
        g.request_id = request_id_of(request.headers.get(REQUEST_ID))
        if request.path not in OPEN_PATHS:
            problem = client_key_problem(settings.requests.api_key, request.headers.get(AUTHORIZATION))
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
            413: f"request body is larger than {settings.requests.max_body_bytes} bytes",
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
        payload, status = await readiness(router.served, settings.sidecar.local, upstream.session, stopping)
        return json_response(payload, status)

    def whole_router(name: str) -> View:
        async def view() -> Response:
            try:
                return json_response(await router_view(name, views, worker))
            except WorkerViewsError as exc:
                return openai_error(503, f"cannot answer for the whole router: {exc}", "fan_in_failed")

        return view

    app.add_url_rule("/routing/served", "routing_served", whole_router("served"), methods=["GET"])
    app.add_url_rule("/debug/routing", "debug_routing", whole_router("debug"), methods=["GET"])

    @app.get("/load")
    async def load() -> Response:
        """Latency histograms and outcomes of the last ``window`` seconds, legs in flight and
        queued now (pdserve.wire.load): the autoscaler's signal."""
        raw = request.args.get("window", str(DEFAULT_LOAD_WINDOW_S))
        try:
            window = float(raw)
        except ValueError:
            window = -1.0
        if not 1 <= window <= HISTORY_SECONDS:
            message = f"window must be a number of seconds from 1 to {HISTORY_SECONDS}, got {raw!r}"
            return openai_error(400, message, "invalid_request")
        try:
            return json_response(await router_view("load", views, worker, f"{window:g}"))
        except WorkerViewsError as exc:
            return openai_error(503, f"cannot answer for the whole router: {exc}", "fan_in_failed")

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    def engine_headers() -> dict[str, str]:
        return admin_headers(settings.requests.backend_api_key, request.headers.get(AUTHORIZATION))

    @app.get("/v1/models")
    async def models() -> Response:
        state = router.served.current
        found = await model_list(upstream.session, state.slots.decode if state else (), engine_headers())
        if found is None:
            return openai_error(503, "no ready decode instance answered /v1/models", "no_decode_slot")
        body, content_type = found
        return Response(body, content_type=content_type)

    def profile(path: str) -> View:
        async def view() -> Response:
            state = router.served.current
            table = state.slots.table if state else None
            results, ok = await broadcast(upstream.session, table, path, engine_headers())
            return json_response({"instances": results}, 200 if ok else 502)

        return view

    for path in ("/start_profile", "/stop_profile"):  # to every engine's API server
        app.add_url_rule(path, path.strip("/"), profile(path), methods=["POST"])

    return app
