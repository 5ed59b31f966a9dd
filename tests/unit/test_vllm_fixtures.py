"""The simulator and the router held to real vLLM's recorded answers (tests/fixtures/vllm-0.32.0/).

No vLLM needed: `make record-vllm-fixtures` recorded the exchanges from real vLLM (prefill
DP1 and decode DP2 with NIXL, see tests/e2e_vllm/record.py). Here every recorded request is
sent again to a simulator (in this process, on loopback) configured like the recorded engines,
and its answer must have the same status, keys, JSON types and stream structure; values may
differ. For the bad inputs the error must match exactly in status, ``type``, ``param`` and an
integer ``code``, and a schema error must name the same pydantic error kind. The router's own
refusals (those it answers without asking vLLM) must look like vLLM's for the same input, in
the router's one vocabulary: ``type`` is vLLM's class name for the status (``BadRequestError``
where vLLM's schema check writes ``Bad Request``), and malformed JSON names line and column
with ``param: "body"`` (vLLM: ``body.<offset>``).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from pdserve.proxy.serving.generation import parse_request
from pdserve.sim.config import SimConfig
from pdserve.sim.engine.profile import load as load_profile
from pdserve.sim.engine.runtime import EngineSetup
from pdserve.sim.engine.scheduler import EngineConfig
from pdserve.sim.payloads import Identity
from pdserve.sim.server import Simulator
from pdserve.wire.openai import VALIDATION_ERROR_TYPE, RequestError, error_type, normalize_error_body
from tests.support.procs import free_port
from tests.support.vllm_fixtures import (
    FIXTURES,
    events_problems,
    load,
    metric_problems,
    names,
    response_problems,
)

MODEL = "tiny"
MAX_MODEL_LEN = 512
ERRORS = [n for n in names() if n.startswith("errors/")]
EXCHANGES = [n for n in names() if n.split("-")[0] in ("prefill", "decode")]
#: Bad inputs the router passes to vLLM (it cannot know the model's name or length, or does
#: not check the field); every other one it refuses itself, and must refuse the way vLLM does.
PASSED_THROUGH = {"errors/unknown-model", "errors/prompt-too-long", "errors/wrong-type-temperature"}
#: Not a body problem: the router sets X-data-parallel-rank itself, the simulator must match vLLM.
RANK_ONLY = {"errors/rank-out-of-range"}


def test_the_fixtures_are_there() -> None:
    index = json.loads((FIXTURES / "index.json").read_text())
    assert index["vllm_version"] == "0.32.0"
    assert {"prefill-completions", "decode-chat-stream", "health", "models", "metrics-decode"} <= set(names())
    assert len(ERRORS) >= 10


@dataclass
class Sims:
    prefill: TestServer
    decode: TestServer
    session: aiohttp.ClientSession

    async def send(self, name: str) -> dict[str, Any]:
        """The recorded request, sent again to the simulator that plays the recorded engine."""
        req = load(name)["request"]
        server = self.prefill if name.startswith("prefill") else self.decode
        data = req["raw"].encode() if "raw" in req else None if "body" not in req else json.dumps(req["body"])
        headers = (
            {"Content-Type": "application/json", **req["headers"]} if data is not None else req["headers"]
        )
        async with self.session.request(
            req["method"], str(server.make_url(req["path"])), data=data, headers=headers
        ) as resp:
            content_type = resp.headers.get("Content-Type", "")
            raw = await resp.read()
        out: dict[str, Any] = {"status": resp.status, "content_type": content_type}
        if "event-stream" in content_type:
            out["events"] = [
                line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
                for line in raw.decode().split("\n")
                if line.startswith("data: ")
            ]
        elif "json" in content_type:
            out["body"] = json.loads(raw)
        else:
            out["text"] = raw.decode()
        return out


def _sim(role: str, dp_size: int, name: str, engine: bool) -> Simulator:
    identity = Identity(MODEL, name, "127.0.0.1", free_port(), max_model_len=MAX_MODEL_LEN)
    setup = None
    if engine:  # the step engine with the profile of the model the fixtures were recorded with
        profile = load_profile("cpu-tiny-llama")
        d = profile.engine
        config = EngineConfig(d.max_num_seqs, d.max_num_batched_tokens, d.block_size, d.num_gpu_blocks, 512)
        setup = EngineSetup(profile, config)
    return Simulator(
        SimConfig(role=role, dp_size=dp_size, ttft_ms=0, itl_ms=0, tokens=4, identity=identity, engine=setup)
    )


@pytest.fixture(params=["fixed", "engine"])
async def sims(request: pytest.FixtureRequest) -> AsyncIterator[Sims]:
    engine = request.param == "engine"
    prefill = TestServer(_sim("prefill", 1, "tiny-prefill-0", engine).app(), host="127.0.0.1")
    decode = TestServer(_sim("decode", 2, "tiny-decode-0", engine).app(), host="127.0.0.1")
    await prefill.start_server()
    await decode.start_server()
    async with aiohttp.ClientSession() as session:
        yield Sims(prefill, decode, session)
    await prefill.close()
    await decode.close()


@pytest.mark.parametrize("name", EXCHANGES)
async def test_simulator_answers_like_vllm(sims: Sims, name: str) -> None:
    expected = load(name)["response"]
    actual = await sims.send(name)
    assert response_problems(expected, actual) == []


@pytest.mark.parametrize("name", ["health", "models"])
async def test_simulator_endpoints_like_vllm(sims: Sims, name: str) -> None:
    expected = load(name)["response"]
    actual = await sims.send(name)
    assert response_problems(expected, actual) == []
    assert actual.get("text", "") == expected.get("text", "")


_PYDANTIC_KIND = re.compile(r"\{'type': '(\w+)', 'loc': '([\w.]+)'")


@pytest.mark.parametrize("name", ERRORS)
async def test_simulator_refuses_bad_input_like_vllm(sims: Sims, name: str) -> None:
    expected = load(name)["response"]
    actual = await sims.send(name)
    assert response_problems(expected, actual) == []
    want, got = expected["body"]["error"], actual["body"]["error"]
    assert (got["type"], got["param"], got["code"]) == (want["type"], want["param"], want["code"])
    assert type(got["code"]) is int
    assert _PYDANTIC_KIND.findall(got["message"]) == _PYDANTIC_KIND.findall(want["message"])


def _router_refusal(name: str) -> RequestError | None:
    """What the router answers to this recorded request without asking any backend (None: it
    passes the request on): pdserve.proxy.serving.generation's own parsing and checks."""
    req = load(name)["request"]
    endpoint = "chat" if req["path"].endswith("chat/completions") else "completions"
    raw = req["raw"].encode() if "raw" in req else json.dumps(req["body"]).encode()
    try:
        parse_request(raw, endpoint)
    except RequestError as exc:
        return exc
    return None


