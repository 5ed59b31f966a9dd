"""`pdserve sim` as a real process: DP ranks, P/D legs, streaming, stats and metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from pdserve.kv.nixl import prefill_params as nixl_prefill_params
from tests.support.procs import REPO, ProcessGroup

FAST = ["--ttft-ms", "2", "--itl-ms", "1"]
MORIIO_ID = "___prefill_addr_host:10.0.0.5,handshake:6301,notify:61005___decode_addr_host:10.0.0.9,handshake:6301,notify:61005_0123456789abcdef0123456789abcdef"  # noqa: E501


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.json()


def sse_events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


async def test_rank_header_routes_and_out_of_range_is_400(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", "--dp-size", "2", *FAST])
    for rank in ("1", "1", "0"):
        status, body = await post(
            sim.url + "/v1/completions", {"prompt": "hi"}, {"X-data-parallel-rank": rank}
        )
        assert status == 200, body
    status, body = await post(sim.url + "/v1/completions", {"prompt": "hi"}, {"X-data-parallel-rank": "5"})
    assert status == 400
    assert body["error"]["message"] == "data_parallel_rank 5 is out of range [0, 2)."
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["role"] == "both" and stats["dp_size"] == 2
    assert stats["requests"] == 3
    assert stats["by_rank"] == {"0": 1, "1": 2}
    assert stats["without_rank_header"] == 0
    assert stats["rejected"] == {"rank_out_of_range": 1}
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/metrics") as r:
        text = await r.text()
    assert 'vllm:request_success_total{engine="1",model_name="sim-model",finished_reason="stop"} 2' in text
    assert 'vllm:num_requests_running{engine="0",model_name="sim-model"} 0' in text


async def test_without_header_the_sim_spreads_over_its_ranks(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", "--dp-size", "3", *FAST])
    for _ in range(6):
        status, _ = await post(sim.url + "/v1/completions", {"prompt": "hi"})
        assert status == 200
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["without_rank_header"] == 6
    assert stats["by_rank"] == {"0": 2, "1": 2, "2": 2}


async def test_prefill_answers_nixl_kv_transfer_params(procs: ProcessGroup) -> None:
    sim = procs.start("p", ["sim", "--role", "prefill", "--dp-size", "2", "--instance-name", "p0", *FAST])
    body = {
        "prompt": " ".join(["w"] * 40),
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": nixl_prefill_params(),  # as the router sends it
    }
    status, answer = await post(
        sim.url + "/v1/completions", body, {"X-data-parallel-rank": "1", "X-Request-Id": "r1"}
    )
    assert status == 200, answer
    kv = answer["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == "p0-dp1"
    assert kv["remote_request_id"].startswith("cmpl-r1-0-")
    assert kv["remote_block_ids"] == [[1, 2, 3]]  # 40 tokens, 16 per block
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == 5600
    assert kv["remote_num_tokens"] == 40
    assert kv["transfer_mode"] == "pull" and kv["remote_blocks_expiry_time"] is None
    assert answer["choices"][0]["text"] == " tok0"
    assert answer["usage"]["completion_tokens"] == 1

    # The prefill's answer, passed unchanged, is a valid decode request on a decode sim.
    dec = procs.start("d", ["sim", "--role", "decode", *FAST, "--tokens", "3"])
    status, out = await post(
        dec.url + "/v1/completions", {"prompt": body["prompt"], "kv_transfer_params": kv}
    )
    assert status == 200, out
    assert out["choices"][0]["text"] == " tok0 tok1 tok2"
    stats = await get_json(dec.url + "/sim/stats")
    assert stats["malformed_handoff"] == 0 and stats["by_leg"]["decode"] == 1
    assert stats["recent"][-1]["kv_transfer_params"] == kv

    # Wrong-role legs are refused, so a misrouting proxy is visible.
    status, err = await post(dec.url + "/v1/completions", body)
    assert status == 400 and "decode instance" in err["error"]["message"]
    # A plain request is served by a prefill instance, as vLLM does.
    status, _ = await post(sim.url + "/v1/completions", {"prompt": "x"})
    assert status == 200
    pstats = await get_json(sim.url + "/sim/stats")
    assert pstats["by_leg"] == {"prefill": 1, "decode": 0, "plain": 1}
    assert pstats["recent"][0]["request_id"] == "r1" and pstats["recent"][0]["rank"] == 1


@pytest.mark.parametrize(
    ("params", "missing"),
    [
        ({"do_remote_prefill": True, "remote_engine_id": "p-dp0", "remote_block_ids": [[1]]}, "remote_host"),
        (
            {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_host": "h", "remote_port": 1},
            "remote_engine_id",
        ),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e"}, "remote_block_ids"),
    ],
)
async def test_malformed_handoff_is_400_and_counted(
    procs: ProcessGroup, params: dict[str, Any], missing: str
) -> None:
    sim = procs.start("d", ["sim", "--role", "decode", *FAST])
    status, err = await post(sim.url + "/v1/completions", {"prompt": "x", "kv_transfer_params": params})
    assert status == 400
    assert missing in err["error"]["message"]
    assert err["error"]["param"] == "kv_transfer_params"
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["malformed_handoff"] == 1
    assert stats["requests"] == 0
    assert stats["recent"][-1]["outcome"] == "malformed_handoff"


MOONCAKE_DECODE = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "transfer_id": "r1-p1",
    "remote_engine_id": "p0_dp1",
    "remote_bootstrap_addr": "http://10.0.0.5:8998",
}


@pytest.mark.parametrize("told", [True, False], ids=["kv-connector", "auto"])
@pytest.mark.parametrize(
    ("drop", "replace", "missing"),
    [
        ("remote_engine_id", {}, "remote_engine_id"),
        ("transfer_id", {}, "transfer_id"),
        (None, {"remote_bootstrap_addr": "10.0.0.5:8998"}, "remote_bootstrap_addr"),
    ],
)
async def test_a_malformed_mooncake_handoff_is_400_and_counted(
    procs: ProcessGroup, told: bool, drop: str | None, replace: dict[str, Any], missing: str
) -> None:
    args = ["sim", "--role", "decode", *FAST, *(["--kv-connector", "mooncake"] if told else [])]
    sim = procs.start("d", args)
    params = {k: v for k, v in MOONCAKE_DECODE.items() if k != drop} | replace
    status, err = await post(sim.url + "/v1/completions", {"prompt": "x", "kv_transfer_params": params})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"
    assert err["error"]["message"].endswith(f"{missing} (real vLLM would wait forever for this KV)")
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["malformed_handoff"] == 1 and stats["requests"] == 0
    status, _ = await post(
        sim.url + "/v1/completions", {"prompt": "x", "kv_transfer_params": MOONCAKE_DECODE}
    )
    assert status == 200


async def test_a_told_mooncake_decode_names_the_missing_bootstrap_address(procs: ProcessGroup) -> None:
    """Without --kv-connector a decode with a transfer id and nothing else of its own reads as
    MoRIIO's (as before Mooncake); told, the simulator names what Mooncake misses."""
    sim = procs.start("d", ["sim", "--role", "decode", "--kv-connector", "mooncake", *FAST])
    params = {k: v for k, v in MOONCAKE_DECODE.items() if k != "remote_bootstrap_addr"}
    status, err = await post(sim.url + "/v1/completions", {"prompt": "x", "kv_transfer_params": params})
    assert status == 400 and "remote_bootstrap_addr" in err["error"]["message"]


