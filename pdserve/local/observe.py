"""What the local runner saw, as the operator's :class:`ObservedInstance` values (pure).

A single-node instance is one engine process. A multi-node instance is one process per node of
its group (pdserve.local.plan), and like the operator's groups it is one instance in the table:
ready only when every node is (a ``--headless`` node has no HTTP, so "running" is its health),
named after its leader, and with ``perNode`` API servers one endpoint per node, each on the
node's own loopback port.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.deployment.render.routing_table import NodeEndpoint, ObservedInstance
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.local.plan import LOOPBACK, EngineProcess


def observed_instances(
    pdd: PDDeployment, engines: Sequence[EngineProcess], healthy: Sequence[bool]
) -> list[ObservedInstance]:
    out: list[ObservedInstance] = []
    groups: dict[str, list[tuple[EngineProcess, bool]]] = {}
    for engine, ok in zip(engines, healthy, strict=True):
        if engine.group:
            groups.setdefault(engine.group, []).append((engine, ok))
        else:
            out.append(
                ObservedInstance(
                    engine.role,
                    engine.index,
                    engine.name,
                    LOOPBACK,
                    ok,
                    port=engine.port,
                    kv_port=engine.kv_port,
                )
            )
    for name, members in groups.items():
        members.sort(key=lambda m: m[0].node)
        leader = members[0][0]
        shape = pdd.spec.group_shape(leader.role)
        endpoints = tuple(
            NodeEndpoint(LOOPBACK, shape.api_ranks(e.node).start, len(shape.api_ranks(e.node)), e.port)
            for e, _ in members
            if e.serves_http
        )
        out.append(
            ObservedInstance(
                leader.role,
                leader.index,
                name,
                LOOPBACK,
                all(ok for _, ok in members),
                port=leader.port,
                endpoints=endpoints if len(endpoints) > 1 else (),
                kv_port=leader.kv_port,
            )
        )
    return out
