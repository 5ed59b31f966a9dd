"""The pod runner's edges: the few API calls a pod worker makes, and its pid files.

Bodies are plain dicts (the client's typed models are not used). Pid files hold "PID STARTTIME"
so that a later runner (or hack/cluster/down) never kills a recycled PID.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .spec import ConfigError
from .volumes import decode_data

log = logging.getLogger("pod-runner")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    """The few API calls a pod worker makes (admin credentials of the test cluster)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.client = api_client
        self.core: Any = client.CoreV1Api(api_client)  # dict bodies: the typed models are not used
        self.ApiException = client.ApiException

    def _get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = self.core.read_namespaced_config_map if kind == "cm" else self.core.read_namespaced_secret
        try:
            obj = read(name, namespace)
        except self.ApiException as exc:
            if exc.status == 404:
                return None
            raise ConfigError(f"reading {name}: {exc.reason}") from exc
        out: dict[str, Any] = self.client.sanitize_for_serialization(obj)
        return out

    def config_map(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self._get("cm", namespace, name)
        return None if obj is None else decode_data(obj, secret=False)

    def secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self._get("secret", namespace, name)
        return None if obj is None else decode_data(obj, secret=True)

    def token(self, pod: Mapping[str, Any], audience: str | None, seconds: int) -> str:
        meta = pod["metadata"]
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        sa = pod["spec"].get("serviceAccountName") or "default"
        try:
            out = self.core.create_namespaced_service_account_token(sa, meta["namespace"], body)
        except self.ApiException as exc:
            raise ConfigError(f"TokenRequest for serviceaccount {sa}: {exc.status} {exc.reason}") from exc
        return str(out.status.token)

    def patch_status(self, pod: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
        """False if the pod is gone."""
        meta = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(
                meta["name"],
                meta["namespace"],
                {"metadata": {"uid": meta["uid"]}, "status": status},
                _content_type="application/strategic-merge-patch+json",
            )
        except self.ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def delete(self, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=body)
        except self.ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def event(self, pod: Mapping[str, Any], kind: str, reason: str, message: str, node: str) -> None:
        meta = pod["metadata"]
        stamp = now_iso()
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "pod-runner", "host": node},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except self.ApiException as exc:
            log.warning(
                "event %s for %s/%s not recorded: %s", reason, meta["namespace"], meta["name"], exc.reason
            )


def write_pidfile(path: Path, pid: int) -> None:
    """PID and its start time (from /proc), so a later runner never kills a recycled PID."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid} {process_start_time(pid)}\n")


def process_start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def kill_leftovers(pid_dir: Path) -> int:
    """Kill the process groups a crashed runner left behind (by their pid files); returns how many."""
    killed = 0
    for f in pid_dir.glob("*.pid") if pid_dir.is_dir() else []:
        try:
            pid_text, start = f.read_text().split()
            pid = int(pid_text)
        except ValueError:
            f.unlink(missing_ok=True)
            continue
        if process_start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                killed += 1
        f.unlink(missing_ok=True)
    return killed
