"""`pdserve sim --profile` as a real process: the step engine's prefix cache, P/D block holding and
release, preemption and its vLLM metrics, over HTTP."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import REPO, ProcessGroup, free_port

CPU = ["--profile", "cpu-tiny-llama", "--max-model-len", "512"]


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def metrics(url: str) -> dict[str, dict[str, float]]:
    """{sample name: {engine label: value}} (cache_config_info keyed by its labels)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.labels.get("engine", "")
            if "finished_reason" in sample.labels:
                key += "/" + sample.labels["finished_reason"]
            if sample.name == "vllm:cache_config_info":
                key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            if "le" in sample.labels:
                continue
            out.setdefault(sample.name, {})[key] = sample.value
    return out


async def eventually(check: Callable[[], Awaitable[bool]], what: str, limit: float = 20.0) -> None:
    """Poll until ``check`` holds (a wait for a state, not a timing assertion)."""
    for _ in range(int(limit / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def test_repeated_prompt_hits_full_blocks_as_real_vllm(procs: ProcessGroup) -> None:
    """The numbers real vLLM 0.32 answered on CPU (shared/notes/real-vllm-cpu.md): 170 tokens in
    blocks of 128, three times: cached_tokens 0, 128, 128; 510 tokens queried, 256 hit."""
    sim = procs.start("sim", ["sim", *CPU, "--enable-prompt-tokens-details", "--kv-port", str(free_port())])
    prompt = words(170)
    cached = []
    for stream in (False, True, False):
        body = {"prompt": prompt, "max_tokens": 3, "stream": stream}
        if not stream:
            status, answer = await post(sim.url + "/v1/completions", body)
            assert status == 200, answer
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert answer["usage"]["prompt_tokens_details"]["created_cache_tokens"] is None
            continue
        body["stream_options"] = {"include_usage": True}
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json=body) as r:
            raw = await r.read()
        usage = next(line for line in raw.decode().split("\n\n") if '"usage"' in line)
        cached.append(int(usage.split('"cached_tokens":')[1].split("}")[0]))
        assert '"prompt_tokens_details":{"cached_tokens":' in usage  # a stream's: only the set field
    assert cached == [0, 128, 128]
    m = await metrics(sim.url)
    assert m["vllm:prefix_cache_queries_total"] == {"0": 510}
    assert m["vllm:prefix_cache_hits_total"] == {"0": 256}
    assert m["vllm:prompt_tokens_total"] == {"0": 510}
    assert m["vllm:generation_tokens_total"] == {"0": 9}
    assert m["vllm:time_to_first_token_seconds_count"] == {"0": 3}
    assert m["vllm:inter_token_latency_seconds_count"] == {"0": 6}
    assert m["vllm:request_success_total"] == {"0/length": 3, "0/stop": 0}
    assert m["vllm:kv_cache_usage_perc"] == {"0": 0.0}
    info = next(iter(m["vllm:cache_config_info"]))
    assert "block_size=128" in info and "num_gpu_blocks=512" in info


async def test_prefix_caching_off_and_details_off(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *CPU, "--no-enable-prefix-caching", "--block-size", "32"])
    for _ in range(2):
        status, answer = await post(sim.url + "/v1/completions", {"prompt": words(100), "max_tokens": 2})
        assert status == 200 and answer["usage"]["prompt_tokens_details"] is None
    m = await metrics(sim.url)
    assert m["vllm:prefix_cache_hits_total"] == {"0": 0}
    assert "block_size=32" in next(iter(m["vllm:cache_config_info"]))


async def test_dp_ranks_keep_their_own_caches(procs: ProcessGroup) -> None:
    sim = procs.start(
        "sim", ["sim", *CPU, "--dp-size", "2", "--block-size", "32", "--kv-port", str(free_port())]
    )
    for rank in ("0", "0", "1"):
        status, _ = await post(
            sim.url + "/v1/completions",
            {"prompt": words(70), "max_tokens": 1},
            {"X-data-parallel-rank": rank},
        )
        assert status == 200
    m = await metrics(sim.url)
    assert m["vllm:prefix_cache_hits_total"] == {"0": 64, "1": 0}


