"""The ConfigMap source: list, then watch, the router's one routing ConfigMap through the API server.

Why not the mounted file: the kubelet refreshes a ConfigMap volume only on its sync period
(often 60-90 s), so a pod that failed readiness would keep getting requests for a minute and a
drain would delete pods the routers still use. A watch delivers each write in well under a
second. Why not the Kubernetes client: the router must start fast and stay small, and one
object needs one list and one watch, which aiohttp does in a page.

The protocol, as client-go's reflector speaks it, for one object:

* ``GET .../configmaps?fieldSelector=metadata.name=NAME`` (a list, so a missing ConfigMap is an
  empty list rather than an error; RBAC treats the name selector as the resource name, so a Role
  with ``resourceNames: [NAME]`` suffices), giving the object and a ``resourceVersion``;
* ``...&watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=T``, newline-
  delimited events; BOOKMARKs only move the resourceVersion on; the server ends the watch
  after T and we watch again from the last resourceVersion;
* 410 Gone (the resourceVersion is too old) or an ERROR event: list again; an HTTP error:
  exponential backoff with jitter, then list again; a connection failure: backoff, then watch
  again from the last resourceVersion (a 410 then sends us back to the list).

Each version's ``data["routing.json"]`` goes to :meth:`ServedTable.offer`, exactly like the
file source. While the API server cannot be read, and after the ConfigMap is deleted, the last
good table keeps serving and ``problem`` says why it may be stale. Event handling and the
messages for 401/403/404 are pure functions, tested without a server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp

from pdserve.proxy.engine import codec
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.table.kubeconfig import ApiCredentials, ConfigMapRef, CredentialsError, TokenSource
from pdserve.proxy.table.served import ServedTable
from pdserve.routing import CONFIGMAP_KEY

log = logging.getLogger("pdserve.proxy.kubewatch")

WATCH_TIMEOUT_S = 300.0  # asked of the server, with jitter, like client-go's 5-10 min
IDLE_READ_S = 90.0  # the API server sends a BOOKMARK about every minute: silence longer is a dead link
REQUEST_TIMEOUT_S = 30.0
MAX_EVENT_BYTES = 16 * 2**20  # a ConfigMap is at most 1 MiB; its JSON event a few times that


# --- pure: backoff, lines, events, messages -----------------------------------------------------


class Backoff:
    """Exponential backoff with jitter: base·2^n capped, each delay drawn in [d/2, d]."""

    def __init__(
        self, base: float = 0.5, cap: float = 10.0, rng: Callable[[], float] = random.random
    ) -> None:
        self.base = base
        self.cap = cap
        self._rng = rng
        self._attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * float(2**self._attempt))
        self._attempt = min(self._attempt + 1, 32)
        return delay * (0.5 + 0.5 * self._rng())

    def reset(self) -> None:
        self._attempt = 0


class LineBuffer:
    """Splits a watch stream into its JSON lines, whatever the chunking (aiohttp's readline caps lines
    at 128 KiB, less than a large table's event)."""

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._limit = limit
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        if b"\n" not in data:
            if len(self._pending) > self._limit:
                raise WatchProblem("bad_event", f"a watch event is larger than {self._limit} bytes")
            return []
        *lines, rest = bytes(self._pending).split(b"\n")
        self._pending = bytearray(rest)
        return [line for line in lines if line.strip()]


class WatchProblem(Exception):
    """A list/watch failure; ``reason`` is the metric label, the message what a user should read."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class WatchGone(Exception):
    """410 Gone: the resourceVersion is no longer available; list again."""


@dataclass(frozen=True)
class Step:
    """What one watch event asks for: ``offer`` (a version of the ConfigMap, ``text`` its
    routing.json or None when the key is missing), ``deleted``, ``bookmark``, ``gone`` or ``error``."""

    action: str
    resource_version: str | None
    text: str | None = None
    detail: str = ""
    reason: str = ""  # the error's metric label


def configmap_table(obj: Mapping[str, Any]) -> tuple[str | None, str]:
    """(routing.json text or None, a reason when None) of a ConfigMap object."""
    data = obj.get("data")
    if not isinstance(data, Mapping) or not isinstance(data.get(CONFIGMAP_KEY), str):
        keys = sorted(data) if isinstance(data, Mapping) else []
        shown = ", ".join(keys) if keys else "none"
        return None, f"the ConfigMap has no key {CONFIGMAP_KEY} (keys: {shown})"
    return data[CONFIGMAP_KEY], ""


def resource_version_of(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) and rv else None


def list_step(body: object) -> tuple[str, Mapping[str, Any] | None]:
    """(the list's resourceVersion, the one ConfigMap or None) of a fieldSelector list answer."""
    if not isinstance(body, Mapping) or body.get("kind") != "ConfigMapList":
        raise WatchProblem("bad_event", f"expected a ConfigMapList, got {_kind(body)}")
    rv = resource_version_of(body)
    if rv is None:
        raise WatchProblem("bad_event", "the ConfigMapList has no metadata.resourceVersion")
    items = body.get("items") or []
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise WatchProblem("bad_event", "the ConfigMapList's items are not objects")
    return rv, (items[0] if items else None)


def event_step(event: object) -> Step:
    """Pure: what the watch does with one decoded event."""
    if not isinstance(event, Mapping) or not isinstance(event.get("object"), Mapping):
        return Step("error", None, detail=f"malformed watch event ({_kind(event)})", reason="bad_event")
    kind, obj = event.get("type"), event["object"]
    if kind == "ERROR":
        code = obj.get("code")
        message = obj.get("message") or obj.get("reason") or "no message"
        if code == 410:
            return Step("gone", None, detail=str(message))
        return Step(
            "error", None, detail=f"the API server ended the watch: {code} {message}", reason="http_error"
        )
    rv = resource_version_of(obj)
    if kind == "BOOKMARK":
        return Step("bookmark", rv)
    if kind == "DELETED":
        return Step("deleted", rv)
    if kind in ("ADDED", "MODIFIED"):
        text, why = configmap_table(obj)
        return Step("offer", rv, text=text, detail=why)
    return Step("error", rv, detail=f"unknown watch event type {kind!r}", reason="bad_event")


_USER = re.compile(r'User "([^"]+)"')


def http_failure(
    ref: ConfigMapRef, verb: str, status: int, body: bytes, server: str, subject: str | None
) -> WatchProblem:
    """The problem for an HTTP error answer, naming what is missing and what to do about it."""
    api_message = _status_message(body)
    head = f"cannot {verb} ConfigMap {ref}"
    if status == 401:
        who = f" (token of {subject})" if subject else ""
        return WatchProblem(
            "unauthorized",
            f"{head}: unauthorized: the API server at {server} does not accept the router's credentials"
            f"{who}; is the token expired or revoked, or meant for another cluster?",
        )
    if status == 403:
        found = _USER.search(api_message)
        user = found.group(1) if found else subject
        who = (
            f"the router's service account {user}"
            if user and user.startswith("system:serviceaccount:")
            else f"the router's user {user}"
            if user
            else "the router's credentials"
        )
        role = (
            f"Role {ref.name.removesuffix('-routing')}-router" if ref.name.endswith("-routing") else "a Role"
        )
        return WatchProblem(
            "forbidden",
            f'{head}: forbidden: {who} cannot {verb} configmaps "{ref.name}" in namespace {ref.namespace}; '
            f"grant get, list and watch on it ({role} with resourceNames [{ref.name}] and a RoleBinding "
            f"to that account)",
        )
    if status == 404:
        return WatchProblem(
            "not_found",
            f"{head}: not found: {api_message or 'the API server has no such resource'} "
            f"(check the namespace {ref.namespace} and the name {ref.name})",
        )
    return WatchProblem(
        "http_error", f"{head}: the API server at {server} answered {status}: {api_message or '-'}"
    )


def _status_message(body: bytes) -> str:
    try:
        doc = codec.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:200].decode(errors="replace").strip()
    if isinstance(doc, Mapping) and isinstance(doc.get("message"), str):
        return str(doc["message"])
    return ""


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return f"kind {value.get('kind')!r}" if "kind" in value else "an object without a kind"
    return type(value).__name__


# --- the watch loop (I/O) -----------------------------------------------------------------------


class ConfigMapWatch:
    """Keeps :class:`ServedTable` on the newest valid version of one ConfigMap."""

    def __init__(
        self,
        ref: ConfigMapRef,
        creds: ApiCredentials,
        served: ServedTable,
        metrics: ProxyMetrics,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        idle_read_s: float = IDLE_READ_S,
        backoff: Backoff | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.ref = ref
        self.creds = creds
        self.served = served
        self.metrics = metrics
        self.watch_timeout_s = watch_timeout_s
        self.idle_read_s = idle_read_s
        self.backoff = backoff or Backoff(rng=rng)
        self.tokens = TokenSource(creds)
        self._rng = rng
        self._session: aiohttp.ClientSession | None = None
        self._missing: str | None = None  # the ConfigMap is absent (never made, or deleted)
        self._failure: str | None = None  # the API server cannot be read

    @property
    def base_url(self) -> str:
        return f"{self.creds.server}/api/v1/namespaces/{self.ref.namespace}/configmaps"

    async def run(self) -> None:
        try:
            await self._loop()
        finally:
            if self._session is not None:
                await self._session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:  # here, so a CA file that went missing is reported and retried
            connector = aiohttp.TCPConnector(ssl=self.creds.ssl_context() or True, limit=2)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _loop(self) -> None:
        rv: str | None = None
        last_restart = ""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                self._ensure_session()
                if rv is None:
                    rv = await self._list()
                rv = await self._watch(rv)
                restart = "expired"
                if loop.time() - started < 1.0:  # a server that ends every watch at once: do not spin
                    await asyncio.sleep(self.backoff.next())
            except WatchGone as gone:
                log.info("watch of ConfigMap %s: resourceVersion too old (%s); listing again", self.ref, gone)
                rv, restart = None, "gone"
                if last_restart == "gone":  # twice in a row: do not spin
                    await asyncio.sleep(self.backoff.next())
            except CredentialsError as exc:  # e.g. the token file vanished
                self.metrics.watch_errors.labels("unauthorized").inc()
                rv, restart = None, "error"
                await self._fail(f"cannot read ConfigMap {self.ref}: {exc}")
            except WatchProblem as problem:
                self.metrics.watch_errors.labels(problem.reason).inc()
                if problem.reason == "unauthorized":
                    self.tokens.token(force=True)  # a rotated token may already be on disk
                rv, restart = None, "error"
                await self._fail(str(problem))
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # Like client-go's reflector: a connection failure resumes the watch from rv once
                # the server answers again (a 410 then forces the relist), an HTTP error relists.
                self.metrics.watch_errors.labels("unreachable").inc()
                restart = "error"
                server, detail = self.creds.server, str(exc) or type(exc).__name__
                await self._fail(
                    f"cannot reach the API server at {server} to read ConfigMap {self.ref}: {detail}"
                )
            except _StreamClosed as closed:
                restart = closed.reason  # the watch connection ended early; resume from rv
                await asyncio.sleep(min(1.0, self.backoff.next()))
            except Exception as exc:  # the watch must outlive any surprise; the last good table stays
                log.exception("watch of ConfigMap %s failed unexpectedly; retrying", self.ref)
                self.metrics.watch_errors.labels("internal").inc()
                rv, restart = None, "error"
                await self._fail(f"watch of ConfigMap {self.ref} failed: {exc!r}")
            self.metrics.watch_restarts.labels(restart).inc()
            last_restart = restart

    async def _fail(self, message: str) -> None:
        delay = self.backoff.next()
        kept = self.served.generation
        keeping = f"keeping generation {kept}" if kept is not None else "no table served yet"
        self._failure = f"{message} ({keeping}; retrying in {delay:.1f} s)"
        self._publish()
        await asyncio.sleep(delay)

    def _ok(self) -> None:
        self.backoff.reset()
        if self._failure is not None:
            self._failure = None
            self._publish()

    def _publish(self) -> None:
        self.served.set_problem(self._failure or self._missing)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "pdserve-proxy"}
        token = self.tokens.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _request_kwargs(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"headers": self._headers()}
        if self.creds.tls_server_name:
            extra["server_hostname"] = self.creds.tls_server_name
        return extra

    async def _list(self) -> str:
        session = self._ensure_session()
        query = urlencode({"fieldSelector": f"metadata.name={self.ref.name}"})
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with session.get(f"{self.base_url}?{query}", timeout=timeout, **self._request_kwargs()) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise http_failure(
                    self.ref, "list", resp.status, body, self.creds.server, self.tokens.subject()
                )
        try:
            rv, obj = list_step(codec.loads(body))
        except ValueError as exc:
            raise WatchProblem("bad_event", f"the API server's list answer is not JSON: {exc}") from None
        self._ok()
        if obj is None:
            self._set_missing(
                f"ConfigMap {self.ref} not found: no ConfigMap {self.ref.name!r} in namespace "
                f"{self.ref.namespace} (check --routing-configmap; the operator writes <pdd>-routing in the "
                "PDDeployment's namespace); watching for it to be created"
            )
        else:
            self._offer(obj)
        return rv

    async def _watch(self, rv: str) -> str:
        session = self._ensure_session()
        timeout_s = int(self.watch_timeout_s * (1 + self._rng()) / 1.5) or 1  # spread over [2/3 T, 4/3 T]
        query = urlencode(
            {
                "fieldSelector": f"metadata.name={self.ref.name}",
                "watch": "1",
                "resourceVersion": rv,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_s),
            }
        )
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=self.idle_read_s
        )
        async with session.get(f"{self.base_url}?{query}", timeout=timeout, **self._request_kwargs()) as resp:
            if resp.status == 410:
                raise WatchGone(f"HTTP 410 for resourceVersion {rv}")
            if resp.status != 200:
                body = await resp.read()
                raise http_failure(
                    self.ref, "watch", resp.status, body, self.creds.server, self.tokens.subject()
                )
            self._ok()
            lines = LineBuffer()
            try:
                async for chunk in resp.content.iter_any():
                    for line in lines.feed(chunk):
                        rv = self._handle(line, rv)
            except aiohttp.ServerTimeoutError:
                raise _StreamClosed("idle") from None
            except aiohttp.ClientError:  # the connection broke mid-stream; reconnecting tells more
                raise _StreamClosed("closed") from None
        return rv

    def _handle(self, line: bytes, rv: str) -> str:
        try:
            event = codec.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise WatchProblem("bad_event", f"a watch event of ConfigMap {self.ref} is not JSON") from None
        step = event_step(event)
        if step.action == "gone":
            raise WatchGone(step.detail)
        if step.action == "error":
            raise WatchProblem(step.reason, f"watch of ConfigMap {self.ref}: {step.detail}")
        if step.action == "deleted":
            kept = self.served.generation
            keeping = f"keeping generation {kept}" if kept is not None else "no table served yet"
            self._set_missing(f"ConfigMap {self.ref} was deleted; {keeping} until it is written again")
        elif step.action == "offer":
            self._offer(event["object"])
        return step.resource_version or rv

    def _offer(self, obj: Mapping[str, Any]) -> None:
        self._set_missing(None)
        origin = f"ConfigMap {self.ref} (resourceVersion {resource_version_of(obj)})"
        text, why = configmap_table(obj)
        if text is None:
            self.served.reject(origin, why)
        else:
            self.served.offer(text, origin)

    def _set_missing(self, message: str | None) -> None:
        self._missing = message
        self._publish()


class _StreamClosed(Exception):
    """The watch's connection ended before the server's timeout (``reason`` idle or closed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
