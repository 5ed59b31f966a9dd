"""The KV connectors pdserve speaks, one module each, found by the name a document gives.

A new connector is one module with a :class:`~pdserve.kv.base.KVConnector` (see nixl.py) and
one entry in :data:`CONNECTORS`, plus its value in the CRD's ``kvTransfer.connector`` enum
(docs/architecture.md, "Adding a connector"). Everything else asks this registry: the spec
parser and the CRD check for :func:`crd_names`, the routing table for :func:`by_table`, the
renderer for :func:`by_crd`, the simulator for :func:`simulated`. Nothing outside this package
compares a connector's name (tests/unit/test_kv_registry.py walks the package's code for one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.kv import mooncake, moriio, nixl
from pdserve.kv.base import KVConnector

#: Every connector, in the order documents list them; the first is the CRD's default.
CONNECTORS: tuple[KVConnector, ...] = (nixl.CONNECTOR, moriio.CONNECTOR, mooncake.CONNECTOR)
DEFAULT = CONNECTORS[0]

_BY_CRD = {c.names.crd: c for c in CONNECTORS}
_BY_TABLE = {c.names.table: c for c in CONNECTORS}


class UnknownConnector(ValueError):
    """A name no connector has; the message lists the known ones."""


def crd_names() -> tuple[str, ...]:
    """``spec.kvTransfer.connector`` values (vLLM's ``kv_connector``)."""
    return tuple(_BY_CRD)


def table_types() -> tuple[str, ...]:
    """The routing table's ``connector.type`` values."""
    return tuple(_BY_TABLE)


def by_crd(name: str) -> KVConnector:
    try:
        return _BY_CRD[name]
    except KeyError:
        raise UnknownConnector(f"unknown connector {name!r}; known: {', '.join(_BY_CRD)}") from None


def by_table(kind: str) -> KVConnector:
    try:
        return _BY_TABLE[kind]
    except KeyError:
        raise UnknownConnector(f"unknown connector type {kind!r}; known: {', '.join(_BY_TABLE)}") from None


def with_modes() -> tuple[KVConnector, ...]:
    """The connectors that take a transfer mode."""
    return tuple(c for c in CONNECTORS if c.names.modes)


def pod_ip_env() -> tuple[str, ...]:
    """Every variable some connector sets to the pod IP, in registry order."""
    return tuple(dict.fromkeys(name for c in CONNECTORS for name in c.render.pod_ip_env))


def engine_env() -> tuple[str, ...]:
    """Every variable some connector sets on an engine pod (to the pod IP, or always), registry order."""
    names = (n for c in CONNECTORS for n in (*c.render.pod_ip_env, *(n for n, _ in c.render.owned_env)))
    return tuple(dict.fromkeys(names))


def owned_env() -> dict[str, str]:
    """Every variable some connector always sets on vLLM pods, and why."""
    return {name: why for c in CONNECTORS for name, why in c.render.owned_env}


def rule_sources(rule_id: str) -> tuple[str, ...]:
    """Where vLLM states a rule every connector shares, for each connector that names one."""
    return tuple(source for c in CONNECTORS for rid, source in c.render.sources if rid == rule_id)


def simulated(params: Mapping[str, Any], leg: str) -> KVConnector:
    """The connector whose legs ``params`` look like, for a simulator not told its connector: the
    one that recognises them most surely, the earlier in :data:`CONNECTORS` on a tie."""
    best = DEFAULT
    score = 0
    for connector in CONNECTORS:
        mine = connector.simulate.recognises(params, leg)
        if mine > score:
            best, score = connector, mine
    return best


def sim_record(request_id: str | None) -> dict[str, Any]:
    """Every connector's fields of the simulator's per-request record."""
    out: dict[str, Any] = {}
    for connector in CONNECTORS:
        out.update(connector.simulate.record(request_id))
    return out


__all__ = [
    "CONNECTORS",
    "DEFAULT",
    "KVConnector",
    "UnknownConnector",
    "by_crd",
    "by_table",
    "crd_names",
    "engine_env",
    "owned_env",
    "pod_ip_env",
    "rule_sources",
    "sim_record",
    "simulated",
    "table_types",
    "with_modes",
]
