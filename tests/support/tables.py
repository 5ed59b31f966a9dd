"""Routing tables for unit tests, written by the contract's own dataclasses (one definition of
the format)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.proxy.policies import Policy
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Connector, Instance, Role, RoutingTable, Slot


def instance(name: str, dp: int = 1, ready: bool = True, draining: bool = False, port: int = 9) -> Instance:
    return Instance(name, f"http://127.0.0.1:{port}", dp_size=dp, ready=ready, draining=draining)


def table_json(
    generation: int,
    prefill: Sequence[Instance] = (),
    decode: Sequence[Instance] = (),
    deployment: str = "llama",
) -> str:
    """The table's JSON text; by default one ready prefill ``p0`` and one ready decode ``d0``."""
    prefill = prefill or (instance("p0", port=1),)
    decode = decode or (instance("d0", port=2),)
    return RoutingTable(deployment, generation, Connector("nixl"), tuple(prefill), tuple(decode)).to_json()


def choose(policy: Policy, role: Role, slots: Sequence[Slot], book: SlotBook, group: str = "") -> list[Slot]:
    """One request's candidates: it takes its turn of the (role, group) counter, then asks."""
    return policy.candidates(role, slots, book, policy.turn(role, group))
