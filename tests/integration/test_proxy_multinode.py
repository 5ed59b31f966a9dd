"""The proxy in front of multi-node instances played by real `pdserve sim` processes.

Prefill: one DP4 instance over two nodes with an API server per node (perNode, hybrid LB),
listed with ``endpoints``. Decode: one DP4 instance over two nodes behind its leader's API
server (leader mode: the second node is a headless worker), and one single-node DP2 instance.
After 2 x lcm(prefill slots, decode slots) requests every global rank got exactly its share,
each leg went to its node with the local rank; then the leader-mode group loses its worker: the
group breaks, its leader exits, the proxy ejects the whole instance and the client sees no error.
"""

from __future__ import annotations

import math
import time

import pytest

from tests.support.pdstack import FAST_SIM, PDStack, StackFactory, decode_sim, http, proxy_args
from tests.support.procs import Proc, ProcessGroup, free_port, free_ports, wait_http


def node(
    group: ProcessGroup, name: str, role: str, start: int, rpc: int, *extra: str, health: str | None = None
) -> Proc:
    args = ["sim", "--role", role, "--instance-name", name.split(".")[0], "--dp-size", "4"]
    args += ["--data-parallel-size-local", "2", "--data-parallel-start-rank", str(start)]
    args += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc), *FAST_SIM, *extra]
    return group.start(name, args, health=health)


@pytest.fixture(scope="module")
def stack(pd_stack: StackFactory) -> tuple[PDStack, dict[str, Proc]]:
    pd = pd_stack("multinode", {"e": decode_sim(2)}, proxy=None)  # e: a single-node DP2 decode
    p_rpc, d_rpc = free_ports(2)
    hybrid = "--data-parallel-hybrid-lb"
    nodes = {
        "p.0": node(pd.group, "p.0", "prefill", 0, p_rpc, hybrid, health="/sim/stats"),
        "p.1": node(pd.group, "p.1", "prefill", 2, p_rpc, hybrid, health="/sim/stats"),
        "d.0": node(pd.group, "d.0", "decode", 0, d_rpc, health="/sim/stats"),
        "d.1": node(pd.group, "d.1", "decode", 2, d_rpc, "--headless", health="/sim/stats"),
    }
    for name in ("p.0", "p.1", "d.0"):
        wait_http(nodes[name].url + "/health", timeout=30, proc=nodes[name].popen)
    prefill = {
        "name": "p",
        "url": nodes["p.0"].url,
        "dpSize": 4,
        "tpSize": 1,
        "ready": True,
        "endpoints": [
            {"url": nodes["p.0"].url, "firstRank": 0, "ranks": 2},
            {"url": nodes["p.1"].url, "firstRank": 2, "ranks": 2},
        ],
    }
    decode = {"name": "d", "url": nodes["d.0"].url, "dpSize": 4, "tpSize": 1, "ready": True}
    pd.write(pd.table([prefill], [decode, pd.sims["e"]]), wait=False)
    pd.start_proxy()
    return pd, nodes


def by_rank(proc: Proc) -> dict[str, int]:
    return http("GET", proc.url + "/sim/stats").json()["by_rank"]  # type: ignore[no-any-return]


def send(pd: PDStack, n: int) -> None:
    for i in range(n):
        answer = pd.complete(stream=i % 2 == 1)
        assert answer.status == 200, answer.body