@pytest.mark.parametrize("name", ERRORS)
def test_router_refuses_bad_input_like_vllm(name: str) -> None:
    refusal = _router_refusal(name)
    if name in PASSED_THROUGH | RANK_ONLY:
        assert refusal is None, f"the router refuses {name} itself: {refusal}"
        return
    assert refusal is not None, f"the router passes {name} on; list it in PASSED_THROUGH if intended"
    want = load(name)["response"]
    body = refusal.body()
    assert set(body["error"]) == set(want["body"]["error"])
    param = "body" if name == "errors/invalid-json" else want["body"]["error"]["param"]
    assert (refusal.status, body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (
        want["status"],
        error_type(want["status"]),
        param,
        want["body"]["error"]["code"],
    )
    assert body["error"]["type"] != VALIDATION_ERROR_TYPE


def test_router_names_line_and_column_of_malformed_json() -> None:
    refusal = _router_refusal("errors/invalid-json")
    assert refusal is not None
    assert refusal.message == "request body is not valid JSON at line 1, column 12: Expecting value"


@pytest.mark.parametrize("name", sorted(PASSED_THROUGH | RANK_ONLY))
def test_vllms_refusals_reach_the_client_in_the_routers_vocabulary(name: str) -> None:
    """What the router passes back from vLLM keeps message, param and code; ``type`` is the
    class name for the status (vLLM's schema errors say ``Bad Request``)."""
    want = load(name)["response"]["body"]
    got = json.loads(normalize_error_body(json.dumps(want).encode()))
    assert got["error"] == {**want["error"], "type": error_type(want["error"]["code"])}


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_simulator_metrics_are_vllms(sims: Sims, role: str) -> None:
    """Every metric the simulator exports is one of vLLM's, with its type and label names."""
    from prometheus_client.parser import text_string_to_metric_families

    server = sims.prefill if role == "prefill" else sims.decode
    async with sims.session.get(str(server.make_url("/metrics"))) as resp:
        text = await resp.text()
    ours: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        samples: dict[str, list[str]] = {}
        for sample in family.samples:
            samples.setdefault(sample.name, sorted(sample.labels))
        ours[family.name] = {"type": family.type, "samples": samples}
    assert ours, "the simulator exports no metrics"
    assert metric_problems(load(f"metrics-{role}")["families"], ours) == []


def test_event_comparison_catches_a_missing_usage_chunk() -> None:
    recorded = load("decode-completions-stream")["response"]["events"]
    without_usage = [e for e in recorded if not (isinstance(e, dict) and e.get("usage"))]
    assert events_problems(recorded, without_usage)
    assert events_problems(recorded, recorded) == []
