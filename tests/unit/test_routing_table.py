"""The routing-table contract: every error path names the field, unknown fields are ignored."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from pdserve.routing import (
    API_VERSION,
    Connector,
    RoutingTableError,
    load_routing_table,
    parse_routing_table,
)


def doc(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "RoutingTable",
        "deployment": "llama",
        "generation": 7,
        "connector": {"type": "nixl"},
        "prefill": [
            {
                "name": "llama-prefill-0",
                "url": "http://10.0.0.5:8000",
                "dpSize": 8,
                "tpSize": 1,
                "ready": True,
                "draining": False,
                "kvAddress": "host:10.0.0.5,handshake:6301,notify:61005",
            }
        ],
        "decode": [
            {"name": "llama-decode-0", "url": "http://10.0.0.9:8000", "dpSize": 1, "tpSize": 8, "ready": True}
        ],
    }
    base.update(changes)
    return base


def with_instance(role: str, index: int, **changes: Any) -> dict[str, Any]:
    d = doc()
    inst = d[role][index]
    for key, value in changes.items():
        if value is _DELETE:
            inst.pop(key, None)
        else:
            inst[key] = value
    return d


_DELETE = object()


def error_of(data: object) -> RoutingTableError:
    with pytest.raises(RoutingTableError) as info:
        parse_routing_table(data)
    return info.value


def test_the_issue_example_parses() -> None:
    table = parse_routing_table(doc())
    assert table.deployment == "llama" and table.generation == 7
    assert table.connector == Connector("nixl")
    p = table.prefill[0]
    assert (p.name, p.url, p.dp_size, p.tp_size, p.ready, p.draining) == (
        "llama-prefill-0",
        "http://10.0.0.5:8000",
        8,
        1,
        True,
        False,
    )
    assert p.kv_address == "host:10.0.0.5,handshake:6301,notify:61005"
    d = table.decode[0]
    assert (d.dp_size, d.tp_size, d.draining, d.kv_address) == (1, 8, False, None)


def test_round_trip_and_same_content() -> None:
    table = parse_routing_table(doc())
    again = load_routing_table(table.to_json())
    assert again == table
    bumped = parse_routing_table(doc(generation=8))
    assert bumped.same_content(table) and bumped != table
    changed = parse_routing_table(with_instance("decode", 0, ready=False))
    assert not changed.same_content(table)


def test_unknown_fields_are_ignored() -> None:
    d = doc(future="x")
    d["connector"]["extra"] = 1
    d["prefill"][0]["zone"] = "a"
    assert parse_routing_table(d) == parse_routing_table(doc())


def test_trailing_slash_of_url_is_dropped() -> None:
    table = parse_routing_table(with_instance("decode", 0, url="http://10.0.0.9:8000/"))
    assert table.decode[0].url == "http://10.0.0.9:8000"


def test_defaults_of_optional_fields() -> None:
    table = parse_routing_table(with_instance("decode", 0, tpSize=_DELETE, draining=_DELETE))
    assert table.decode[0].tp_size == 1 and table.decode[0].draining is False
    no_roles = doc()
    del no_roles["prefill"], no_roles["decode"]
    empty = parse_routing_table(no_roles)
    assert empty.prefill == () and empty.decode == ()


def test_revision_is_optional_and_round_trips() -> None:
    """Tables written before revisions parse as one shared revision ""; the writer's survive."""
    old = parse_routing_table(doc())
    assert {i.revision for i in (*old.prefill, *old.decode)} == {""}
    assert "revision" not in json.loads(old.to_json())["decode"][0]  # nothing added to old tables
    assert parse_routing_table(with_instance("decode", 0, revision=None)).decode[0].revision == ""
    new = parse_routing_table(with_instance("decode", 0, revision="a1b2c3d4e5f6"))
    assert new.decode[0].revision == "a1b2c3d4e5f6"
    assert load_routing_table(new.to_json()) == new
    assert not new.same_content(old)  # a revision change is a content change: a new generation


def test_moriio_needs_transfer_mode_and_kv_addresses() -> None:
    d = doc(connector={"type": "moriio", "transferMode": "WRITE"})
    d["decode"][0]["kvAddress"] = "10.0.0.9:7000"
    table = parse_routing_table(d)
    assert table.connector == Connector("moriio", "WRITE")
    assert table.connector.to_dict() == {"type": "moriio", "transferMode": "WRITE"}