async def test_moriio_ids_and_transfer_id_are_recorded(procs: ProcessGroup) -> None:
    sim = procs.start("both", ["sim", "--dp-size", "2", "--instance-name", "m0", *FAST])
    headers = {"X-Request-Id": MORIIO_ID, "X-data-parallel-rank": "1"}
    prefill = {
        "prompt": "a b c",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "tid-1", "remote_dp_size": 1},
    }
    status, answer = await post(sim.url + "/v1/completions", prefill, headers)
    assert status == 200, answer
    kv = answer["kv_transfer_params"]
    assert kv["transfer_id"] == "tid-1"
    assert kv["remote_engine_id"] == "m0-dp1" and kv["remote_block_ids"] == [[1]]
    # WRITE-mode decode: sent before the prefill answered, so no engine or block ids.
    write_decode = {"do_remote_prefill": True, "transfer_id": "tid-1", "remote_engine_id": None}
    status, _ = await post(
        sim.url + "/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": write_decode},
        {"X-Request-Id": MORIIO_ID},
    )
    assert status == 200
    stats = await get_json(sim.url + "/sim/stats")
    legs = [(r["leg"], r["transfer_id"], r["moriio_request_id"]["uid"]) for r in stats["recent"]]
    uid = "0123456789abcdef0123456789abcdef"
    assert legs == [("prefill", "tid-1", uid), ("decode", "tid-1", uid)]
    assert (
        stats["recent"][0]["moriio_request_id"]["prefill_kv_address"]
        == "host:10.0.0.5,handshake:6301,notify:61005"
    )


