"""A third-party P/D router (vllm-router from PyPI) drives `pdserve sim` as it drives vLLM.

Why: the simulator is only useful if real routers accept what it answers; vllm-router finds
DP ranks from /metrics and passes the prefill's kv_transfer_params to the decode unchanged.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support.procs import ProcessGroup, free_port, wait_http

FAST = ["--ttft-ms", "2", "--itl-ms", "1", "--tokens", "4", "--dp-size", "2"]
ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (make install)")


async def test_vllm_router_runs_pd_over_the_simulators(procs: ProcessGroup, tmp_path: Path) -> None:
    prefill = procs.start("p", ["sim", "--role", "prefill", "--instance-name", "p0", *FAST])
    decode = procs.start("d", ["sim", "--role", "decode", "--instance-name", "d0", *FAST])
    port = free_port()
    assert ROUTER is not None
    argv = [ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
            "--kv-connector", "nixl", "--policy", "round_robin", "--log-level", "warning",
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with (tmp_path / "router.log").open("wb") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=30, proc=router)
        async with aiohttp.ClientSession() as s:
            for stream in (False, True, False, True):
                body = {"model": "sim-model", "prompt": "a b c d", "max_tokens": 4, "stream": stream}
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    raw = await r.read()
                assert raw.count(b" tok") == 4  # the four tokens, whatever the framing
            async with s.get(prefill.url + "/sim/stats") as r:
                pstats = await r.json()
            async with s.get(decode.url + "/sim/stats") as r:
                dstats = await r.json()
    finally:
        router.terminate()
        router.wait(10)
    assert pstats["by_rank"] == {"0": 2, "1": 2} and pstats["by_leg"]["prefill"] == 4
    assert dstats["by_rank"] == {"0": 2, "1": 2} and dstats["by_leg"]["decode"] == 4
    assert dstats["malformed_handoff"] == 0
    answers = {r["request_id"]: r["kv_answer"] for r in pstats["recent"]}
    for received in dstats["recent"]:
        assert received["kv_transfer_params"] == answers[received["request_id"]]
