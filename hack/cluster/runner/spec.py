"""Pure parts of the pod runner: what the kubelet derives from a pod spec, without side effects.

Env expansion (``$(VAR)``, ``$$``), downward-API field values, resource quantities, the restart
back-off and the list of pod fields the runner cannot honour. Kept free of I/O so the rules read
like the kubelet's and can be checked in unit tests.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

BACKOFF_INITIAL = 10.0
BACKOFF_MAX = 300.0
BACKOFF_RESET_AFTER = 600.0  # a container that ran this long starts its back-off afresh

SUPPORTED_VOLUMES = ("configMap", "secret", "emptyDir", "hostPath", "downwardAPI", "projected")
SUPPORTED_PROJECTIONS = ("configMap", "secret", "downwardAPI", "serviceAccountToken")


class ConfigError(Exception):
    """A container cannot be configured yet (missing ConfigMap/Secret key): the kubelet retries."""


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """Kubelet's ``$(VAR)`` expansion: ``$$`` is a literal ``$``; an unknown ``$(VAR)`` stays as is."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    value = lookup(name)
                    out.append(value if value is not None else f"$({name})")
                    i = end + 1
                    continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def with_pod_address(args: list[str], pod_ip: str) -> list[str]:
    """Replace a listen address of ``0.0.0.0`` by the pod IP.

    All pods share the host's network namespace here, so "every address of my pod" must become
    "my pod's one address", or two pods listening on the same port would collide.
    """
    out = []
    for arg in args:
        if arg == "0.0.0.0":
            out.append(pod_ip)
        elif arg.startswith("--") and arg.endswith("=0.0.0.0"):
            out.append(arg[: -len("0.0.0.0")] + pod_ip)
        else:
            out.append(arg)
    return out


_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:[eE]([+-]?[0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)$")


def quantity(text: str | int | float) -> Fraction:
    """A Kubernetes resource quantity (``500m``, ``1Gi``, ``2``) as an exact number."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"not a quantity: {text!r}")
    number, exponent, suffix = match.groups()
    value = Fraction(number) * _SUFFIX[suffix]
    if exponent:
        value *= Fraction(10) ** int(exponent)
    return value


def resource_value(
    container: Mapping[str, Any], resource: str, divisor: str | None, allocatable: Mapping[str, str]
) -> str:
    """``resourceFieldRef``: limits default to the node's allocatable, requests to the limit (kubelet)."""
    section, _, name = resource.partition(".")
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if section == "limits":
        raw = limits.get(name, allocatable.get(name, "0"))
    elif section == "requests":
        raw = requests.get(name, limits.get(name, "0"))
    else:
        raise ConfigError(f"resourceFieldRef: unsupported resource {resource!r}")
    value = quantity(raw) / quantity(divisor or "1")
    return str(max(1, math.ceil(value)) if name == "cpu" else math.ceil(value))


_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_value(pod: Mapping[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    """A ``fieldRef`` value as the kubelet resolves it."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = _SUBSCRIPT.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ConfigError(f"fieldRef: unsupported fieldPath {path!r}")


@dataclass
class Lookups:
    """Where env values come from; each returns None for a missing object or key."""

    config_map: Callable[[str], Mapping[str, str] | None]
    secret: Callable[[str], Mapping[str, str] | None]


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookups: Lookups,
    pod_ip: str,
    host_ip: str,
    injected: Mapping[str, str],
    allocatable: Mapping[str, str],
) -> dict[str, str]:
    """The container's environment in kubelet order: injected, then envFrom, then env (expanded)."""
    env: dict[str, str] = dict(injected)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix") or ""
        for kind, getter in (("configMapRef", lookups.config_map), ("secretRef", lookups.secret)):
            ref = source.get(kind)
            if ref is None:
                continue
            data = getter(ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind[:-3]} "{ref["name"]}" not found')
            for key, item in data.items():
                env[prefix + key] = item
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value") or ""), env.get)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            target = container
            if ref.get("containerName"):
                target = next(
                    (c for c in pod["spec"]["containers"] if c["name"] == ref["containerName"]), container
                )
            value = resource_value(target, ref["resource"], ref.get("divisor"), allocatable)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
            ref = source[kind]
            found = (lookups.config_map if kind == "configMapKeyRef" else lookups.secret)(ref["name"])
            value = None if found is None else found.get(ref["key"])
            if value is None:
                if ref.get("optional"):
                    continue
                what = "configmap" if kind == "configMapKeyRef" else "secret"
                raise ConfigError(f"couldn't find key {ref['key']} in {what} {ref['name']}")
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        env[name] = value
    return env


def unsupported(pod: Mapping[str, Any]) -> list[str]:
    """Pod fields the runner cannot honour, each named by its path; the pod is then not started."""
    spec = pod.get("spec") or {}
    found: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
        if spec.get(field):
            found.append(f"spec.{field}")
    if spec.get("ephemeralContainers"):
        found.append("spec.ephemeralContainers")
    if spec.get("resourceClaims"):
        found.append("spec.resourceClaims")
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = [k for k in volume if k != "name"]
        for kind in kinds:
            if kind not in SUPPORTED_VOLUMES:
                found.append(f"spec.volumes[{i}].{kind} (volume {volume['name']})")
            elif kind == "projected":
                for j, src in enumerate(volume["projected"].get("sources") or []):
                    for skind in src:
                        if skind not in SUPPORTED_PROJECTIONS:
                            found.append(f"spec.volumes[{i}].projected.sources[{j}].{skind}")
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            path = f"spec.{group}[{i}]"
            if not c.get("command"):
                found.append(f"{path}.command (empty: the runner does not know the image's entrypoint)")
            if group == "initContainers" and c.get("restartPolicy"):
                found.append(f"{path}.restartPolicy (sidecar containers)")
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for kind in ("grpc",):
                    if kind in (c.get(probe) or {}):
                        found.append(f"{path}.{probe}.{kind}")
            if (c.get("lifecycle") or {}).get("postStart"):
                found.append(f"{path}.lifecycle.postStart")
            for j, m in enumerate(c.get("volumeMounts") or []):
                for field in ("subPathExpr", "mountPropagation", "recursiveReadOnly"):
                    if m.get(field) and not (field == "mountPropagation" and m[field] == "None"):
                        found.append(f"{path}.volumeMounts[{j}].{field}")
            if c.get("volumeDevices"):
                found.append(f"{path}.volumeDevices")
    return found


def backoff_delay(crashes: int) -> float:
    """Delay before restart number ``crashes`` + 1: immediate, then 10 s doubling to 5 min."""
    if crashes <= 1:
        return 0.0
    return float(min(BACKOFF_MAX, BACKOFF_INITIAL * 2 ** (crashes - 2)))


def should_restart(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)
