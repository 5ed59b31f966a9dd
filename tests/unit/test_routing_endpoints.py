"""Multi-node instances in the routing table: ``endpoints`` parse with errors naming the path,
round-trip, are omitted when empty (old tables byte-identical), and every slot resolves to the
endpoint holding its global rank with the rank local to that endpoint."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.routing import (
    API_VERSION,
    Connector,
    Endpoint,
    Instance,
    RoutingTable,
    RoutingTableError,
    Slot,
    build_slot_table,
    load_routing_table,
    parse_routing_table,
)
from pdserve.routing.sidecar import LocalDecode, build_sidecar_slot_table


def endpoints(*ranges: tuple[int, int], kv: bool = False) -> list[dict[str, Any]]:
    return [
        {
            "url": f"http://10.0.1.{n + 1}:8000",
            "firstRank": first,
            "ranks": ranks,
            **({"kvAddress": f"host:10.0.1.{n + 1}"} if kv else {}),
        }
        for n, (first, ranks) in enumerate(ranges)
    ]


def doc(dp_size: int = 16, eps: object = None) -> dict[str, Any]:
    prefill: dict[str, Any] = {
        "name": "ds-prefill-0",
        "url": "http://10.0.1.1:8000",
        "dpSize": dp_size,
        "tpSize": 1,
        "ready": True,
        "draining": False,
    }
    if eps is not None:
        prefill["endpoints"] = eps
    return {
        "apiVersion": API_VERSION,
        "kind": "RoutingTable",
        "deployment": "ds",
        "generation": 3,
        "connector": {"type": "nixl"},
        "prefill": [prefill],
        "decode": [
            {
                "name": "ds-decode-0",
                "url": "http://10.0.2.1:8000",
                "dpSize": 8,
                "tpSize": 1,
                "ready": True,
                "draining": False,
            }
        ],
    }


def error_of(data: object) -> RoutingTableError:
    with pytest.raises(RoutingTableError) as info:
        parse_routing_table(data)
    return info.value


def test_endpoints_parse_and_round_trip_byte_identical() -> None:
    data = doc(16, endpoints((0, 8), (8, 8), kv=True))
    table = parse_routing_table(data)
    inst = table.prefill[0]
    assert inst.endpoints == (
        Endpoint("http://10.0.1.1:8000", 0, 8, "host:10.0.1.1"),
        Endpoint("http://10.0.1.2:8000", 8, 8, "host:10.0.1.2"),
    )
    assert table.to_dict() == data
    assert load_routing_table(table.to_json()) == table


def test_no_endpoints_leaves_every_table_as_it_was() -> None:
    """Single-node instances write no ``endpoints`` key: existing tables and goldens unchanged."""
    data = doc(8)
    table = parse_routing_table(data)
    assert table.prefill[0].endpoints == ()
    assert "endpoints" not in table.to_dict()["prefill"][0]
    assert table.to_dict() == data
    # an empty list is the same as none
    assert parse_routing_table(doc(8, [])).prefill[0].endpoints == ()


@pytest.mark.parametrize(
    ("eps", "dp_size", "path", "reason"),
    [
        ("x", 16, "prefill[0].endpoints", "expected a list"),
        ([7], 16, "prefill[0].endpoints[0]", "expected an object"),
        (endpoints((1, 15)), 16, "prefill[0].endpoints[0].firstRank", "expected 0, got 1"),
        (endpoints((0, 8), (9, 7)), 16, "prefill[0].endpoints[1].firstRank", "ranks 8..8 would have no"),
        (endpoints((0, 8), (6, 10)), 16, "prefill[0].endpoints[1].firstRank", "must not overlap"),
        (endpoints((0, 8), (8, 4)), 16, "prefill[0].endpoints", "serve 12 rank(s) but dpSize is 16"),
        (endpoints((0, 8), (8, 16)), 16, "prefill[0].endpoints", "serve 24 rank(s) but dpSize is 16"),
        ([{"firstRank": 0, "ranks": 8}], 8, "prefill[0].endpoints[0].url", "required field is missing"),
        (
            [{"url": "10.0.0.1:8000", "firstRank": 0, "ranks": 8}],
            8,
            "prefill[0].endpoints[0].url",
            "expected an http(s) URL",
        ),
        (
            [{"url": "http://a:1", "firstRank": -1, "ranks": 8}],
            8,
            "prefill[0].endpoints[0].firstRank",
            "expected an integer >= 0",
        ),
        (
            [{"url": "http://a:1", "firstRank": 0, "ranks": 0}],
            8,
            "prefill[0].endpoints[0].ranks",
            "expected an integer >= 1",
        ),
        (
            [{"url": "http://a:1", "firstRank": 0, "ranks": "8"}],
            8,
            "prefill[0].endpoints[0].ranks",
            'got "8" (string)',
        ),
        (
            [{"url": "http://a:1", "firstRank": 0, "ranks": 8, "kvAddress": 5}],
            8,
            "prefill[0].endpoints[0].kvAddress",
            "expected a string",
        ),
    ],
)
def test_endpoint_errors_name_the_path(eps: object, dp_size: int, path: str, reason: str) -> None:
    err = error_of(doc(dp_size, eps))
    assert err.path == path
    assert reason in err.reason


def test_slot_resolves_to_its_endpoint_and_local_rank() -> None:
    inst = parse_routing_table(doc(16, endpoints((0, 8), (8, 8), kv=True))).prefill[0]
    for rank in range(16):
        slot = Slot(inst, rank)
        node = rank // 8
        assert slot.key == f"ds-prefill-0/{rank}"  # the slot keeps its global rank
        assert slot.url == f"http://10.0.1.{node + 1}:8000"
        assert slot.local_rank == rank - 8 * node
        assert slot.rank_header == rank - 8 * node
        assert slot.kv_address == f"host:10.0.1.{node + 1}"
        assert slot.local_dp_size == 8


def test_endpoint_without_kv_address_falls_back_to_the_instance() -> None:
    ep = (Endpoint("http://a:1", 0, 1), Endpoint("http://b:1", 1, 1))
    inst = Instance("i", "http://a:1", 2, 1, True, kv_address="host:a", endpoints=ep)
    assert [Slot(inst, r).kv_address for r in range(2)] == ["host:a", "host:a"]
    # one rank per node still sends the header (the instance is data parallel): local rank 0
    assert [(Slot(inst, r).url, Slot(inst, r).rank_header) for r in range(2)] == [
        ("http://a:1", 0),
        ("http://b:1", 0),
    ]


def test_api_urls_cover_every_node() -> None:
    inst = parse_routing_table(doc(16, endpoints((0, 4), (4, 4), (8, 8)))).prefill[0]
    assert inst.api_urls() == ("http://10.0.1.1:8000", "http://10.0.1.2:8000", "http://10.0.1.3:8000")
    assert Instance("s", "http://s:1", 8).api_urls() == ("http://s:1",)


def test_sidecar_on_a_node_walks_its_global_ranks_with_local_headers() -> None:
    """A decode sidecar on node 1 of a perNode DP8 (2 x 4) decode instance."""
    table = RoutingTable(
        "ds",
        1,
        Connector("nixl"),
        (Instance("p", "http://p:1", 2, 1, True),),
        (
            Instance(
                "d",
                "http://10.0.2.1:8000",
                8,
                1,
                True,
                kv_address="host:d",
                endpoints=(
                    Endpoint("http://10.0.2.1:8000", 0, 4, "host:n0"),
                    Endpoint("http://10.0.2.2:8000", 4, 4, "host:n1"),
                ),
            ),
        ),
    )
    local = LocalDecode("http://127.0.0.1:8100", 4, name="d", first_rank=4)
    slots = build_sidecar_slot_table(table, local)
    assert [s.key for s in slots.decode] == ["d/4", "d/5", "d/6", "d/7"]
    assert {s.url for s in slots.decode} == {"http://127.0.0.1:8100"}
    assert [s.rank_header for s in slots.decode] == [0, 1, 2, 3]
    assert {s.kv_address for s in slots.decode} == {"host:n1"}
    # the leader node's sidecar (first rank 0) of the same instance: local ranks 0..3
    leader = build_sidecar_slot_table(table, LocalDecode("http://127.0.0.1:8000", 4, name="d"))
    assert [(s.key, s.rank_header, s.kv_address) for s in leader.decode] == [
        (f"d/{r}", r, "host:n0") for r in range(4)
    ]
    # a single-node sidecar is as before
    plain = build_sidecar_slot_table(table, LocalDecode("http://127.0.0.1:8000", 2))
    assert [(s.key, s.rank_header, s.url) for s in plain.decode] == [
        ("local/0", 0, "http://127.0.0.1:8000"),
        ("local/1", 1, "http://127.0.0.1:8000"),
    ]
    assert build_slot_table(table).decode[5].url == "http://10.0.2.2:8000"
