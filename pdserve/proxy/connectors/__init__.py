"""Connectors by the routing table's ``connector.type``; a new one is one module plus one line here."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.proxy.connectors.base import Connector, LegIds, LegPlan
from pdserve.proxy.connectors.moriio import MoriioConnector
from pdserve.proxy.connectors.nixl import NixlConnector
from pdserve.routing import Connector as ConnectorSpec

CONNECTORS: dict[str, Callable[[ConnectorSpec], Connector]] = {
    NixlConnector.name: lambda spec: NixlConnector(),
    MoriioConnector.name: lambda spec: MoriioConnector(spec.transfer_mode or ""),
}


def make_connector(spec: ConnectorSpec) -> Connector:
    try:
        factory = CONNECTORS[spec.type]
    except KeyError:
        raise ValueError(f"unknown connector type {spec.type!r}; known: {', '.join(CONNECTORS)}") from None
    return factory(spec)


__all__ = ["CONNECTORS", "Connector", "LegIds", "LegPlan", "make_connector"]
