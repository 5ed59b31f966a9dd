"""The router's two ports and its keys, with real processes: ``--admin-port`` serves metrics,
``/debug/*`` and profiling only there; engines that require a key (VLLM_API_KEY, as vLLM does)
get the backend key; no key appears in logs, /debug output or metrics. Both HTTP servers. The admin
port listens on its own address (``--admin-host``: 127.0.0.2 here, the pod's address in a client
sidecar whose API stays on localhost)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.pdstack import PDStack, SimSpec, StackFactory, http, router_error
from tests.support.procs import free_port

CLIENT_KEY = "sk-client-admin-3b9e0d57-secret"
BACKEND_KEY = "sk-engine-admin-c41a6f02-secret"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
ADMIN_HOST = "127.0.0.2"


@pytest.fixture(scope="module", params=["hypercorn", "uvicorn"])
def stack(request: pytest.FixtureRequest, pd_stack: StackFactory) -> Iterator[PDStack]:
    server = str(request.param)
    key = (("VLLM_API_KEY", BACKEND_KEY),)
    sims = {"p0": SimSpec("prefill", env=key, kv_port=21100), "d0": SimSpec("decode", env=key, kv_port=21101)}
    pd = pd_stack(f"admin-{server}", sims, routed=(["p0"], ["d0"]), proxy=None, admin_headers=AUTH)
    admin = free_port()
    args = ["proxy", "--routing-file", str(pd.routing_file), "--host", "127.0.0.1", "--http-server", server]
    pd.proxy = pd.group.start(
        "proxy",
        [*args, "--admin-port", str(admin), "--admin-host", ADMIN_HOST, "--log-level", "debug"],
        env={"PDSERVE_PROXY_API_KEY": CLIENT_KEY, "PDSERVE_BACKEND_API_KEY": BACKEND_KEY},
    )
    pd.admin_url = f"http://{ADMIN_HOST}:{admin}"  # type: ignore[attr-defined]
    yield pd
    pd.group.stop_all()  # one server's stack at a time


def admin(stack: PDStack) -> str:
    return str(stack.admin_url)  # type: ignore[attr-defined]


def test_each_port_listens_on_its_own_address_only(stack: PDStack) -> None:
    client_port = stack.url.rsplit(":", 1)[1]
    admin_port = admin(stack).rsplit(":", 1)[1]
    assert http("GET", admin(stack) + "/ready").status in (200, 503)
    for url in (f"http://127.0.0.1:{admin_port}/health", f"http://{ADMIN_HOST}:{client_port}/health"):
        with pytest.raises(OSError):
            http("GET", url)


def test_an_engine_with_a_key_refuses_requests_without_it(stack: PDStack) -> None:
    answer = http("POST", stack.sims["d0"].url + "/v1/completions", {"prompt": "x"})
    assert answer.status == 401 and answer.json() == {"error": "Unauthorized"}
    assert http("GET", stack.sims["d0"].url + "/health").status == 200  # probes stay open, as in vLLM


def test_the_router_serves_clients_with_the_engines_key(stack: PDStack) -> None:
    answer = stack.complete(headers=AUTH)
    assert answer.status == 200, answer.body
    assert stack.complete(headers={}).status == 401


@pytest.mark.parametrize("path", ["/metrics", "/debug/routing"])
def test_admin_paths_answer_only_on_the_admin_port(stack: PDStack, path: str) -> None:
    client = http("GET", stack.url + path, headers=AUTH)
    assert client.status == 404, client.body
    assert router_error(client)[0] == "not_found"
    assert http("GET", admin(stack) + path, headers=AUTH).status == 200


def test_profiling_answers_only_on_the_admin_port(stack: PDStack) -> None:
    assert http("POST", stack.url + "/start_profile", headers=AUTH).status == 404
    answer = http("POST", admin(stack) + "/start_profile", headers=AUTH)
    assert answer.status == 200 and set(answer.json()["instances"]) == {"p0", "d0"}
    assert http("POST", admin(stack) + "/stop_profile", headers=AUTH).status == 200


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_answer_on_both_ports(stack: PDStack, path: str) -> None:
    assert http("GET", stack.url + path).status == 200
    assert http("GET", admin(stack) + path).status == 200


def test_the_admin_port_serves_no_client_api(stack: PDStack) -> None:
    answer = http("POST", admin(stack) + "/v1/completions", {"prompt": "x"}, headers=AUTH)
    assert answer.status == 404
    assert http("GET", admin(stack) + "/v1/models", headers=AUTH).status == 404
    assert http("GET", stack.url + "/v1/models", headers=AUTH).status == 200


def test_no_key_appears_in_logs_debug_output_or_metrics(stack: PDStack) -> None:
    """Runs last in the module: every request above went through these processes at debug level."""
    assert stack.complete(headers=AUTH).status == 200
    assert stack.proxy is not None
    outputs = {
        "proxy log": stack.proxy.log(),
        "debug": http("GET", admin(stack) + "/debug/routing", headers=AUTH).body.decode(),
        "metrics": http("GET", admin(stack) + "/metrics").body.decode(),
        **{f"{name} log": sim.proc.log() for name, sim in stack.sims.items()},
    }
    assert "request id=" in outputs["proxy log"]
    for where, text in outputs.items():
        assert CLIENT_KEY not in text and BACKEND_KEY not in text, where
