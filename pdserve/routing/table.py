"""Typed routing table and its one parser.

The operator writes this document into the ``<name>-routing`` ConfigMap under ``routing.json``;
the proxy hot-reloads it. Both sides use :func:`parse_routing_table` and
:meth:`RoutingTable.to_dict`, so there is exactly one definition of the format.

Unknown fields are ignored (a newer operator may add some); wrong types and missing
required fields are errors whose message names the offending path, e.g.
``prefill[1].dpSize: expected an integer >= 1, got "8" (string)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from pdserve import kv

API_VERSION = "pdserve.io/v1alpha1"
KIND = "RoutingTable"
CONFIGMAP_KEY = "routing.json"


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class FieldError(ValueError):
    """A document that must not be acted on; the message names the field (a path such as
    ``prefill[1].dpSize``) and the reason, so a user knows what to fix."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


class RoutingTableError(FieldError):
    """A routing table that must not be served."""


@dataclass(frozen=True)
class Connector:
    type: str  # a pdserve.kv connector's table type
    transfer_mode: str | None = None  # one of its modes, for a connector that takes one

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.transfer_mode is not None:
            out["transferMode"] = self.transfer_mode
        return out


@dataclass(frozen=True)
class Endpoint:
    """One API server of a multi-node instance and the global DP ranks it serves.

    With vLLM's hybrid load balancing (``--data-parallel-hybrid-lb``, ``spec.multiNode.apiServers:
    perNode``) every node runs an API server that knows only its own engines, ranks
    ``first_rank .. first_rank + ranks - 1``, and takes them as *local* ranks in
    ``X-data-parallel-rank`` (see :attr:`pdserve.routing.slots.Slot.rank_header`).
    """

    url: str
    first_rank: int
    ranks: int
    kv_address: str | None = None

    def holds(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.ranks

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "firstRank": self.first_rank, "ranks": self.ranks}
        if self.kv_address is not None:
            out["kvAddress"] = self.kv_address
        return out


@dataclass(frozen=True)
class Instance:
    """One vLLM server: ``dp_size`` engines behind one HTTP endpoint (``url``), or, for a
    multi-node instance with an API server per node, behind ``endpoints`` (each serving a range
    of the global ranks; empty: ``url`` serves every rank)."""

    name: str
    url: str
    dp_size: int = 1
    tp_size: int = 1
    ready: bool = False
    draining: bool = False
    kv_address: str | None = None
    #: What prefill and decode must agree on to exchange KV (model, image, KV layout, connector),
    #: as a hash; a prefill is paired only with decodes of its revision. "" (a table written
    #: before revisions existed) is one revision shared by every such instance.
    revision: str = ""
    endpoints: tuple[Endpoint, ...] = ()

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining

    def endpoint_for(self, rank: int) -> Endpoint | None:
        """The endpoint serving global ``rank`` (None: ``url`` serves it)."""
        return next((e for e in self.endpoints if e.holds(rank)), None)

    def api_urls(self) -> tuple[str, ...]:
        """Every API server of the instance (the profiler broadcast)."""
        return tuple(e.url for e in self.endpoints) if self.endpoints else (self.url,)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "dpSize": self.dp_size,
            "tpSize": self.tp_size,
            "ready": self.ready,
            "draining": self.draining,
        }
        if self.kv_address is not None:
            out["kvAddress"] = self.kv_address
        if self.revision:
            out["revision"] = self.revision
        if self.endpoints:
            out["endpoints"] = [e.to_dict() for e in self.endpoints]
        return out