async def test_streaming_shape_completions_and_chat(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--tokens", "5"])
    async with aiohttp.ClientSession() as s:
        body = {"prompt": "a b", "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(sim.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await r.read())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == 6  # five tokens, then usage
        assert "".join(c["choices"][0]["text"] for c in chunks[:5]) == " tok0 tok1 tok2 tok3 tok4"
        assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["stop"]
        assert chunks[5]["choices"] == [] and chunks[5]["usage"]["completion_tokens"] == 5

        chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2}
        async with s.post(sim.url + "/v1/chat/completions", json=chat) as r:
            events = sse_events(await r.read())
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and len(chunks) == 3  # role chunk, two tokens, no usage
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        async with s.post(sim.url + "/v1/chat/completions", json={**chat, "stream": False}) as r:
            out = await r.json()
        assert out["object"] == "chat.completion" and out["choices"][0]["message"]["content"] == " tok0 tok1"


async def test_bad_requests_get_vllms_errors(procs: ProcessGroup) -> None:
    # vLLM's answers, as recorded (tests/unit/test_vllm_fixtures.py holds every one of them).
    sim = procs.start("sim", ["sim", *FAST])
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert "'type': 'json_invalid'" in error["message"] and error["type"] == "Bad Request"
        for body, status, type_ in (([1], 400, "Bad Request"), ({}, 400, "BadRequestError"),
                                    ({"prompt": "x", "max_tokens": 0}, 400, "BadRequestError"),
                                    ({"prompt": "x", "model": "other"}, 404, "NotFoundError")):  # fmt: skip
            async with s.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == status
                error = (await r.json())["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert (error["code"], error["type"]) == (status, type_)
        async with s.get(sim.url + "/v1/models") as r:
            models = await r.json()
        assert models["data"][0]["id"] == "sim-model" and models["data"][0]["owned_by"] == "vllm"
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["requests"] == 0 and sum(stats["rejected"].values()) == 5


async def test_reset_and_profile(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST])
    await post(sim.url + "/v1/completions", {"prompt": "x"})
    async with aiohttp.ClientSession() as s:
        for path in ("/start_profile", "/stop_profile"):
            async with s.post(sim.url + path) as r:
                assert r.status == 200
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["requests"] == 1 and stats["profile_calls"] == 2 and len(stats["recent"]) == 1
    status, after = await post(sim.url + "/sim/reset", {})
    assert status == 200
    assert after["requests"] == 0 and after["profile_calls"] == 0 and after["recent"] == []
    assert after["by_rank"] == {"0": 0}


async def test_client_disconnect_cancels_the_request(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", "--ttft-ms", "1", "--itl-ms", "200", "--tokens", "50"])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(sim.url + "/v1/completions", json={"prompt": "x", "stream": True})
        await resp.content.readuntil(b"\n\n")  # the first token arrived
        assert (await get_json(sim.url + "/sim/stats"))["in_flight"] == 1
        resp.close()  # the client goes away mid-stream
    for _ in range(100):
        stats = await get_json(sim.url + "/sim/stats")
        if stats["cancelled"]:
            break
        await asyncio.sleep(0.05)
    assert stats["cancelled"] == 1 and stats["in_flight"] == 0 and stats["completed"] == 0
    assert stats["recent"][-1]["outcome"] == "cancelled"


def test_help_documents_every_flag_and_bad_fault_exits_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in ("--role", "--dp-size", "--host", "--port", "--ttft-ms", "--itl-ms", "--tokens", "--model",
                 "--instance-name", "--kv-port", "--fault", "--seed"):  # fmt: skip
        assert flag in out
    assert "fake vLLM server" in out
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", "--fault", "http-500:7", "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "outside [0, 1]" in bad.stderr


async def test_a_second_request_in_flight_with_one_request_id_is_refused(procs: ProcessGroup) -> None:
    """vLLM keys requests by X-Request-Id: two in flight with one id collide (issue 12)."""
    sim = procs.start("sim", ["sim", "--ttft-ms", "500", "--tokens", "2"])
    url = sim.url + "/v1/completions"
    first = asyncio.ensure_future(post(url, {"prompt": "hi"}, {"X-Request-Id": "dup"}))
    await asyncio.sleep(0.2)  # the first is in flight
    status, body = await post(url, {"prompt": "hi"}, {"X-Request-Id": "dup"})
    assert status == 400
    assert body["error"] == {
        "message": "Request id dup already running.",
        "type": "BadRequestError",
        "code": 400,
        "param": None,
    }
    assert (await first)[0] == 200
    assert (await post(url, {"prompt": "hi"}, {"X-Request-Id": "dup"}))[0] == 200  # free again once done
    stats = await get_json(sim.url + "/sim/stats")
    assert stats["rejected"] == {"duplicate_request_id": 1} and stats["completed"] == 2


@pytest.mark.parametrize(
    "extra", [{"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]}, {"prompt": "a", "n": 2}], ids=str
)
async def test_a_pd_leg_that_makes_several_sequences_is_refused(
    procs: ProcessGroup, extra: dict[str, Any]
) -> None:
    """One handoff carries one sequence; real vLLM would hand over the first prompt's KV only."""
    sim = procs.start("sim", ["sim", "--role", "prefill", *FAST])
    body = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}, **extra}
    status, answer = await post(sim.url + "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "kv_transfer_params"
    assert "makes 2 sequences" in answer["error"]["message"]
    plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert (await post(sim.url + "/v1/completions", plain))[0] == 200  # not a P/D leg: served


async def test_echo_puts_the_prompt_before_the_output(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--tokens", "2"])
    status, body = await post(sim.url + "/v1/completions", {"prompt": "say", "echo": True})
    assert status == 200 and body["choices"][0]["text"] == "say tok0 tok1"
    async with aiohttp.ClientSession() as s:
        request = {"prompt": "say", "echo": True, "stream": True}
        async with s.post(sim.url + "/v1/completions", json=request) as r:
            events = sse_events(await r.read())
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["say tok0", " tok1"]
