"""`pdserve sim` playing a multi-node vLLM instance: one real process per node on loopback.

perNode (hybrid LB): each node's API takes its local ranks, vLLM's 400 outside them. leader:
the leader's API takes every global rank and forwards the workers' ranks to the headless
worker that joined it; not ready until every rank joined; a worker that dies breaks the group
(in-flight requests fail, the leader exits as vLLM's API server does). TP/PP across nodes:
node 0 serves once every node joined.
"""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.pdstack import http
from tests.support.procs import REPO, ProcessGroup, free_port, wait_http

FAST = ["--ttft-ms", "2", "--itl-ms", "1", "--tokens", "2"]


def group_args(dp: int, local: int, start: int, rpc: int, *extra: str) -> list[str]:
    return [
        "sim",
        "--dp-size",
        str(dp),
        "--data-parallel-size-local",
        str(local),
        "--data-parallel-start-rank",
        str(start),
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc),
        *FAST,
        *extra,
    ]


def complete(url: str, rank: int | None = None, **body: object) -> tuple[int, dict[str, object]]:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    answer = http("POST", url + "/v1/completions", {"prompt": "hi", **body}, headers=headers)
    return answer.status, answer.json()


def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "process did not exit"
        time.sleep(0.05)
    return proc.returncode


def test_per_node_api_servers_take_local_ranks(procs: ProcessGroup) -> None:
    rpc = free_port()
    hybrid = "--data-parallel-hybrid-lb"
    node0 = procs.start("n0", group_args(4, 2, 0, rpc, hybrid, "--instance-name", "p"), health=None)
    node1 = procs.start("n1", group_args(4, 2, 2, rpc, hybrid, "--instance-name", "p"), health=None)
    for node in (node0, node1):
        wait_http(node.url + "/health", proc=node.popen)
    for node in (node0, node1):
        for rank in (0, 1, 1):
            status, body = complete(node.url, rank)
            assert status == 200, body
        status, body = complete(node.url, 2)
        assert status == 400
        assert body["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."  # type: ignore[index]
    assert http("GET", node0.url + "/sim/stats").json()["by_rank"] == {"0": 1, "1": 2}
    stats = http("GET", node1.url + "/sim/stats").json()
    assert stats["by_rank"] == {"2": 1, "3": 2}  # counted by global rank
    assert stats["group"]["complete"] is True
    # a prefill on node 1's local rank 1 is global engine 3
    status, body = complete(
        node1.url, 1, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}
    )
    assert status == 200, body
    assert body["kv_transfer_params"]["remote_engine_id"] == "p-dp3"  # type: ignore[index]


def test_leader_forwards_to_headless_workers_and_a_dead_worker_breaks_the_group(
    procs: ProcessGroup,
) -> None:
    rpc = free_port()
    leader = procs.start("leader", group_args(4, 2, 0, rpc, "--instance-name", "d"), health="/sim/stats")
    assert http("GET", leader.url + "/health").status == 503  # rank 2 and 3 not joined yet
    worker = procs.start(
        "worker", group_args(4, 2, 2, rpc, "--headless", "--instance-name", "d"), health="/sim/stats"
    )
    wait_http(leader.url + "/health", proc=leader.popen)
    assert http("POST", worker.url + "/v1/completions", {"prompt": "hi"}).status == 404  # headless
    for rank in range(4):
        for stream in (False, True):
            answer = http(
                "POST",
                leader.url + "/v1/completions",
                {"prompt": "hi", "stream": stream},
                {"X-data-parallel-rank": str(rank)},
            )
            assert answer.status == 200, answer.body
    status, body = complete(leader.url, 4)
    assert status == 400 and "out of range [0, 4)" in body["error"]["message"]  # type: ignore[index]
    lead = http("GET", leader.url + "/sim/stats").json()
    assert lead["by_rank"] == {"0": 2, "1": 2, "2": 2, "3": 2}
    assert lead["group"]["forwarded"] == 4 and lead["group"]["joined"] == ["rank:2", "rank:3"]
    work = http("GET", worker.url + "/sim/stats").json()
    assert work["by_rank"] == {"2": 2, "3": 2}
    assert {r["rank"] for r in work["recent"]} == {2, 3}

    # a request in flight on the worker (it hangs there), then the worker dies
    assert http("POST", worker.url + "/sim/faults", {"faults": ["hang"]}).status == 200
    slow = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLIENT, leader.url],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    deadline = time.monotonic() + 10
    while http("GET", worker.url + "/sim/stats").json()["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    worker.kill()
    out, _ = slow.communicate(timeout=20)
    assert out.decode().strip() in ("500", "failed"), out  # vLLM fails what a dead engine held
    assert wait_exit(leader.popen) == 0  # and its API server exits (terminate_if_errored)
    assert "group broken: rank:2, rank:3 left the group" in leader.log()


_SLOW_CLIENT = """
import json, sys, urllib.request, urllib.error
body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", body, method="POST",
    headers={"Content-Type": "application/json", "X-data-parallel-rank": "3"})
try:
    urllib.request.urlopen(req, timeout=15)
    print("200")
except urllib.error.HTTPError as exc:
    print(exc.code)
except Exception:
    print("failed")
"""


def test_a_broken_group_can_stay_up_with_keep_alive(procs: ProcessGroup) -> None:
    rpc = free_port()
    env = {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    leader = procs.start("leader", group_args(2, 1, 0, rpc), health=None, env=env)
    worker = procs.start("worker", group_args(2, 1, 1, rpc, "--headless"), health="/sim/stats", env=env)
    wait_http(leader.url + "/health", proc=leader.popen)
    worker.kill()
    deadline = time.monotonic() + 10
    while http("GET", leader.url + "/health").status != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, body = complete(leader.url, 0)  # even its own rank: the whole engine group is dead
    assert status == 500 and "EngineCore" in body["error"]["message"]  # type: ignore[index]
    assert leader.popen.poll() is None


def test_tp_across_nodes_node0_serves_once_every_node_joined(procs: ProcessGroup) -> None:
    port = free_port()
    tp = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *FAST]
    node0 = procs.start("n0", ["sim", *tp, "--node-rank", "0"], health="/sim/stats")
    assert http("GET", node0.url + "/health").status == 503
    node1 = procs.start("n1", ["sim", *tp, "--node-rank", "1", "--headless"], health="/sim/stats")
    wait_http(node0.url + "/health", proc=node0.popen)
    assert complete(node0.url)[0] == 200
    node1.kill()
    assert wait_exit(node0.popen) == 0


def test_flags_vllm_would_refuse_name_the_flag() -> None:
    def refused(*args: str) -> str:
        run = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "sim", *args],
            capture_output=True,
            cwd=REPO,
            timeout=30,
        )
        assert run.returncode == 2
        return run.stderr.decode()

    assert "--data-parallel-size-local" in refused("--dp-size", "4", "--data-parallel-size-local", "8")
    assert "--data-parallel-start-rank" in refused(
        "--dp-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "3"
    )
    assert "--data-parallel-rpc-port" in refused("--dp-size", "4", "--data-parallel-size-local", "2")
    assert "--headless" in refused(
        "--dp-size", "4", "--data-parallel-size-local", "2", "--headless", "--data-parallel-rpc-port", "1"
    )
    assert "exclude each other" in refused("--headless", "--data-parallel-hybrid-lb")