@dataclass(frozen=True)
class RoutingTable:
    deployment: str
    generation: int
    connector: Connector
    prefill: tuple[Instance, ...] = ()
    decode: tuple[Instance, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def instances(self, role: Role) -> tuple[Instance, ...]:
        return self.prefill if role is Role.PREFILL else self.decode

    def to_dict(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "deployment": self.deployment,
            "generation": self.generation,
            "connector": self.connector.to_dict(),
            "prefill": [i.to_dict() for i in self.prefill],
            "decode": [i.to_dict() for i in self.decode],
        }

    def to_json(self) -> str:
        """Canonical text: stable key order, so equal tables produce equal ConfigMap data."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def same_content(self, other: RoutingTable) -> bool:
        """Equal apart from ``generation``: the writer bumps the generation only when this is False."""
        return (self.deployment, self.connector, self.prefill, self.decode) == (
            other.deployment,
            other.connector,
            other.prefill,
            other.decode,
        )


# --- parsing -----------------------------------------------------------------------------------


def load_routing_table(text: str | bytes) -> RoutingTable:
    """Parse the JSON text of a routing table (the ConfigMap value or a mounted file)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RoutingTableError("", f"not valid JSON: {exc}") from exc
    return parse_routing_table(data)


def parse_routing_table(data: object) -> RoutingTable:
    doc = _object(data, "")
    api_version = _required(doc, "apiVersion", "", str)
    if api_version != API_VERSION:
        raise RoutingTableError("apiVersion", f'expected "{API_VERSION}", got {_show(api_version)}')
    kind = _required(doc, "kind", "", str)
    if kind != KIND:
        raise RoutingTableError("kind", f'expected "{KIND}", got {_show(kind)}')
    deployment = _required(doc, "deployment", "", str)
    if not deployment:
        raise RoutingTableError("deployment", "must not be empty")
    generation = _int(_required(doc, "generation", "", object), "generation", minimum=0)
    connector = _parse_connector(_required(doc, "connector", "", object))
    prefill = _parse_role(doc.get("prefill", []), Role.PREFILL, connector)
    decode = _parse_role(doc.get("decode", []), Role.DECODE, connector)
    return RoutingTable(deployment, generation, connector, prefill, decode)


def _parse_connector(value: object) -> Connector:
    doc = _object(value, "connector")
    ctype = _required(doc, "type", "connector", str)
    if ctype not in kv.table_types():
        raise RoutingTableError(
            "connector.type", f"expected one of {_choices(kv.table_types())}, got {_show(ctype)}"
        )
    modes = kv.by_table(ctype).names.modes
    mode = doc.get("transferMode")
    if modes:
        if mode is None:
            raise RoutingTableError("connector.transferMode", f"required for {ctype} ({' or '.join(modes)})")
        if mode not in modes:
            raise RoutingTableError(
                "connector.transferMode", f"expected one of {_choices(modes)}, got {_show(mode)}"
            )
    elif mode is not None:
        takers = ", ".join(c.names.table for c in kv.with_modes())
        raise RoutingTableError("connector.transferMode", f"only valid for {takers}, not {ctype}")
    return Connector(ctype, mode)


def _parse_role(value: object, role: Role, connector: Connector) -> tuple[Instance, ...]:
    if not isinstance(value, list):
        raise RoutingTableError(role.value, f"expected a list, got {_show(value)}")
    seen: set[str] = set()
    out = []
    for index, item in enumerate(value):
        path = f"{role.value}[{index}]"
        inst = _parse_instance(item, path, role, connector)
        if inst.name in seen:
            raise RoutingTableError(f"{path}.name", f"duplicate instance name {_show(inst.name)}")
        seen.add(inst.name)
        out.append(inst)
    return tuple(out)


def _parse_instance(value: object, path: str, role: Role, connector: Connector) -> Instance:
    doc = _object(value, path)
    name = _required(doc, "name", path, str)
    if not name:
        raise RoutingTableError(f"{path}.name", "must not be empty")
    url = _required(doc, "url", path, str)
    _check_url(url, f"{path}.url")
    dp_size = _int(_required(doc, "dpSize", path, object), f"{path}.dpSize", minimum=1)
    tp_size = _int(doc.get("tpSize", 1), f"{path}.tpSize", minimum=1)
    ready = _bool(_required(doc, "ready", path, object), f"{path}.ready")
    draining = _bool(doc.get("draining", False), f"{path}.draining")
    kv_address = doc.get("kvAddress")
    if kv_address is not None and not isinstance(kv_address, str):
        raise RoutingTableError(f"{path}.kvAddress", f"expected a string, got {_show(kv_address)}")
    if not kv_address and role in kv.by_table(connector.type).render.address_roles:
        raise RoutingTableError(f"{path}.kvAddress", f"required for the {connector.type} connector")
    revision = doc.get("revision", "")
    if revision is None:
        revision = ""
    if not isinstance(revision, str):
        raise RoutingTableError(f"{path}.revision", f"expected a string, got {_show(revision)}")
    endpoints = _parse_endpoints(doc.get("endpoints"), f"{path}.endpoints", dp_size)
    return Instance(name, url.rstrip("/"), dp_size, tp_size, ready, draining, kv_address, revision, endpoints)


def _parse_endpoints(value: object, path: str, dp_size: int) -> tuple[Endpoint, ...]:
    """The API servers of a multi-node instance, in rank order: their ranges must start at 0,
    follow each other without gap or overlap, and cover exactly ``dpSize`` ranks."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RoutingTableError(path, f"expected a list, got {_show(value)}")
    out: list[Endpoint] = []
    expected = 0
    for index, item in enumerate(value):
        here = f"{path}[{index}]"
        doc = _object(item, here)
        url = _required(doc, "url", here, str)
        _check_url(url, f"{here}.url")
        first = _int(_required(doc, "firstRank", here, object), f"{here}.firstRank", minimum=0)
        ranks = _int(_required(doc, "ranks", here, object), f"{here}.ranks", minimum=1)
        if first < expected:
            raise RoutingTableError(
                f"{here}.firstRank",
                f"rank {first} is already served by {path}[{index - 1}] (ranks {out[-1].first_rank}.."
                f"{expected - 1}): endpoint ranges must not overlap",
            )
        if first > expected:
            start = "from 0" if index == 0 else f"after {path}[{index - 1}]"
            raise RoutingTableError(
                f"{here}.firstRank",
                f"expected {expected}, got {first}: ranks {expected}..{first - 1} would have no "
                f"endpoint (ranges must be contiguous {start}, listed in rank order)",
            )
        kv_address = doc.get("kvAddress")
        if kv_address is not None and not isinstance(kv_address, str):
            raise RoutingTableError(f"{here}.kvAddress", f"expected a string, got {_show(kv_address)}")
        out.append(Endpoint(url.rstrip("/"), first, ranks, kv_address))
        expected = first + ranks
    if out and expected != dp_size:
        raise RoutingTableError(
            path,
            f"the endpoints serve {expected} rank(s) but dpSize is {dp_size}: they must cover every rank",
        )
    return tuple(out)


def _check_url(url: str, path: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RoutingTableError(
            path, f"expected an http(s) URL such as http://10.0.0.5:8000, got {_show(url)}"
        )
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise RoutingTableError(path, f"bad port in {_show(url)}") from exc


# --- small typed readers -----------------------------------------------------------------------


def _object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RoutingTableError(path, f"expected an object, got {_show(value)}")
    return value


def _required(doc: Mapping[str, Any], key: str, path: str, kind: type) -> Any:
    full = f"{path}.{key}" if path else key
    if key not in doc or doc[key] is None:
        raise RoutingTableError(full, "required field is missing")
    value = doc[key]
    if kind is str and not isinstance(value, str):
        raise RoutingTableError(full, f"expected a string, got {_show(value)}")
    return value


def _int(value: object, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RoutingTableError(path, f"expected an integer >= {minimum}, got {_show(value)}")
    return value


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise RoutingTableError(path, f"expected true or false, got {_show(value)}")
    return value


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(f'"{v}"' for v in values)


def _show(value: object) -> str:
    type_name = {
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        list: "list",
        dict: "object",
    }
    kind = type_name.get(type(value), "null" if value is None else type(value).__name__)
    text = json.dumps(value) if isinstance(value, str | int | float | bool) or value is None else kind
    return text if text == kind else f"{text} ({kind})"
