"""build_routing_table: order, readiness, draining, MoRIIO kvAddress, and the generation rule."""

from __future__ import annotations

from typing import Any

from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.kv.moriio import MoriioRequestId
from pdserve.kv.moriio import parse_request_id as parse_moriio_request_id
from pdserve.routing import Connector, Role, build_slot_table, load_routing_table
from tests.support import specs


def pdd_of(**spec: Any) -> PDDeployment:
    shape = {"prefill": {"instances": 2, "dataParallel": 8}, "decode": {"instances": 2, "tensorParallel": 4}}
    return specs.pdd_of(**{"engine": "sim", "image": None, **shape, **spec})


def obs(
    role: Role, index: int, ip: str | None = "10.0.0.1", ready: bool = True, **kw: Any
) -> ObservedInstance:
    return ObservedInstance(role, index, f"r1-{role.value}-{index}", ip, ready, **kw)


P, D = Role.PREFILL, Role.DECODE


def test_instances_sorted_by_index_with_role_shapes() -> None:
    pdd = pdd_of()
    table = build_routing_table(
        pdd,
        [obs(D, 1, "10.0.1.2"), obs(P, 10, "10.0.0.9"), obs(P, 2, "10.0.0.3"), obs(D, 0, "10.0.1.1")],
        None,
    )
    assert [i.name for i in table.prefill] == ["r1-prefill-2", "r1-prefill-10"]
    assert [i.name for i in table.decode] == ["r1-decode-0", "r1-decode-1"]
    assert table.prefill[0].url == "http://10.0.0.3:8000"
    assert (table.prefill[0].dp_size, table.prefill[0].tp_size) == (8, 1)
    assert (table.decode[0].dp_size, table.decode[0].tp_size) == (1, 4)
    assert table.deployment == "r1"
    assert table.connector == Connector("nixl")
    assert all(i.kv_address is None for i in table.prefill + table.decode)
    assert table.generation == 1


def test_readiness_and_draining_are_carried_and_only_routable_slots_are_served() -> None:
    table = build_routing_table(
        pdd_of(),
        [obs(P, 0), obs(P, 1, ready=False), obs(D, 0, draining=True), obs(D, 1)],
        None,
    )
    assert [(i.ready, i.draining) for i in table.prefill] == [(True, False), (False, False)]
    assert [(i.ready, i.draining) for i in table.decode] == [(True, True), (True, False)]
    slots = build_slot_table(table)
    assert {s.instance.name for s in slots.prefill} == {"r1-prefill-0"}
    assert len(slots.prefill) == 8
    assert [s.key for s in slots.decode] == ["r1-decode-1/0"]


def test_instances_without_an_ip_are_left_out() -> None:
    table = build_routing_table(pdd_of(), [obs(P, 0, ip=None, ready=False), obs(P, 1, ip="")], None)
    assert table.prefill == ()


def test_generation_moves_only_when_content_changes() -> None:
    pdd = pdd_of()
    first = build_routing_table(pdd, [obs(P, 0), obs(D, 0)], None)
    same = build_routing_table(pdd, [obs(D, 0), obs(P, 0)], first)
    assert same.generation == first.generation == 1
    assert same == first
    unready = build_routing_table(pdd, [obs(P, 0, ready=False), obs(D, 0)], same)
    assert unready.generation == 2
    draining = build_routing_table(pdd, [obs(P, 0, ready=False), obs(D, 0, draining=True)], unready)
    assert draining.generation == 3
    moved = build_routing_table(pdd, [obs(P, 0, "10.0.0.7", ready=False), obs(D, 0, draining=True)], draining)
    assert moved.generation == 4
    again = build_routing_table(pdd, [obs(P, 0, "10.0.0.7", ready=False), obs(D, 0, draining=True)], moved)
    assert again.generation == 4


def test_generation_follows_a_previous_table_read_back_from_json() -> None:
    pdd = pdd_of()
    previous = load_routing_table(
        build_routing_table(pdd, [obs(P, 0)], None).to_json().replace('"generation": 1', '"generation": 41')
    )
    assert build_routing_table(pdd, [obs(P, 0)], previous).generation == 41
    assert build_routing_table(pdd, [obs(P, 0), obs(D, 0)], previous).generation == 42


def test_moriio_kv_address_is_what_vllm_parses_from_the_request_id() -> None:
    pdd = pdd_of(kvTransfer={"connector": "MoRIIOConnector", "transferMode": "WRITE"})
    table = build_routing_table(pdd, [obs(P, 0, "10.0.0.5"), obs(D, 0, "10.0.1.5")], None)
    assert table.connector == Connector("moriio", "WRITE")
    prefill, decode = table.prefill[0], table.decode[0]
    assert prefill.kv_address == "host:10.0.0.5,handshake:6301,notify:61005"
    assert decode.kv_address == "host:10.0.1.5,handshake:6301,notify:61005"
    # The proxy's request-id encoding round-trips these addresses (vLLM splits on ',' and the first ':').
    assert prefill.kv_address is not None and decode.kv_address is not None
    rid = MoriioRequestId(prefill.kv_address, decode.kv_address, "0" * 32)
    assert parse_moriio_request_id(f"cmpl-{rid}-0-deadbeef") == rid
    # And the table survives the proxy's parser (which requires kvAddress for moriio).
    assert load_routing_table(table.to_json()) == table


def test_moriio_kv_address_follows_extra_config_ports() -> None:
    pdd = pdd_of(
        kvTransfer={
            "connector": "MoRIIOConnector",
            "transferMode": "READ",
            "extraConfig": {"handshake_port": "7000", "notify_port": 62000},
        }
    )
    table = build_routing_table(pdd, [obs(D, 0, "10.0.1.5")], None)
    assert table.decode[0].kv_address == "host:10.0.1.5,handshake:7000,notify:62000"


def test_local_mode_ports_and_ipv6() -> None:
    table = build_routing_table(pdd_of(), [obs(P, 0, "127.0.0.1", port=41001), obs(D, 0, "fd00::5")], None)
    assert table.prefill[0].url == "http://127.0.0.1:41001"
    assert table.decode[0].url == "http://[fd00::5]:8000"
    assert load_routing_table(table.to_json()) == table


def test_each_instance_advertises_the_sizes_it_runs_not_the_spec() -> None:
    # Mid-rollout from DP4 to DP8: the old pod still runs DP4; sending it ranks 4-7 would fail.
    pdd = pdd_of(prefill={"instances": 2, "dataParallel": 8}, decode={"instances": 1, "tensorParallel": 4})
    table = build_routing_table(
        pdd, [obs(P, 0, dp_size=8, tp_size=1), obs(P, 1, dp_size=4, tp_size=2), obs(D, 0)], None
    )
    assert [(i.name, i.dp_size, i.tp_size) for i in table.prefill] == [
        ("r1-prefill-0", 8, 1),
        ("r1-prefill-1", 4, 2),
    ]
    # Unknown sizes (local mode) are the role's spec.
    assert (table.decode[0].dp_size, table.decode[0].tp_size) == (1, 4)
    slots = build_slot_table(table)
    assert sorted(s.key for s in slots.prefill if s.instance.name == "r1-prefill-1") == [
        f"r1-prefill-1/{r}" for r in range(4)
    ]
    # The pod finishing its replacement with the new size is a content change.
    rolled = build_routing_table(pdd, [obs(P, 0, dp_size=8), obs(P, 1, dp_size=8), obs(D, 0)], table)
    assert rolled.generation == table.generation + 1