async def test_pd_prefill_holds_blocks_until_the_decode_pulled(procs: ProcessGroup) -> None:
    kv_port = free_port()
    prefill = procs.start(
        "prefill", ["sim", *CPU, "--role", "prefill", "--instance-name", "p0", "--kv-port", str(kv_port)]
    )
    decode = procs.start("decode", ["sim", *CPU, "--role", "decode", "--enable-prompt-tokens-details"])
    prompt = words(300)
    status, first = await post(
        prefill.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, first
    kv = first["kv_transfer_params"]
    assert kv["remote_block_ids"] == [[1, 2, 3]]  # the engine's own blocks: 300 tokens in 3 of 128
    assert (kv["remote_host"], kv["remote_port"], kv["remote_engine_id"]) == ("127.0.0.1", kv_port, "p0-dp0")
    held = (await metrics(prefill.url))["vllm:kv_cache_usage_perc"]["0"]
    assert held == pytest.approx(3 / 511)  # held for the decode after the prefill leg finished
    status, second = await post(
        decode.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv}
    )
    assert status == 200, second
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 299  # all but the last token

    async def released() -> bool:
        return (await metrics(prefill.url))["vllm:kv_cache_usage_perc"]["0"] == 0.0

    await eventually(released, "the prefill freed the pulled blocks")
    d = await metrics(decode.url)
    assert d["vllm:external_prefix_cache_queries_total"] == {"0": 300}
    assert d["vllm:external_prefix_cache_hits_total"] == {"0": 300}
    # the same prompt again: the decode has 2 blocks of it cached and pulls only the rest
    _, again = await post(
        prefill.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    await post(
        decode.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": again["kv_transfer_params"]},
    )
    d = await metrics(decode.url)
    assert d["vllm:external_prefix_cache_queries_total"] == {"0": 300 + 44}
    assert d["vllm:prefix_cache_hits_total"] == {"0": 256}
    p = await metrics(prefill.url)
    assert p["vllm:prefix_cache_hits_total"] == {"0": 256}


async def test_mooncake_prefill_holds_blocks_until_the_decode_asks_for_the_transfer(
    procs: ProcessGroup,
) -> None:
    """Mooncake's prefill answers no kv_transfer_params and keeps the blocks for the transfer; the
    decode's request for it goes to the bootstrap address the router named."""
    kv_port = free_port()
    mc = ["--kv-connector", "mooncake"]
    prefill = procs.start(
        "prefill",
        [
            "sim",
            *CPU,
            *mc,
            "--role",
            "prefill",
            "--dp-size",
            "2",
            "--instance-name",
            "p0",
            "--kv-port",
            str(kv_port),
        ],
    )
    decode = procs.start("decode", ["sim", *CPU, *mc, "--role", "decode"])
    prompt = words(300)
    status, first = await post(
        prefill.url + "/v1/completions",
        {
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t-1"},
        },
        {"X-data-parallel-rank": "1"},
    )
    assert status == 200, first
    assert first["kv_transfer_params"] is None  # as vLLM 0.32: the router names the transfer itself
    held = (await metrics(prefill.url))["vllm:kv_cache_usage_perc"]
    assert held["1"] > 0 and held["0"] == 0.0
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": "t-1",
        "remote_engine_id": "p0_dp1",
        "remote_bootstrap_addr": f"http://127.0.0.1:{kv_port}",
    }
    status, second = await post(
        decode.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
    )
    assert status == 200, second

    async def released() -> bool:
        return (await metrics(prefill.url))["vllm:kv_cache_usage_perc"]["1"] == 0.0

    await eventually(released, "the prefill freed the transferred blocks")
    assert (await metrics(decode.url))["vllm:external_prefix_cache_hits_total"] == {"0": 300}


