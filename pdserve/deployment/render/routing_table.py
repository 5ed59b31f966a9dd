"""Observed instances → the routing table the proxy reads (pdserve.routing's contract).

Shared by the operator (pods: IP, Ready condition, draining mark) and the local mode
(processes on loopback: their health as ``ready``). Only the generation rule lives here;
the format is :mod:`pdserve.routing.table`'s, never redefined.

Instances without an address (a pod not yet scheduled or without an IP) are left out: the
table's ``url`` must be a real address, and such an instance could not be routed to anyway.
The operator's status counts pods, not table entries, so nothing is lost.

The operator publishes the table as ConfigMap ``NAME-routing`` (:func:`routing_configmap`),
which the routers watch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.render.names import object_metadata, routing_configmap_name
from pdserve.deployment.spec.pddeployment import ENGINE_PORT, PDDeployment
from pdserve.routing import CONFIGMAP_KEY, Endpoint, Instance, Role, RoutingTable


@dataclass(frozen=True)
class NodeEndpoint:
    """One node's API server of a multi-node instance and the DP ranks it takes."""

    ip: str
    first_rank: int
    ranks: int
    port: int = ENGINE_PORT  # local mode runs every node on loopback, each on its own port


@dataclass(frozen=True)
class ObservedInstance:
    role: Role
    index: int
    pod_name: str
    pod_ip: str | None
    ready: bool
    draining: bool = False
    #: The engine's HTTP port; local mode runs many engines on one host, pods all use 8000.
    port: int = ENGINE_PORT
    #: What the instance runs (a pod's ``pdserve.io/dp-size``/``tp-size``); None: the role's spec.
    #: During a rollout that changes dataParallel the old pods still run the old size.
    dp_size: int | None = None
    tp_size: int | None = None
    #: The pairing revision the instance runs (a pod's ``pdserve.io/revision``); None: the spec's.
    revision: str | None = None
    #: A multi-node instance whose nodes each serve their own ranks (vLLM hybrid load
    #: balancing): (ip, first rank, ranks) per node. Empty: the instance's address serves all.
    endpoints: tuple[NodeEndpoint, ...] = ()
    #: The connector's side-channel port the engine runs with, when local mode moved it off the
    #: rendered one (pods: None).
    kv_port: int | None = None


def build_routing_table(
    pdd: PDDeployment, observed: Sequence[ObservedInstance], previous: RoutingTable | None
) -> RoutingTable:
    """The table for what is observed now; ``generation`` moves only when the content changes."""
    kv = pdd.spec.kv_transfer
    render = kv.kv.render
    current = {role: pairing_revision(pdd, role) for role in Role}
    by_role: dict[Role, list[Instance]] = {Role.PREFILL: [], Role.DECODE: []}
    for obs in sorted(observed, key=lambda o: (o.role.value, o.index, o.pod_name)):
        if not obs.pod_ip:
            continue
        rs = pdd.spec.role(obs.role)
        by_role[obs.role].append(
            Instance(
                name=obs.pod_name,
                url=f"http://{_host(obs.pod_ip)}:{obs.port}",
                dp_size=rs.data_parallel if obs.dp_size is None else obs.dp_size,
                tp_size=rs.tensor_parallel if obs.tp_size is None else obs.tp_size,
                ready=obs.ready,
                draining=obs.draining,
                kv_address=render.kv_address(kv.extra_config, obs.role, obs.pod_ip, obs.kv_port),
                revision=obs.revision or current[obs.role],
                endpoints=tuple(
                    Endpoint(
                        f"http://{_host(e.ip)}:{e.port}",
                        e.first_rank,
                        e.ranks,
                        render.kv_address(kv.extra_config, obs.role, e.ip, obs.kv_port),
                    )
                    for e in obs.endpoints
                ),
            )
        )
    table = RoutingTable(
        deployment=pdd.name,
        generation=1,
        connector=kv.routing_connector,
        prefill=tuple(by_role[Role.PREFILL]),
        decode=tuple(by_role[Role.DECODE]),
    )
    if previous is None:
        return table
    generation = previous.generation if table.same_content(previous) else previous.generation + 1
    return RoutingTable(table.deployment, generation, table.connector, table.prefill, table.decode)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def routing_configmap(pdd: PDDeployment, table: RoutingTable) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(pdd, routing_configmap_name(pdd), "routing"),
        "data": {CONFIGMAP_KEY: table.to_json()},
    }
