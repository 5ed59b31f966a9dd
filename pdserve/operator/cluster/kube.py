"""Thin, synchronous access to the Kubernetes API: plain dicts in and out.

The reconciler speaks in manifest dicts (what :mod:`pdserve.deployment.render` renders), so
this module sends and returns JSON dicts rather than the client's generated models. It reuses
the ``kubernetes`` package only for what is tedious to get right: reading a kubeconfig or the
in-cluster service account, TLS and authentication. It is thread-safe (one urllib3 pool) and
is called from a worker thread, never from kopf's event loop.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client, config

from pdserve.deployment.spec.pddeployment import GROUP, PLURAL, VERSION
from pdserve.operator import metrics

FIELD_MANAGER = "pdserve-operator"
REQUEST_TIMEOUT = 30.0
_HOSTNAME = socket.gethostname()

# kind -> (API prefix, plural) for every kind the operator touches.
_KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Event": ("/api/v1", "events"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "PDDeployment": (f"/apis/{GROUP}/{VERSION}", PLURAL),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
}
#: Methods that change the cluster: the leader-election fence guards them.
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


# The kubernetes package is untyped; these are the only entry points used.
_load_kube_config: Callable[..., None] = config.load_kube_config
_load_incluster_config: Callable[..., None] = config.load_incluster_config


class KubeError(RuntimeError):
    """A failed API call: ``status`` is the HTTP status (0 when no answer came back)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: {status} {message}".rstrip())


class NotLeader(KubeError):
    """A write refused before it was sent: this process does not hold a fresh leader lease."""

    def __init__(self, method: str, path: str, reason: str) -> None:
        super().__init__(method, path, 0, f"refused, not the leader: {reason}")


class Kube:
    """``fence``, when given, is asked right before every write: a reason (str) refuses the write
    with :class:`NotLeader`, None lets it go (see :mod:`pdserve.operator.control.leader`)."""

    def __init__(
        self,
        kubeconfig: str | None = None,
        pool_size: int = 128,
        fence: Callable[[], str | None] | None = None,
    ) -> None:
        cfg = client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG")
        if path or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            _load_kube_config(config_file=path, client_configuration=cfg)
        else:
            _load_incluster_config(client_configuration=cfg)
        cfg.connection_pool_maxsize = pool_size
        self._api: Any = client.ApiClient(cfg)
        self._fence = fence

    def close(self) -> None:
        self._api.close()

    # --- generic verbs -------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = REQUEST_TIMEOUT,
        changes: bool | None = None,
    ) -> dict[str, Any]:
        """``changes``: whether the call changes the cluster (default: by method); only those are
        fenced. A POST that stores nothing (an access review) passes ``changes=False``."""
        if changes is None:
            changes = method in _WRITES
        if self._fence is not None and changes and (reason := self._fence()) is not None:
            metrics.FENCED_WRITES.inc()
            raise NotLeader(method, path, reason)
        started = time.monotonic()
        try:
            return self._request(method, path, body, query, content_type, timeout)
        finally:
            metrics.API_REQUESTS.labels(method).observe(time.monotonic() - started)

    def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        query: Mapping[str, str] | None,
        content_type: str,
        timeout: float,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = self._api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            auth_settings=["BearerToken"],
        )
        _, url, headers_out, _, _ = serialized
        try:
            # The client serializes dict bodies itself (JSON for both json and yaml content types).
            response = self._api.call_api(method, url, headers_out, body, None, timeout)
            raw = response.read()
        except client.ApiException as exc:
            raise KubeError(method, path, exc.status or 0, str(exc.reason or "")) from exc
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # refused, reset, timed out
            raise KubeError(method, path, 0, str(exc)) from exc
        if response.status >= 400:
            raise KubeError(method, path, response.status, _message(raw))
        return json.loads(raw) if raw else {}

    def get(
        self, kind: str, namespace: str, name: str, timeout: float = REQUEST_TIMEOUT
    ) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(kind, namespace, name), timeout=timeout)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list_objects(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self.list_versioned(kind, namespace, label_selector)[0]

    def list_versioned(
        self, kind: str, namespace: str, label_selector: str
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The items and the list's own resourceVersion (the moment the listing stands for)."""
        doc = self.request("GET", object_path(kind, namespace), query={"labelSelector": label_selector})
        version = (doc.get("metadata") or {}).get("resourceVersion")
        return list(doc.get("items") or []), str(version) if version is not None else None

    def create(self, obj: Mapping[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        """POST. A 409 is an error: pod names carry a random suffix, so a clash is never "ours"."""
        meta = obj["metadata"]
        return self.request("POST", object_path(obj["kind"], meta["namespace"]), obj, timeout=timeout)

    def replace(self, obj: Mapping[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        """PUT; with ``metadata.resourceVersion`` set, a KubeError 409 if the object changed since."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        return self.request("PUT", path, obj, timeout=timeout)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as pdserve-operator: fields it dropped from a manifest go away too."""
        meta = obj["metadata"]
        return self.request(
            "PATCH",
            object_path(obj["kind"], meta["namespace"], meta["name"]),
            obj,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",  # JSON is YAML
        )

    def merge_patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], subresource: str = ""
    ) -> dict[str, Any]:
        path = object_path(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> dict[str, Any] | None:
        """DELETE, only the object with ``uid`` when given; None when it was already gone.

        Returns the server's answer: for a pod, the pod with its deletionTimestamp set.
        """
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            return self.request("DELETE", object_path(kind, namespace, name), body)
        except KubeError as exc:
            if exc.status in (404, 409):  # gone, or a newer object now holds the name
                return None
            raise

    def post_event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about ``involved`` (shown by ``kubectl describe``), from pdserve-operator."""
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": _HOSTNAME,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.request("POST", object_path("Event", meta["namespace"]), event)

    def list_nodes(self) -> tuple[list[dict[str, Any]], str | None]:
        """Every Node and the list's resourceVersion: seeds the watch-fed node view once."""
        doc = self.request("GET", "/api/v1/nodes")
        version = (doc.get("metadata") or {}).get("resourceVersion")
        return list(doc.get("items") or []), str(version) if version is not None else None

    def allowed(self, verb: str, resource: str, group: str = "") -> bool:
        """Whether this client may ``verb`` ``resource`` cluster-wide (a SelfSubjectAccessReview,
        which every authenticated user may create): decides which watches are worth opening."""
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "group": group}},
        }
        path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        answer = self.request("POST", path, review, changes=False)  # stores nothing: a follower may ask
        return bool((answer.get("status") or {}).get("allowed"))


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = _KINDS[kind]
    path = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    return f"{path}/{quote(name)}" if name else path


def _message(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw[:200].decode(errors="replace")
    return str(doc.get("message", "")) if isinstance(doc, dict) else ""
