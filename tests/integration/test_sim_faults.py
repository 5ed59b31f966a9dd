"""Fault injection of `pdserve sim`, observed from a plain aiohttp client."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.support.procs import ProcessGroup

FAST = ["--ttft-ms", "2", "--itl-ms", "1", "--tokens", "6"]
PREFILL = {"prompt": "a b c", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


async def stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/stats") as r:
        out: dict[str, Any] = await r.json()
        return out


async def set_faults(url: str, faults: list[Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/sim/faults", json={"faults": faults}) as r:
        return r.status, await r.json()


async def wait_for(url: str, key: str, value: int) -> dict[str, Any]:
    for _ in range(200):
        current = await stats(url)
        if current[key] == value:
            return current
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached {value}: {current}")


async def test_http_500(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--fault", "http-500"])
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 500
        assert "http-500" in (await r.json())["error"]["message"]
    current = await stats(sim.url)
    assert current["faults"] == {"http-500": 1} and current["completed"] == 0
    # Never on the control endpoints.
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/health") as r:
        assert r.status == 200


async def test_reset_breaks_the_connection_before_any_answer(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--fault", "reset"])
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with s.post(sim.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                await r.read()
    current = await stats(sim.url)
    assert current["faults"] == {"reset": 1}
    assert current["cancelled"] == 0 and current["in_flight"] == 0
    assert current["recent"][-1]["outcome"] == "aborted"


@pytest.mark.parametrize("stream", [True, False])
async def test_drop_mid_stream_breaks_an_answer_already_started(procs: ProcessGroup, stream: bool) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--fault", "drop-mid-stream"])
    received = b""
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(sim.url + "/v1/completions", json={"prompt": "x", "stream": stream}) as r:
                assert r.status == 200  # the answer had started
                async for chunk in r.content.iter_any():
                    received += chunk
    if stream:
        assert received.count(b"data: ") == 3  # half of six tokens, then the break
        assert b"[DONE]" not in received
    else:
        assert received and not received.endswith(b"}")
    current = await stats(sim.url)
    assert current["faults"] == {"drop-mid-stream": 1} and current["completed"] == 0


async def test_hang_until_the_client_gives_up_then_counts_a_cancel(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--fault", "hang"])
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(sim.url + "/v1/completions", json={"prompt": "x"}) as r:
                await r.read()
    current = await wait_for(sim.url, "cancelled", 1)
    assert current["in_flight"] == 0 and current["faults"] == {"hang": 1}


async def test_slow_first_byte_delays_then_answers(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *FAST, "--fault", "slow-first-byte:400"])
    async with aiohttp.ClientSession() as s:
        # A deadline shorter than the delay sees nothing at all, not even headers ...
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(
                sim.url + "/v1/completions",
                json={"prompt": "x", "stream": True},
                timeout=aiohttp.ClientTimeout(total=0.1),
            ) as r:
                await r.read()
        # ... a patient client gets the whole answer.
        async with s.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == " tok0 tok1"
    current = await wait_for(sim.url, "completed", 1)
    assert current["faults"] == {"slow-first-byte": 2} and current["cancelled"] == 1


async def test_malformed_kv_params_drop_what_the_decode_needs(procs: ProcessGroup) -> None:
    sim = procs.start("p", ["sim", "--role", "prefill", *FAST, "--fault", "malformed-kv-params"])
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/completions", json=PREFILL) as r:
            kv = (await r.json())["kv_transfer_params"]
        assert r.status == 200
        assert "remote_host" not in kv and "remote_port" not in kv and "remote_request_id" not in kv
        assert kv["remote_engine_id"] and kv["remote_block_ids"]
        # Plain requests are not P/D legs: nothing to malform.
        async with s.post(sim.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
    dec = procs.start("d", ["sim", "--role", "decode", *FAST])
    async with aiohttp.ClientSession() as s:
        body = {"prompt": "a b c", "kv_transfer_params": kv}
        async with s.post(dec.url + "/v1/completions", json=body) as r:
            assert r.status == 400
    assert (await stats(dec.url))["malformed_handoff"] == 1
    assert (await stats(sim.url))["faults"] == {"malformed-kv-params": 1}


async def test_faults_change_at_run_time_and_heal(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", "--dp-size", "2", *FAST])
    status, shown = await set_faults(sim.url, [{"kind": "http-500", "rate": 1.0, "ranks": [1]}])
    assert status == 200 and shown["faults"][0]["ranks"] == [1]
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/sim/faults") as r:
            assert (await r.json())["faults"][0]["kind"] == "http-500"
        results = []
        for rank in ("0", "1", "0", "1"):
            async with s.post(
                sim.url + "/v1/completions", json={"prompt": "x"}, headers={"X-data-parallel-rank": rank}
            ) as r:
                results.append(r.status)
        assert results == [200, 500, 200, 500]
        status, _ = await set_faults(sim.url, [])
        assert status == 200
        async with s.post(
            sim.url + "/v1/completions", json={"prompt": "x"}, headers={"X-data-parallel-rank": "1"}
        ) as r:
            assert r.status == 200
        status, err = await set_faults(sim.url, ["explode"])
        assert status == 400 and "unknown kind 'explode'" in err["error"]["message"]
        async with s.post(sim.url + "/sim/faults", data=b"nope") as r:
            assert r.status == 400
        async with s.get(sim.url + "/sim/faults") as r:
            assert (await r.json()) == {"faults": []}  # a bad update changed nothing
    assert (await stats(sim.url))["faults"] == {"http-500": 2}


async def test_seeded_rate_is_reproducible(procs: ProcessGroup) -> None:
    outcomes = []
    for name in ("a", "b"):
        sim = procs.start(name, ["sim", *FAST, "--fault", "http-500:0.5", "--seed", "11"])
        statuses = []
        async with aiohttp.ClientSession() as s:
            for _ in range(12):
                async with s.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                    statuses.append(r.status)
        outcomes.append(statuses)
        assert (await stats(sim.url))["faults"].get("http-500", 0) == statuses.count(500)
    assert outcomes[0] == outcomes[1]
    assert 200 in outcomes[0] and 500 in outcomes[0]
