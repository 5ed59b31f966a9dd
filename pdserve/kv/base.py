"""What pdserve knows of one of vLLM's P/D KV connectors, as one value per connector.

A connector module (``nixl.py``, ``moriio.py``, ``mooncake.py``) builds one :class:`KVConnector`
from four parts, one per job, so each floor asks only for the part it needs:

* :class:`Names`: the CRD's ``kvTransfer.connector`` (vLLM's ``kv_connector``), the routing
  table's ``connector.type`` and the transfer modes it takes;
* :class:`Render`: what the operator, ``pdserve render`` and ``pdserve up`` put into an engine
  pod (``--kv-transfer-config``, ports, environment, capabilities, the table's ``kvAddress``)
  and what vLLM accepts between prefill and decode (:class:`Rule`);
* :class:`Route`: how the router turns a client request into a prefill leg and a decode leg
  (request ids, ``kv_transfer_params``, the checks on the prefill's answer);
* :class:`Simulate`: what a simulated engine answers and which handoffs it refuses.

The parts are defined by job in ``render.py``, ``route.py`` and ``simulate.py`` (the checks
every module shares in ``checks.py``), and a connector module imports each from its part; this
module puts them together and names what the other packages use of them. Everything here is
pure and imports nothing of pdserve outside this package: routing/, deployment/, proxy/, sim/
and local/ look a connector up (:mod:`pdserve.kv`) and never compare its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.kv.checks import PREFILL, last_value
from pdserve.kv.render import Pair, PodKV, Render, Rule, Side
from pdserve.kv.route import LegIds, LegPlan, Route, prefill_only
from pdserve.kv.simulate import PullNotice, SimEngine, SimPrefill, Simulate

__all__ = [
    "KVConnector",
    "LegIds",
    "LegPlan",
    "Names",
    "Pair",
    "PodKV",
    "PullNotice",
    "Render",
    "Route",
    "RouteFactory",
    "Rule",
    "Side",
    "SimEngine",
    "SimPrefill",
    "Simulate",
    "last_value",
    "prefill_only",
    "transfer_config",
]


@dataclass(frozen=True)
class Names:
    crd: str  # spec.kvTransfer.connector, and vLLM's kv_connector
    table: str  # the routing table's connector.type
    #: spec.kvTransfer.transferMode and the table's transferMode; empty: the connector takes none.
    modes: tuple[str, ...] = ()


# --- the whole --------------------------------------------------------------------------------------


class RouteFactory(Protocol):
    def __call__(self, mode: str | None) -> Route: ...


@dataclass(frozen=True)
class KVConnector:
    names: Names
    render: Render
    #: The proxy's connector for a table of this type and transfer mode.
    route: RouteFactory
    simulate: Simulate


def transfer_config(
    connector: KVConnector,
    mode: str | None,
    extra: Mapping[str, Any],
    role: str,
    instance: str,
    http_port: int,
) -> dict[str, Any]:
    """The value of ``vllm serve --kv-transfer-config`` for an instance of ``role``.

    Every connector pdserve renders takes the same roles: the prefill produces KV, the decode
    consumes it (``kv_both`` is never rendered). pdserve's derived extra config comes first, the
    user's ``extraConfig`` last, so a user can set any key the connector documents.
    """
    config: dict[str, Any] = {
        "kv_connector": connector.names.crd,
        "kv_role": "kv_producer" if role == PREFILL else "kv_consumer",
    }
    engine_id = connector.render.engine_id(instance)
    if engine_id is not None:
        config["engine_id"] = engine_id
    merged = {**connector.render.extra_config(mode, http_port), **extra}
    if merged:
        config["kv_connector_extra_config"] = merged
    return config
