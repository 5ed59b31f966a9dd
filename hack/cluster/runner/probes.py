"""Probe and lifecycle-handler actions (httpGet, tcpSocket, exec, sleep), as the kubelet runs them.

An httpGet's host defaults to the pod IP; a 2xx/3xx answer is success. An exec runs in the
container's mount namespace (``nsenter``) with the container's environment.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any


def resolve_port(port: int | str, container: Mapping[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is not a named port of container {container['name']}")


def run_action(
    action: Mapping[str, Any],
    container: Mapping[str, Any],
    pod_ip: str,
    pid: int | None,
    env: Mapping[str, str],
    timeout: float,
) -> tuple[bool, str]:
    """(success, detail) of one probe or handler action."""
    try:
        if "httpGet" in action:
            return _http(action["httpGet"], container, pod_ip, timeout)
        if "tcpSocket" in action:
            spec = action["tcpSocket"]
            host = spec.get("host") or pod_ip
            port = resolve_port(spec["port"], container)
            with socket.create_connection((host, port), timeout=timeout):
                return True, ""
        if "exec" in action:
            return _exec(action["exec"]["command"], pid, env, timeout)
        if "sleep" in action:
            time.sleep(float(action["sleep"]["seconds"]))
            return True, ""
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    return False, f"unsupported action {sorted(action)}"


def _http(
    spec: Mapping[str, Any], container: Mapping[str, Any], pod_ip: str, timeout: float
) -> tuple[bool, str]:
    host = spec.get("host") or pod_ip
    port = resolve_port(spec["port"], container)
    scheme = (spec.get("scheme") or "HTTP").lower()
    path = spec.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    request = urllib.request.Request(f"{scheme}://{host}:{port}{path}")
    request.add_header("User-Agent", "kube-probe/pdserve-runner")
    for header in spec.get("httpHeaders") or []:
        request.add_header(header["name"], header["value"])
    context = ssl._create_unverified_context() if scheme == "https" else None  # the kubelet does not verify
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    if 200 <= status < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {status}"


def _exec(command: list[str], pid: int | None, env: Mapping[str, str], timeout: float) -> tuple[bool, str]:
    prefix = ["nsenter", "-t", str(pid), "-m", "--"] if pid else []
    try:
        out = subprocess.run(
            [*prefix, *command],
            env=dict(env),
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"command timed out after {timeout}s"
    if out.returncode == 0:
        return True, ""
    text = (out.stdout + out.stderr).decode(errors="replace").strip()[-200:]
    return False, f"command {command!r} exited with {out.returncode}: {text}"
