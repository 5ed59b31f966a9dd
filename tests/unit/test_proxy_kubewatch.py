"""The ConfigMap watch's pure parts: backoff, line splitting, events, list answers, the messages
for 401/403/404, and the event sequence applied to a served table (no server needed: the
integration tests run the same code against the real API server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.table.configmap import (
    Backoff,
    ConfigMapWatch,
    LineBuffer,
    WatchGone,
    WatchProblem,
    event_step,
    http_failure,
    list_step,
)
from pdserve.proxy.table.kubeconfig import ApiCredentials, ConfigMapRef
from pdserve.proxy.table.served import ServedTable
from tests.support.tables import table_json as table

REF = ConfigMapRef("ns1", "llama-routing")


def configmap(rv: str, data: dict[str, str] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"kind": "ConfigMap", "metadata": {"name": REF.name, "resourceVersion": rv}}
    if data is not None:
        obj["data"] = data
    return obj


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


# --- backoff and lines ----------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_with_jitter_and_resets() -> None:
    draws = iter([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    backoff = Backoff(base=0.5, cap=4.0, rng=lambda: next(draws))
    assert [backoff.next() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]  # the 4th drew the low end of [2, 4]
    assert [backoff.next() for _ in range(2)] == [4.0, 4.0]  # capped
    backoff.reset()
    assert backoff.next() == 0.5


def test_line_buffer_reassembles_events_split_anywhere() -> None:
    a, b = event("ADDED", configmap("1", {})), event("BOOKMARK", configmap("2", None))
    stream = a + b"\n" + b + b"\n"
    for cut in range(1, len(stream)):
        lines = LineBuffer()
        assert lines.feed(stream[:cut]) + lines.feed(stream[cut:]) == [a, b]
    lines = LineBuffer(limit=10)
    with pytest.raises(WatchProblem, match="larger than 10 bytes"):
        lines.feed(b"x" * 11)


# --- events and list answers ----------------------------------------------------------------------


def test_event_steps() -> None:
    added = event_step(json.loads(event("ADDED", configmap("7", {"routing.json": table(1)}))))
    assert (added.action, added.resource_version, added.text) == ("offer", "7", table(1))
    no_key = event_step(json.loads(event("MODIFIED", configmap("8", {"other": "x"}))))
    assert no_key.action == "offer" and no_key.text is None
    assert no_key.detail == "the ConfigMap has no key routing.json (keys: other)"
    assert event_step(json.loads(event("DELETED", configmap("9", {})))).action == "deleted"
    bookmark = event_step({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}})
    assert (bookmark.action, bookmark.resource_version) == ("bookmark", "12")
    gone = event_step({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}})
    assert (gone.action, gone.detail) == ("gone", "too old")
    err = event_step({"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "etcd down"}})
    assert err.action == "error" and err.reason == "http_error" and "500 etcd down" in err.detail
    assert event_step({"type": "ADDED"}).reason == "bad_event"
    assert event_step({"type": "WEIRD", "object": {}}).reason == "bad_event"


def test_list_answers() -> None:
    empty = {"kind": "ConfigMapList", "metadata": {"resourceVersion": "5"}, "items": []}
    assert list_step(empty) == ("5", None)
    one = {**empty, "items": [configmap("4", {"routing.json": "{}"})]}
    assert list_step(one) == ("5", one["items"][0])
    with pytest.raises(WatchProblem, match="expected a ConfigMapList, got kind 'Status'"):
        list_step({"kind": "Status"})
    with pytest.raises(WatchProblem, match=r"no metadata\.resourceVersion"):
        list_step({"kind": "ConfigMapList", "items": []})


# --- messages for failed requests -----------------------------------------------------------------


def test_forbidden_names_the_account_the_object_and_the_role() -> None:
    body = json.dumps(
        {
            "kind": "Status",
            "code": 403,
            "message": 'configmaps "llama-routing" is forbidden: '
            'User "system:serviceaccount:ns1:llama-router" cannot watch resource "configmaps" '
            'in API group "" in the namespace "ns1"',
        }
    ).encode()
    problem = http_failure(REF, "watch", 403, body, "https://api:6443", None)
    assert problem.reason == "forbidden"
    assert str(problem) == (
        "cannot watch ConfigMap ns1/llama-routing: forbidden: the router's service account "
        'system:serviceaccount:ns1:llama-router cannot watch configmaps "llama-routing" in namespace ns1; '
        "grant get, list and watch on it (Role llama-router with resourceNames [llama-routing] and a "
        "RoleBinding to that account)"
    )
    other = http_failure(ConfigMapRef("a", "tables"), "list", 403, b"{}", "https://api", "alice")
    assert "the router's user alice cannot list" in str(
        other
    ) and "(a Role with resourceNames [tables]" in str(other)


def test_unauthorized_not_found_and_server_errors() -> None:
    unauthorized = http_failure(
        REF, "list", 401, b'{"message":"Unauthorized"}', "https://api:6443", "system:sa"
    )
    assert unauthorized.reason == "unauthorized"
    assert "https://api:6443 does not accept the router's credentials (token of system:sa)" in str(
        unauthorized
    )
    missing = http_failure(REF, "list", 404, b'{"message":"the server could not find it"}', "https://a", None)
    assert missing.reason == "not_found" and "check the namespace ns1 and the name llama-routing" in str(
        missing
    )
    busy = http_failure(REF, "list", 503, b"upstream connect error", "https://a", None)
    assert busy.reason == "http_error" and str(busy).endswith("answered 503: upstream connect error")


# --- the event sequence against a served table ----------------------------------------------------


def watch() -> tuple[ConfigMapWatch, ServedTable, ProxyMetrics]:
    metrics = ProxyMetrics()
    served = ServedTable(metrics, f"configmap {REF}")
    creds = ApiCredentials(server="https://127.0.0.1:1", origin="test")
    return ConfigMapWatch(REF, creds, served, metrics), served, metrics


def test_events_update_keep_or_explain_the_served_table() -> None:
    w, served, metrics = watch()
    assert w._handle(event("ADDED", configmap("10", {"routing.json": table(1)})), "9") == "10"
    assert served.generation == 1 and served.problem is None
    assert w._handle(event("MODIFIED", configmap("11", {"routing.json": '{"kind": '})), "10") == "11"
    assert served.generation == 1  # refused; the last good table serves
    assert served.rejected is not None and served.rejected.startswith(
        "ConfigMap ns1/llama-routing (resourceVersion 11) rejected, keeping generation 1: not valid JSON"
    )
    assert metrics.registry.get_sample_value("pdserve_proxy_routing_reload_errors_total") == 1
    w._handle(event("MODIFIED", configmap("12", {"note": "x"})), "11")
    assert served.generation == 1 and "has no key routing.json (keys: note)" in (served.rejected or "")
    assert w._handle(event("BOOKMARK", {"metadata": {"resourceVersion": "20"}}), "12") == "20"
    w._handle(event("DELETED", configmap("21", {"routing.json": table(1)})), "20")
    assert served.generation == 1
    assert (
        served.problem
        == "ConfigMap ns1/llama-routing was deleted; keeping generation 1 until it is written again"
    )
    assert served.not_ready_reason() is None  # a deleted ConfigMap does not take a serving router out
    assert metrics.registry.get_sample_value("pdserve_proxy_routing_source_up") == 0
    w._handle(event("ADDED", configmap("22", {"routing.json": table(2)})), "21")
    assert served.generation == 2 and served.problem is None and served.rejected is None
    with pytest.raises(WatchGone):
        w._handle(b'{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old"}}', "22")
    with pytest.raises(WatchProblem, match="not JSON"):
        w._handle(b"{nope", "22")
