"""Pod templates: a PodSpec fragment merged onto the pod pdserve renders, and the fields it owns.

``spec.prefill.template``, ``spec.decode.template`` and ``spec.router.template`` are
``{metadata: {labels, annotations}, spec: <PodSpec fragment>}``. The fragment is merged with the
rules of a Kubernetes strategic merge patch (the ``patchMergeKey`` tags of the PodSpec types):

* maps merge key by key, recursively; a ``null`` value removes the key;
* ``containers``, ``initContainers``, ``ephemeralContainers``, ``imagePullSecrets``,
  ``resourceClaims``, ``schedulingGates`` merge by ``name``; ``hostAliases`` by ``ip``;
  ``topologySpreadConstraints`` by ``(topologyKey, whenUnsatisfiable)``; a container's ``env`` by
  ``name``, ``volumeMounts`` by ``mountPath``, ``volumeDevices`` by ``devicePath``, ``ports`` by
  ``(containerPort, protocol)``, ``resources.claims`` by ``name``;
* ``volumes`` merge by ``name`` with ``retainKeys``: an entry replaces the rendered one of its
  name, so a volume never ends up with two sources; an ``env`` entry likewise replaces the
  rendered one (``value`` and ``valueFrom`` are a union);
* every other list replaces the rendered one, except two documented deviations:
  ``tolerations`` are appended (an identical toleration is kept once), and a container's
  ``securityContext.capabilities.add`` is unioned, so the connector's ``IPC_LOCK`` stays.

Fields pdserve owns cannot be set from a template: see :mod:`pdserve.deployment.spec.owned`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment.spec.readers import SpecError, no_unknown, plain, read_object, read_string_map, show


@dataclass(frozen=True)
class PodTemplate:
    """A user's pod template, as parsed (plain JSON values, never aliasing the input)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    spec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def metadata(self) -> dict[str, Any]:
        """What the template adds to the pod's metadata (for the template hash), {} if nothing."""
        out: dict[str, Any] = {}
        if self.labels:
            out["labels"] = dict(self.labels)
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


# --- parsing -----------------------------------------------------------------------------------


def parse_template(value: object, path: str) -> PodTemplate:
    """``{metadata: {labels, annotations}, spec: {...}}``; the spec is checked where pdserve reads it."""
    if value is None:
        return PodTemplate()
    doc = read_object(value, path)
    no_unknown(doc, path, ("metadata", "spec"))
    meta = read_object(doc.get("metadata") or {}, f"{path}.metadata")
    no_unknown(meta, f"{path}.metadata", ("labels", "annotations"))
    labels = read_string_map(meta, "labels", f"{path}.metadata")
    annotations = read_string_map(meta, "annotations", f"{path}.metadata")
    spec = plain(read_object(doc.get("spec") or {}, f"{path}.spec"), f"{path}.spec")
    for key in _NAMED_LISTS:
        _check_named_list(spec, key, f"{path}.spec")
    for i, c in enumerate(_list(spec.get("containers"))):
        where = f"{path}.spec.containers[{i}]"
        if not isinstance(c.get("name"), str) or not c["name"]:
            raise SpecError(
                f"{where}.name", "required: the container to merge into (engine, router or a sidecar)"
            )
        for key, merge_key in _CONTAINER_KEYED_LISTS.items():
            _check_keyed_items(c, key, merge_key, where)
    return PodTemplate(labels, annotations, spec)


#: PodSpec lists whose items are objects with a required ``name``.
_NAMED_LISTS = ("containers", "initContainers", "volumes", "imagePullSecrets")
_CONTAINER_KEYED_LISTS = {"env": "name", "volumeMounts": "mountPath"}


def _check_named_list(spec: Mapping[str, Any], key: str, path: str) -> None:
    if key not in spec:
        return
    if not isinstance(spec[key], list):
        raise SpecError(f"{path}.{key}", f"expected a list, got {show(spec[key])}")
    _check_keyed_items(spec, key, "name", path)


def _check_keyed_items(doc: Mapping[str, Any], key: str, merge_key: str, path: str) -> None:
    items = doc.get(key)
    if items is None:
        return
    if not isinstance(items, list):
        raise SpecError(f"{path}.{key}", f"expected a list, got {show(items)}")
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise SpecError(f"{path}.{key}[{i}]", f"expected an object, got {show(item)}")
        value = item.get(merge_key)
        if not isinstance(value, str) or not value:
            raise SpecError(f"{path}.{key}[{i}].{merge_key}", f"required (a string), got {show(value)}")
        if value in seen:
            raise SpecError(f"{path}.{key}[{i}].{merge_key}", f"duplicate {merge_key} {json.dumps(value)}")
        seen.add(value)


# --- the strategic merge -----------------------------------------------------------------------