def test_every_global_rank_gets_its_exact_share_on_its_node(stack: tuple[PDStack, dict[str, Proc]]) -> None:
    pd, nodes = stack
    prefill_slots, decode_slots = 4, 4 + 2
    n = 2 * math.lcm(prefill_slots, decode_slots)
    send(pd, n)
    per_prefill, per_decode = n // prefill_slots, n // decode_slots
    assert by_rank(nodes["p.0"]) == {"0": per_prefill, "1": per_prefill}
    assert by_rank(nodes["p.1"]) == {"2": per_prefill, "3": per_prefill}  # global ranks, local headers
    assert by_rank(nodes["d.0"]) == {str(r): per_decode for r in range(4)}  # the leader's API: all
    assert by_rank(nodes["d.1"]) == {"2": per_decode, "3": per_decode}  # forwarded to the worker
    assert pd.sims["e"].stats()["by_rank"] == {"0": per_decode, "1": per_decode}
    # node 1's API server was sent local ranks 0 and 1 (it refuses 2 and 3: any 400 would show)
    legs = http("GET", nodes["p.1"].url + "/sim/stats").json()
    assert legs["rejected"] == {} and {r["rank"] for r in legs["recent"]} == {2, 3}
    debug = pd.debug()
    rows = {row["slot"]: row for row in debug["slots"]["prefill"]}
    assert rows["p/3"]["url"] == nodes["p.1"].url
    assert (rows["p/3"]["rank_header"], rows["p/3"]["local_rank"], rows["p/3"]["endpoint_first_rank"]) == (
        1,
        1,
        2,
    )
    assert "local_rank" not in {k for row in debug["slots"]["decode"] for k in row}
    served = http("GET", pd.url + "/routing/served").json()
    p3 = next(s for s in served["slots"] if s["instance"] == "p" and s["dp_rank"] == 3)
    assert (p3["local_rank"], p3["endpoint_first_rank"]) == (1, 2)


def test_a_dead_worker_takes_its_whole_instance_out_without_client_errors(
    stack: tuple[PDStack, dict[str, Proc]],
) -> None:
    pd, nodes = stack
    nodes["d.1"].kill()
    leader = nodes["d.0"].popen
    deadline = time.monotonic() + 15
    while leader.poll() is None:  # vLLM's API server exits once its engine group is dead
        assert time.monotonic() < deadline, "the leader of the broken group did not exit"
        time.sleep(0.05)
    before = pd.sims["e"].stats()["requests"]
    send(pd, 12)  # every decode leg that reaches d is refused: retried on e, d ejected whole
    assert pd.sims["e"].stats()["requests"] - before == 12
    assert "d" in pd.debug()["unreachable"].get("decode", {})
    ejected = {row["slot"] for row in pd.debug()["slots"]["decode"] if row["ejected_for_seconds"] > 0}
    assert ejected == {f"d/{r}" for r in range(4)}


def test_a_decode_sidecar_on_a_node_walks_its_global_ranks_with_local_headers(
    stack: tuple[PDStack, dict[str, Proc]],
) -> None:
    """``--local-decode`` on node 1 of a perNode decode DP4: its slots are dh/2 and dh/3, sent to
    its own API server as local ranks 0 and 1; the prefills come from the table."""
    pd, _ = stack
    group, rpc, hybrid = pd.group, free_port(), "--data-parallel-hybrid-lb"
    dh0 = node(group, "dh.0", "decode", 0, rpc, hybrid, health="/sim/stats")
    dh1 = node(group, "dh.1", "decode", 2, rpc, hybrid, health="/sim/stats")
    for proc in (dh0, dh1):
        wait_http(proc.url + "/health", timeout=30, proc=proc.popen)
    local = [
        "--local-decode",
        dh1.url,
        "--local-dp-size",
        "2",
        "--local-first-rank",
        "2",
        "--local-name",
        "dh",
    ]
    sidecar = group.start(
        "sidecar", proxy_args(pd.routing_file, "--host", "127.0.0.1", *local), health="/ready"
    )
    for _ in range(8):
        answer = http("POST", sidecar.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert answer.status == 200, answer.body
    stats = http("GET", dh1.url + "/sim/stats").json()
    assert stats["by_rank"] == {"2": 4, "3": 4} and stats["rejected"] == {}
    rows = http("GET", sidecar.url + "/debug/routing").json()["slots"]["decode"]
    assert [(r["slot"], r["rank_header"], r["url"]) for r in rows] == [
        ("dh/2", 0, dh1.url),
        ("dh/3", 1, dh1.url),
    ]
