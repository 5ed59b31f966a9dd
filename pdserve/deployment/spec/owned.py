"""The fields of a pod template that pdserve owns, and the one function that words their refusal.

:data:`ENGINE_OWNED`, :data:`ROUTER_OWNED` and the tables below list each owned field with the
reason. The CRD refuses most of them with CEL rules whose messages are exactly
:attr:`Owned.message` (tests/unit/test_podtemplate.py compares them); :func:`owned_problems`
refuses all of them for the operator and ``pdserve render``, with the role's path in front
(``spec.prefill.template.spec.containers[engine].args: ...``), plus what the spec makes pdserve's
(a model cache's volume, a Secret's variable: :class:`Reserved`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve import kv
from pdserve.deployment.spec.podtemplate import PodTemplate

ENGINE_CONTAINER = "engine"
ROUTER_CONTAINER = "router"

#: Label keys pdserve sets on every object; the Services, the operator and the scale
#: subresource select pods by them.
OWNED_LABEL_PREFIXES = ("pdserve.io/",)
OWNED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)
OWNED_ANNOTATION_PREFIXES = ("pdserve.io/",)


@dataclass(frozen=True)
class Owned:
    """A field of a template that pdserve sets itself; ``field`` is relative to the role."""

    field: str
    reason: str

    @property
    def message(self) -> str:
        return f"{self.field}: {self.reason}"


def _owned_container(container: str, reasons: Mapping[str, str]) -> dict[str, Owned]:
    return {
        key: Owned(f"template.spec.containers[{container}].{key}", reason) for key, reason in reasons.items()
    }


_PROBE_REASON = (
    "set by pdserve: readiness decides what the router sends the pod; "
    "raise startupTimeoutSeconds for slow model loads"
)
#: Container fields of the engine that a template may not set.
ENGINE_OWNED = _owned_container(
    ENGINE_CONTAINER,
    {
        "image": "set by pdserve from spec.image: prefill and decode must run the same vLLM build "
        "(the KV connectors compare versions at their handshake)",
        "command": "set by pdserve (vllm serve, or pdserve sim)",
        "args": "set by pdserve (model, port, DP/TP sizes, --kv-transfer-config); put extra engine "
        "flags in the role's args",
        "ports": "set by pdserve (the engine's HTTP port and the KV connector's side-channel ports)",
        "startupProbe": _PROBE_REASON,
        "readinessProbe": _PROBE_REASON,
        "livenessProbe": _PROBE_REASON,
    },
)
ROUTER_OWNED = _owned_container(
    ROUTER_CONTAINER,
    {
        "image": "set by pdserve from spec.router.image",
        "command": "set by pdserve (pdserve proxy)",
        "args": (
            "set by pdserve from spec.router (port, admin port, policy, prefill policy, backlog, "
            "routing table)"
        ),
        "ports": "set by pdserve from spec.router.port and spec.router.adminPort",
        "startupProbe": "set by pdserve: the router's readiness decides what the Service sends it",
        "readinessProbe": "set by pdserve: the router's readiness decides what the Service sends it",
        "livenessProbe": "set by pdserve: the router's readiness decides what the Service sends it",
    },
)
#: Pod-level fields of an engine pod that a template may not set.
ENGINE_POD_OWNED = {
    "hostname": Owned(
        "template.spec.hostname",
        "set by pdserve: <role>-<index>-<suffix>, its DNS name in the <name>-engines Service",
    ),
    "subdomain": Owned("template.spec.subdomain", "set by pdserve: the <name>-engines headless Service"),
    "restartPolicy": Owned(
        "template.spec.restartPolicy",
        "set by pdserve (Always: the operator replaces pods, never reruns them)",
    ),
}
ROUTER_POD_OWNED = {
    "serviceAccountName": Owned(
        "template.spec.serviceAccountName",
        "set by pdserve: the router's ServiceAccount is the one allowed to read its routing table",
    ),
}
LABELS_OWNED = Owned(
    "template.metadata.labels",
    "keys under pdserve.io/ and app.kubernetes.io/{name,instance,component,managed-by} are set by "
    "pdserve: its Services and the operator select pods by them",
)
ANNOTATIONS_OWNED = Owned(
    "template.metadata.annotations", "keys under pdserve.io/ are set by pdserve (it reads them back)"
)
DIRECTIVE_REASON = (
    "strategic-merge directives ($patch, $retainKeys, $setElementOrder, ...) are not supported; "
    "write the value you want"
)


@dataclass(frozen=True)
class OwnedNames:
    """Names in a list that pdserve always renders itself (checked by CEL too)."""

    owned: Owned
    names: tuple[str, ...]


#: Always pdserve's, whatever the spec: the engine's identity and every KV connector's side
#: channel (pdserve.kv), so a template fits whichever connector the spec names.
_ENGINE_ENV = ("POD_IP", *kv.engine_env())
ENGINE_ENV_OWNED = OwnedNames(
    Owned(
        "template.spec.containers[engine].env",
        f"{', '.join(_ENGINE_ENV[:-1])} and {_ENGINE_ENV[-1]} are set by pdserve (the pod IP and the KV "
        "connector's side channel)",
    ),
    _ENGINE_ENV,
)
ENGINE_VOLUMES_OWNED = OwnedNames(
    Owned("template.spec.volumes", "the volume name dshm is pdserve's (/dev/shm; size it with shmSize)"),
    ("dshm",),
)
ENGINE_MOUNTS_OWNED = OwnedNames(
    Owned(
        "template.spec.containers[engine].volumeMounts",
        "/dev/shm is mounted by pdserve (size it with shmSize)",
    ),
    ("/dev/shm",),
)
ROUTER_VOLUMES_OWNED = OwnedNames(
    Owned(
        "template.spec.volumes",
        "the volume name routing is reserved by pdserve (earlier versions mounted the routing table there)",
    ),
    ("routing",),
)


@dataclass(frozen=True)
class Reserved:
    """Names that belong to pdserve because of what the spec asks (a model cache, a Secret):
    the volumes, mount paths and variables it then renders, each with why."""

    volumes: Mapping[str, str] = field(default_factory=dict)
    mounts: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


def owned_problems(
    template: PodTemplate,
    path: str,
    container: str,
    reserved: Reserved = Reserved(),
    resource_problem: Callable[[Mapping[str, Any], str], list[str]] | None = None,
) -> list[str]:
    """Every field of ``template`` that pdserve owns, as ``<path>.<field>: <reason>`` messages.

    ``path`` is the role's path (``spec.prefill``). Fields that CEL refuses too get exactly the
    CEL rule's message after the path. ``resource_problem`` checks the main container's
    ``resources`` (the GPU count) and returns messages with their path.
    """
    engine = container == ENGINE_CONTAINER
    pod_owned = ENGINE_POD_OWNED if engine else ROUTER_POD_OWNED
    owned = ENGINE_OWNED if engine else ROUTER_OWNED
    found = [f"{path}.template.spec{_at(where)}: {DIRECTIVE_REASON}" for where in _directives(template.spec)]
    if any(_owned_label(k) for k in template.labels):
        found.append(f"{path}.{LABELS_OWNED.message}")
    if any(k.startswith(OWNED_ANNOTATION_PREFIXES) for k in template.annotations):
        found.append(f"{path}.{ANNOTATIONS_OWNED.message}")
    spec = template.spec
    found += [f"{path}.{o.message}" for key, o in pod_owned.items() if key in spec]
    volumes = [str(v.get("name")) for v in _items(spec, "volumes")]
    static_volumes = ENGINE_VOLUMES_OWNED if engine else ROUTER_VOLUMES_OWNED
    if any(name in static_volumes.names for name in volumes):
        found.append(f"{path}.{static_volumes.owned.message}")
    found += [
        f"{path}.template.spec.volumes[{i}].name: {name} {reserved.volumes[name]}"
        for i, name in enumerate(volumes)
        if name in reserved.volumes
    ]
    for c in _items(spec, "containers"):
        if c.get("name") != container:
            continue
        found += [f"{path}.{o.message}" for key, o in owned.items() if key in c]
        where = f"{path}.template.spec.containers[{container}]"
        names = [str(v.get("name")) for v in _list(c.get("env")) if isinstance(v, Mapping)]
        if engine and any(n in ENGINE_ENV_OWNED.names for n in names):
            found.append(f"{path}.{ENGINE_ENV_OWNED.owned.message}")
        found += [
            f"{where}.env[{i}]: {n} {reserved.env[n]}" for i, n in enumerate(names) if n in reserved.env
        ]
        mounts = [m for m in _list(c.get("volumeMounts")) if isinstance(m, Mapping)]
        if engine and any(m.get("mountPath") in ENGINE_MOUNTS_OWNED.names for m in mounts):
            found.append(f"{path}.{ENGINE_MOUNTS_OWNED.owned.message}")
        for i, mount in enumerate(mounts):
            at, name = str(mount.get("mountPath")), str(mount.get("name"))
            if at in reserved.mounts:
                found.append(f"{where}.volumeMounts[{i}].mountPath: {at} {reserved.mounts[at]}")
            elif name in reserved.volumes:
                found.append(f"{where}.volumeMounts[{i}].name: {name} {reserved.volumes[name]}")
        if resource_problem is not None and isinstance(c.get("resources"), Mapping):
            found += resource_problem(c["resources"], f"{where}.resources")
    return found


def _owned_label(key: str) -> bool:
    return key.startswith(OWNED_LABEL_PREFIXES) or key in OWNED_LABELS


def _at(key: str) -> str:
    return f".{key}" if key else ""


def _directives(value: Any, here: str = "") -> Iterable[str]:
    """Paths of keys starting with ``$`` anywhere in ``value``."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            below = f"{here}.{k}" if here else str(k)
            if str(k).startswith("$"):
                yield below
            else:
                yield from _directives(v, below)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _directives(v, f"{here}[{i}]")


def _items(spec: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    return [v for v in _list(spec.get(key)) if isinstance(v, Mapping)]


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