#: How a list in a PodSpec merges: the key fields of its items, and whether an item replaces
#: the rendered one of the same key ("replace") or merges into it field by field ("merge").
_POD_LISTS: dict[str, tuple[tuple[str, ...], str]] = {
    "containers": (("name",), "merge"),
    "initContainers": (("name",), "merge"),
    "ephemeralContainers": (("name",), "merge"),
    "imagePullSecrets": (("name",), "merge"),
    "resourceClaims": (("name",), "replace"),
    "schedulingGates": (("name",), "merge"),
    "hostAliases": (("ip",), "merge"),
    "topologySpreadConstraints": (("topologyKey", "whenUnsatisfiable"), "replace"),
    "volumes": (("name",), "replace"),  # retainKeys: one volume source per name
}
_CONTAINER_LISTS: dict[str, tuple[tuple[str, ...], str]] = {
    "env": (("name",), "replace"),  # value / valueFrom are a union
    "volumeMounts": (("mountPath",), "merge"),
    "volumeDevices": (("devicePath",), "merge"),
    "ports": (("containerPort", "protocol"), "merge"),
}
_CONTAINER_KINDS = ("containers", "initContainers", "ephemeralContainers")


def merge_pod_spec(rendered: Mapping[str, Any], fragment: Mapping[str, Any]) -> dict[str, Any]:
    """``rendered`` with ``fragment`` merged onto it (neither is modified)."""
    out = copy.deepcopy(dict(rendered))
    for key, patch in fragment.items():
        if patch is None:
            out.pop(key, None)
        elif key == "tolerations" and isinstance(patch, list):
            out[key] = _append_unique(out.get(key) or [], patch)
        elif key in _POD_LISTS and isinstance(patch, list):
            keys, how = _POD_LISTS[key]
            merge = _merge_container if key in _CONTAINER_KINDS else _merge_map
            out[key] = _merge_keyed(out.get(key) or [], patch, keys, merge if how == "merge" else None)
        else:
            out[key] = _merge_value(out.get(key), patch)
    return out


def merge_metadata(rendered: Mapping[str, Any], template: PodTemplate) -> dict[str, Any]:
    """The pod's metadata plus the template's labels and annotations (pdserve's keys win)."""
    out = copy.deepcopy(dict(rendered))
    for key, extra in (("labels", template.labels), ("annotations", template.annotations)):
        if extra:
            ours = dict(out.get(key) or {})
            out[key] = {**ours, **{k: v for k, v in extra.items() if k not in ours}}
    return out


def _merge_container(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(copy.deepcopy(base))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif key in _CONTAINER_LISTS and isinstance(value, list):
            keys, how = _CONTAINER_LISTS[key]
            out[key] = _merge_keyed(out.get(key) or [], value, keys, _merge_map if how == "merge" else None)
        elif key == "securityContext" and isinstance(value, Mapping):
            out[key] = _merge_security_context(out.get(key) or {}, value)
        elif key == "resources" and isinstance(value, Mapping):
            out[key] = _merge_resources(out.get(key) or {}, value)
        else:
            out[key] = _merge_value(out.get(key), value)
    return out


def _merge_security_context(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = _merge_map(base, {k: v for k, v in patch.items() if k != "capabilities"})
    if "capabilities" in patch:
        caps = patch["capabilities"]
        if caps is None:
            out.pop("capabilities", None)
        elif isinstance(caps, Mapping):
            current = dict(out.get("capabilities") or {})
            merged = _merge_map(current, {k: v for k, v in caps.items() if k != "add"})
            if "add" in caps and isinstance(caps["add"], list):
                merged["add"] = _append_unique(current.get("add") or [], caps["add"])
            out["capabilities"] = merged
    return out


def _merge_resources(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = _merge_map(base, {k: v for k, v in patch.items() if k != "claims"})
    if isinstance(patch.get("claims"), list):
        out["claims"] = _merge_keyed(base.get("claims") or [], patch["claims"], ("name",), _merge_map)
    return out


def _merge_value(base: Any, patch: Any) -> Any:
    if isinstance(patch, Mapping) and isinstance(base, Mapping):
        return _merge_map(base, patch)
    return copy.deepcopy(patch)


def _merge_map(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(copy.deepcopy(base))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_value(out.get(key), value)
    return out


def _merge_keyed(
    base: Sequence[Any],
    patch: Sequence[Any],
    keys: tuple[str, ...],
    merge: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None,
) -> list[Any]:
    """Items of ``patch`` merged into (or replacing) the item of ``base`` with the same key;
    new keys appended in the patch's order. The protocol of a port defaults to TCP."""

    def key_of(item: Any) -> tuple[Any, ...] | None:
        if not isinstance(item, Mapping):
            return None
        return tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys)

    out = [copy.deepcopy(item) for item in base]
    index = {key_of(item): i for i, item in enumerate(out) if key_of(item) is not None}
    for item in patch:
        k = key_of(item)
        if k is not None and k in index:
            i = index[k]
            out[i] = merge(out[i], item) if merge is not None else copy.deepcopy(item)
        else:
            if k is not None:
                index[k] = len(out)
            out.append(copy.deepcopy(item))
    return out


def _append_unique(base: Sequence[Any], extra: Sequence[Any]) -> list[Any]:
    out = [copy.deepcopy(v) for v in base]
    for item in extra:
        if item not in out:
            out.append(copy.deepcopy(item))
    return out


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