async def test_pd_lease_ends_without_a_decode(procs: ProcessGroup) -> None:
    prefill = procs.start(
        "prefill",
        ["sim", *CPU, "--role", "prefill", "--kv-port", str(free_port()), "--kv-lease-duration", "0.5"],
    )
    status, _ = await post(
        prefill.url + "/v1/completions",
        {"prompt": words(200), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200
    assert (await metrics(prefill.url))["vllm:kv_cache_usage_perc"]["0"] > 0

    async def expired() -> bool:
        return (await metrics(prefill.url))["vllm:kv_cache_usage_perc"]["0"] == 0.0

    await eventually(expired, "the lease ended")


async def test_kv_pressure_preempts_and_every_request_still_completes(procs: ProcessGroup) -> None:
    # 4 usable blocks of 16 tokens; three requests that need 4 blocks each at their end
    sim = procs.start(
        "sim",
        ["sim", "--profile", "cpu-tiny-llama", "--max-model-len", "64", "--block-size", "16",
         "--num-gpu-blocks-override", "5", "--tokens", "40", "--kv-port", str(free_port())],
    )  # fmt: skip
    answers = await asyncio.gather(
        *(post(sim.url + "/v1/completions", {"prompt": words(20, t), "max_tokens": 40}) for t in "abc")
    )
    assert [status for status, _ in answers] == [200, 200, 200]
    assert all(a["usage"]["completion_tokens"] == 40 for _, a in answers)
    m = await metrics(sim.url)
    assert m["vllm:num_preemptions_total"]["0"] >= 1
    assert m["vllm:request_num_preemptions_sum"]["0"] == m["vllm:num_preemptions_total"]["0"]
    assert m["vllm:generation_tokens_total"] == {"0": 120}
    assert m["vllm:num_requests_running"] == {"0": 0} and m["vllm:num_requests_waiting"] == {"0": 0}


def test_a_profile_with_a_missing_or_negative_figure_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    source = (REPO / "pdserve/sim/engine/profiles/cpu-tiny-llama.yaml").read_text()
    for edit, field in (
        (source.replace("  decode_seq_ms:", "  decode_seq:"), "step.decode_seq_ms is missing"),
        (
            source.replace("bytes_per_token: 1024", "bytes_per_token: -1"),
            "kv_transfer.bytes_per_token must not be negative",
        ),
    ):
        bad.write_text(edit)
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "sim", "--profile", str(bad)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done.stderr
        assert field in done.stderr
    small = ["--profile", "cpu-tiny-llama", "--num-gpu-blocks-override", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", *small], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and "--num-gpu-blocks-override" in done.stderr


async def test_moriio_prefill_leg_frees_at_the_end_and_still_names_blocks(procs: ProcessGroup) -> None:
    prefill = procs.start(
        "prefill",
        ["sim", *CPU, "--role", "prefill", "--kv-connector", "moriio", "--kv-port", str(free_port())],
    )
    params = {"do_remote_decode": True, "transfer_id": "t-1"}
    status, answer = await post(
        prefill.url + "/v1/completions", {"prompt": words(200), "max_tokens": 1, "kv_transfer_params": params}
    )
    assert status == 200, answer
    assert answer["kv_transfer_params"]["transfer_id"] == "t-1"
    assert answer["kv_transfer_params"]["remote_block_ids"] == [[1, 2]]
    assert (await metrics(prefill.url))["vllm:kv_cache_usage_perc"] == {"0": 0.0}


async def test_with_a_profile_max_tokens_is_generated_in_full(procs: ProcessGroup) -> None:
    sim = procs.start("sim", ["sim", *CPU, "--kv-port", str(free_port())])
    _, answer = await post(sim.url + "/v1/completions", {"prompt": words(10), "max_tokens": 40})
    assert answer["usage"]["completion_tokens"] == 40  # beyond --tokens (16)
    _, answer = await post(sim.url + "/v1/completions", {"prompt": words(500), "max_tokens": 40})
    assert answer["usage"]["completion_tokens"] == 12  # up to --max-model-len 512
    _, answer = await post(sim.url + "/v1/completions", {"prompt": words(10)})
    assert answer["usage"]["completion_tokens"] == 16
