"""Small typed readers of untrusted YAML/JSON values, shared by the PDDeployment parsers.

Each reader checks one value and raises :class:`SpecError` naming the field's full path, so every
section parser (parse.py, podtemplate.py, storage.py) reports errors the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.routing import FieldError

_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
#: A Secret data key: alphanumerics, '-', '_' and '.'.
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


class SpecError(FieldError):
    """A PDDeployment that must not be acted on; the message names the field and the reason."""


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the deployment's namespace; pdserve never reads its value."""

    name: str
    key: str

    def env_source(self) -> dict[str, Any]:
        """The ``valueFrom`` of an EnvVar that takes this key (the kubelet reads the Secret)."""
        return {"secretKeyRef": {"name": self.name, "key": self.key}}


def read_secret_ref(value: object, path: str) -> SecretKeyRef | None:
    """``{name, key}``, or None when the field is absent."""
    if value is None:
        return None
    doc = read_object(value, path)
    no_unknown(doc, path, ("name", "key"))
    name = read_string(doc, "name", path, required=True)
    if len(name) > 253 or not _DNS_1123_SUBDOMAIN.match(name):
        raise SpecError(f"{path}.name", f"expected a Secret name (a DNS subdomain), got {show(name)}")
    key = read_string(doc, "key", path, required=True)
    if len(key) > 253 or not _SECRET_KEY.match(key):
        raise SpecError(
            f"{path}.key", f"expected a Secret key (letters, digits, '-', '_', '.'), got {show(key)}"
        )
    return SecretKeyRef(name, key)


def read_object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(path, f"expected an object, got {show(value)}")
    for key in value:
        if not isinstance(key, str):
            raise SpecError(path, f"keys must be strings, got {show(key)}")
    return value


def no_unknown(doc: Mapping[str, Any], path: str, known: Sequence[str]) -> None:
    for key in doc:
        if key not in known:
            hint = closest(key, known)
            suffix = f' (did you mean "{hint}"?)' if hint else f"; known fields: {', '.join(known)}"
            raise SpecError(f"{path}.{key}", f"unknown field{suffix}")


def closest(name: str, known: Sequence[str]) -> str | None:
    """The known field ``name`` most likely misspells: the nearest by edit distance (case
    ignored, a swap of two neighbours counts one), if within 1 edit for short names, 2 up to 8
    letters, 3 beyond; the first of equals."""
    limit = 1 if len(name) <= 4 else 2 if len(name) <= 8 else 3
    scored = [(edit_distance(name.lower(), k.lower()), i, k) for i, k in enumerate(known)]
    best = min(scored, default=None)
    return best[2] if best is not None and best[0] <= limit else None


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of adjacent letters turning ``a`` into ``b``
    (optimal string alignment)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, previous2[j - 2] + 1)
            row.append(cost)
        previous2, previous = previous, row
    return previous[-1]


def read_string(
    doc: Mapping[str, Any], key: str, path: str, default: str = "", required: bool = False
) -> str:
    full = f"{path}.{key}"
    if key not in doc or doc[key] is None:
        if required:
            raise SpecError(full, "required field is missing")
        return default
    value = doc[key]
    if not isinstance(value, str):
        raise SpecError(full, f"expected a string, got {show(value)}")
    if required and not value:
        raise SpecError(full, "must not be empty")
    return value


def read_choice(
    doc: Mapping[str, Any], key: str, path: str, choices: Sequence[str], default: str | None
) -> str:
    full = f"{path}.{key}"
    value = doc.get(key, default)
    if value not in choices:
        listed = ", ".join(f'"{c}"' for c in choices)
        raise SpecError(full, f"expected one of {listed}, got {show(value)}")
    return str(value)


def read_integer(
    doc: Mapping[str, Any], key: str, path: str, default: int, minimum: int, maximum: int
) -> int:
    full = f"{path}.{key}"
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(full, f"expected an integer >= {minimum}, got {show(value)}")
    if value > maximum:
        raise SpecError(full, f"expected an integer <= {maximum}, got {show(value)}")
    return value


def read_boolean(doc: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"expected true or false, got {show(value)}")
    return value


def read_list(doc: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key}", f"expected a list, got {show(value)}")
    return value


def read_string_list(doc: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
    items = read_list(doc, key, path)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise SpecError(f"{path}.{key}[{i}]", f"expected a string, got {show(item)}")
    return tuple(items)


def read_object_list(doc: Mapping[str, Any], key: str, path: str) -> tuple[Mapping[str, Any], ...]:
    out = []
    for i, item in enumerate(read_list(doc, key, path)):
        item_path = f"{path}.{key}[{i}]"
        out.append(plain(read_object(item, item_path), item_path))
    return tuple(out)


def read_env_list(doc: Mapping[str, Any], key: str, path: str) -> tuple[Mapping[str, Any], ...]:
    env = read_object_list(doc, key, path)
    for i, var in enumerate(env):
        name = var.get("name")
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise SpecError(
                f"{path}.{key}[{i}].name", f"expected an environment variable name, got {show(name)}"
            )
    return env


def read_string_map(doc: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    full = f"{path}.{key}"
    value = read_object(doc.get(key) or {}, full)
    for k, v in value.items():
        if not isinstance(v, str):
            raise SpecError(f"{full}.{k}", f"expected a string, got {show(v)}")
    return dict(value)


def plain(value: Any, path: str) -> Any:
    """A deep copy made of plain dicts and lists, so the typed spec never aliases the caller's data."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise SpecError(path, f"holds a value that is not JSON ({exc}); quote dates and timestamps") from exc


def show(value: object) -> str:
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "list", dict: "object"}
    kind = (
        "null"
        if value is None
        else names.get(type(value), "object" if isinstance(value, Mapping) else "value")
    )
    if isinstance(value, str | int | float | bool):
        return f"{json.dumps(value)} ({kind})"
    return kind