@pytest.mark.parametrize(
    ("text", "reason"),
    [("{", "not valid JSON"), (b"\xff\xfe", "not valid JSON"), ("[]", "expected an object, got list")],
)
def test_load_errors(text: str | bytes, reason: str) -> None:
    with pytest.raises(RoutingTableError) as info:
        load_routing_table(text)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("changes", "path", "reason"),
    [
        ({"apiVersion": None}, "apiVersion", "required field is missing"),
        ({"apiVersion": "v1"}, "apiVersion", 'expected "pdserve.io/v1alpha1", got "v1"'),
        ({"apiVersion": 1}, "apiVersion", "expected a string, got 1 (integer)"),
        ({"kind": "Table"}, "kind", 'expected "RoutingTable"'),
        ({"kind": None}, "kind", "required field is missing"),
        ({"deployment": ""}, "deployment", "must not be empty"),
        ({"deployment": 3}, "deployment", "expected a string"),
        ({"deployment": None}, "deployment", "required field is missing"),
        ({"generation": None}, "generation", "required field is missing"),
        ({"generation": -1}, "generation", "expected an integer >= 0, got -1"),
        ({"generation": "7"}, "generation", 'got "7" (string)'),
        ({"generation": True}, "generation", "got true (boolean)"),
        ({"generation": 1.5}, "generation", "got 1.5 (number)"),
        ({"connector": None}, "connector", "required field is missing"),
        ({"connector": "nixl"}, "connector", "expected an object"),
        ({"connector": {}}, "connector.type", "required field is missing"),
        ({"connector": {"type": "lmcache"}}, "connector.type", 'expected one of "nixl", "moriio"'),
        ({"connector": {"type": "moriio"}}, "connector.transferMode", "required for moriio"),
        (
            {"connector": {"type": "moriio", "transferMode": "PUSH"}},
            "connector.transferMode",
            "expected one of",
        ),
        (
            {"connector": {"type": "nixl", "transferMode": "READ"}},
            "connector.transferMode",
            "only valid for moriio",
        ),
        ({"prefill": {}}, "prefill", "expected a list, got object"),
        ({"decode": None}, "decode", "expected a list, got null"),
        ({"decode": ["x"]}, "decode[0]", "expected an object"),
    ],
)
def test_document_errors(changes: dict[str, Any], path: str, reason: str) -> None:
    exc = error_of(doc(**changes))
    assert exc.path == path
    assert reason in exc.reason
    assert str(exc).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("role", "changes", "path", "reason"),
    [
        ("prefill", {"name": _DELETE}, "prefill[0].name", "required field is missing"),
        ("prefill", {"name": ""}, "prefill[0].name", "must not be empty"),
        ("prefill", {"name": 5}, "prefill[0].name", "expected a string"),
        ("decode", {"url": _DELETE}, "decode[0].url", "required field is missing"),
        ("decode", {"url": "10.0.0.9:8000"}, "decode[0].url", "expected an http(s) URL"),
        ("decode", {"url": "ftp://10.0.0.9"}, "decode[0].url", "expected an http(s) URL"),
        ("decode", {"url": "http://"}, "decode[0].url", "expected an http(s) URL"),
        ("decode", {"url": "http://10.0.0.9:port"}, "decode[0].url", "bad port"),
        ("decode", {"dpSize": _DELETE}, "decode[0].dpSize", "required field is missing"),
        ("decode", {"dpSize": 0}, "decode[0].dpSize", "expected an integer >= 1, got 0"),
        ("prefill", {"dpSize": "8"}, "prefill[0].dpSize", 'got "8" (string)'),
        ("prefill", {"dpSize": True}, "prefill[0].dpSize", "got true (boolean)"),
        ("decode", {"tpSize": 0}, "decode[0].tpSize", "expected an integer >= 1"),
        ("decode", {"ready": _DELETE}, "decode[0].ready", "required field is missing"),
        ("decode", {"ready": "yes"}, "decode[0].ready", "expected true or false"),
        ("decode", {"draining": 1}, "decode[0].draining", "expected true or false"),
        ("prefill", {"kvAddress": 7}, "prefill[0].kvAddress", "expected a string"),
        ("decode", {"revision": 3}, "decode[0].revision", "expected a string, got 3 (integer)"),
    ],
)
def test_instance_errors(role: str, changes: dict[str, Any], path: str, reason: str) -> None:
    exc = error_of(with_instance(role, 0, **changes))
    assert exc.path == path
    assert reason in exc.reason


def test_duplicate_instance_names_within_a_role() -> None:
    d = doc()
    d["decode"].append(copy.deepcopy(d["decode"][0]))
    exc = error_of(d)
    assert exc.path == "decode[1].name" and "duplicate instance name" in exc.reason


def test_moriio_instance_without_kv_address() -> None:
    d = doc(connector={"type": "moriio", "transferMode": "READ"})  # decode[0] has no kvAddress
    exc = error_of(d)
    assert exc.path == "decode[0].kvAddress" and "required for the moriio connector" in exc.reason


def test_error_message_is_json_safe() -> None:
    exc = error_of(doc(deployment=["a"]))
    assert json.dumps(str(exc))
