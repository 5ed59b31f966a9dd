"""The proxy's HTTP surface with real simulators: bad input, auth, keys kept out of logs,
request ids, probes, the routing debug view, model listing and profiler broadcast."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.wire.headers import ERROR_REASON
from tests.support.pdstack import (
    TEST_HTTP_SERVER,
    PDStack,
    decode_sim,
    http,
    module_stack,
    prefill_sim,
    proxy_args,
    router_error,
)

CLIENT_KEY = "sk-client-7f3a9c1e-secret"
BACKEND_KEY = "sk-backend-42d8b6aa-secret"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
MAX_BODY = 4000


stack = module_stack(
    "surface",
    {"p0": prefill_sim(), "d0": decode_sim(2)},
    routed=(["p0"], ["d0"]),
    proxy=["--max-body-bytes", str(MAX_BODY), "--log-level", "debug"],
    env={"PDSERVE_PROXY_API_KEY": CLIENT_KEY, "PDSERVE_BACKEND_API_KEY": BACKEND_KEY},
    admin_headers=AUTH,
)


def test_proxy_serves_on_the_http_server_under_test(stack: PDStack) -> None:
    assert stack.proxy is not None
    assert f"(http server {TEST_HTTP_SERVER}," in stack.proxy.log()
    assert stack.complete(headers=AUTH).status == 200


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": ', 400, "not valid JSON"),
    ("/v1/completions", b'["prompt"]', 400, "must be a JSON object"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "'prompt' is required"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "'max_tokens' must be at least 1"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "3"}', 400, "'max_tokens' must be an integer"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "'stream' must be true or false"),
    ("/v1/chat/completions", b'{"prompt": "x"}', 400, "'messages' is required"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "'messages' must not be empty"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages' must be a list of objects"),
    ("/v1/completions", b"\xff\xfe", 400, "not valid JSON"),
    (
        "/v1/completions",
        json.dumps({"prompt": "x" * MAX_BODY}).encode(),
        413,
        f"larger than {MAX_BODY} bytes",
    ),
]


@pytest.mark.parametrize(("path", "raw", "status", "message"), BAD_REQUESTS)
def test_bad_input_gets_a_specific_openai_error(
    stack: PDStack, path: str, raw: bytes, status: int, message: str
) -> None:
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    answer = http("POST", stack.url + path, raw=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert answer.status == status, answer.body
    _, error = router_error(answer)
    assert message in error["message"]
    assert stack.sims["p0"].stats()["requests"] == 0  # nothing reached a backend
    assert stack.complete(headers=AUTH).status == 200  # and the proxy keeps serving


def test_unknown_route_and_wrong_method(stack: PDStack) -> None:
    missing = http("GET", stack.url + "/v2/nothing", headers=AUTH)
    assert missing.status == 404 and router_error(missing)[0] == "not_found"
    wrong = http("GET", stack.url + "/v1/completions", headers=AUTH)
    assert wrong.status == 405 and router_error(wrong)[0] == "method_not_allowed"


def test_api_key_is_required_except_on_probes(stack: PDStack) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": CLIENT_KEY}):
        answer = stack.complete(headers=headers)
        assert answer.status == 401 and router_error(answer)[0] == "invalid_api_key"
        assert http("GET", stack.url + "/debug/routing", headers=headers).status == 401
    for probe in ("/health", "/ready", "/metrics", "/routing/served"):
        assert http("GET", stack.url + probe).status == 200, probe


def test_routing_served_is_open_and_shows_no_secrets_or_addresses(stack: PDStack) -> None:
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    answer = http("GET", stack.url + "/routing/served")  # no key: the operator carries none
    view = answer.json()
    assert answer.status == 200 and view["generation"] == stack.generation
    assert view["routable"] == {"prefill": 1, "decode": 2}
    assert [(r["instance"], r["dp_rank"]) for r in view["slots"]] == [("p0", 0), ("d0", 0), ("d0", 1)]
    for secret in (CLIENT_KEY, BACKEND_KEY, "http://"):
        assert secret not in answer.body.decode()


def test_backend_key_replaces_the_client_key(stack: PDStack) -> None:
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    assert stack.complete(headers=AUTH).status == 200
    for sim in (stack.sims["p0"], stack.sims["d0"]):
        assert [r["authorization"] for r in sim.stats()["recent"]] == [f"Bearer {BACKEND_KEY}"]


def test_client_authorization_is_forwarded_without_a_backend_key(stack: PDStack) -> None:
    proxy = stack.group.start("proxy-forwarding", proxy_args(stack.routing_file, "--host", "127.0.0.1"))
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    token = "Bearer user-token-123"
    answer = http("POST", proxy.url + "/v1/completions", {"prompt": "x"}, headers={"Authorization": token})
    assert answer.status == 200
    for sim in (stack.sims["p0"], stack.sims["d0"]):
        assert [r["authorization"] for r in sim.stats()["recent"]] == [token]
    proxy.stop()
    assert "user-token-123" not in proxy.log()


def test_request_id_is_kept_or_made(stack: PDStack) -> None:
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    kept = stack.complete(headers={**AUTH, "X-Request-Id": "client-id-1"})
    assert kept.headers["x-request-id"] == "client-id-1"  # the client's own id comes back
    # each engine leg gets its own id, made from the client's (vLLM keys requests by it)
    assert [r["request_id"] for r in stack.sims["p0"].stats()["recent"]] == ["client-id-1-p1"]
    assert [r["request_id"] for r in stack.sims["d0"].stats()["recent"]] == ["client-id-1-d1"]
    assert "request id=client-id-1 " in stack.proxy.log() if stack.proxy else False
    made = stack.complete(headers=AUTH)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    refused = stack.complete(headers={"X-Request-Id": "client-id-2"})  # 401s carry it too
    assert refused.status == 401 and refused.headers["x-request-id"] == "client-id-2"


def test_ready_needs_a_prefill_and_a_decode_slot(stack: PDStack) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    stack.route([p0], [d0.instance(ready=False)])
    ready = http("GET", stack.url + "/ready")
    assert ready.status == 503 and ready.json()["decode_slots"] == 0
    answer = stack.complete(headers=AUTH)
    assert answer.status == 503 and answer.headers["retry-after"] == "1"
    reason, error = router_error(answer)  # vLLM's error shape, the router's reason in a header
    assert (reason, error["code"], error["type"]) == ("no_decode_slot", 503, "ServiceUnavailableError")
    assert error["message"].startswith("no routable decode instance: ")
    assert stack.sims["p0"].stats()["requests"] == 0  # refused before spending a prefill
    stack.route([p0.instance(draining=True)], [d0])
    answer = stack.complete(headers=AUTH)
    assert answer.status == 503 and answer.headers["retry-after"] == "1"
    reason, error = router_error(answer)
    assert reason == "no_prefill_slot"
    assert error["message"] == "no routable prefill instance: none is ready in the routing table"
    assert stack.metric("pdserve_proxy_requests_total", outcome="no_slot") >= 2
    stack.route([p0], [d0])
    ready = http("GET", stack.url + "/ready")
    assert ready.status == 200 and ready.json() == {
        "ready": True,
        "generation": stack.generation,
        "prefill_slots": 1,
        "decode_slots": 2,
    }


def test_debug_routing_shows_the_table_and_slot_counters(stack: PDStack) -> None:
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    before = {row["slot"]: row["requests"] for row in stack.debug(AUTH)["slots"]["decode"]}
    for _ in range(4):
        assert stack.complete(headers=AUTH).status == 200
    view = stack.debug(AUTH)
    assert view["generation"] == stack.generation and view["policy"] == "flat-interleaved"
    assert view["table"]["decode"][0]["name"] == "d0"
    rows = {row["slot"]: row for row in view["slots"]["decode"]}
    assert set(rows) == {"d0/0", "d0/1"}
    for key, row in rows.items():
        assert row["requests"] - before[key] == 2
        assert row["in_flight"] == 0 and row["ejected_for_seconds"] == 0
        assert row["rank_header"] == row["dp_rank"]


def test_models_and_profile_fan_out(stack: PDStack) -> None:
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    models = http("GET", stack.url + "/v1/models", headers=AUTH)
    assert models.status == 200 and models.json()["data"][0]["id"] == "sim-model"
    for path in ("/start_profile", "/stop_profile"):
        answer = http("POST", stack.url + path, headers=AUTH)
        assert answer.status == 200 and answer.json() == {
            "instances": {"p0": {"status": 200}, "d0": {"status": 200}}
        }
    assert stack.sims["p0"].stats()["profile_calls"] == 2 and stack.sims["d0"].stats()["profile_calls"] == 2


def test_metrics_expose_the_documented_families(stack: PDStack) -> None:
    text = http("GET", stack.url + "/metrics").body.decode()
    for family in (
        "pdserve_proxy_requests_total",
        "pdserve_proxy_upstream_requests_total",
        "pdserve_proxy_ttft_seconds_bucket",
        "pdserve_proxy_request_seconds_bucket",
        "pdserve_proxy_in_flight",
        "pdserve_proxy_routing_generation",
        "pdserve_proxy_routing_reloads_total",
        "pdserve_proxy_routing_reload_errors_total",
        "pdserve_proxy_retries_total",
        "pdserve_proxy_ejections_total",
        "pdserve_proxy_handoff_failures_total",
        "pdserve_proxy_deadline_expiries_total",
    ):
        assert f"# TYPE {family.removesuffix('_total').removesuffix('_bucket')}" in text, family


def test_secrets_never_reach_the_log(stack: PDStack) -> None:
    """Runs last in the module: every request above went through this proxy at debug level."""
    assert stack.complete(headers=AUTH).status == 200
    assert stack.proxy is not None
    log = stack.proxy.log()
    assert "request id=" in log  # the log is there and has request lines
    assert CLIENT_KEY not in log and BACKEND_KEY not in log


def test_vllms_schema_refusal_reaches_the_client_in_the_routers_vocabulary(stack: PDStack) -> None:
    """A field the router does not check goes to the engine, which (as vLLM does) answers
    ``Bad Request``; the client gets the router's one name for a 400, the rest unchanged."""
    stack.route([stack.sims["p0"]], [stack.sims["d0"]])
    raw = json.dumps({"prompt": "x", "max_tokens": 2, "temperature": "hot"}).encode()
    answer = http(
        "POST", stack.url + "/v1/completions", raw=raw, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert answer.status == 400, answer.body
    error = json.loads(answer.body)["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "body.temperature", 400)
    assert "'float_parsing'" in error["message"]
    assert ERROR_REASON.lower() not in answer.headers  # the engine refused it, not the router
