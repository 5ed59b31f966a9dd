"""The proxy as a decode sidecar (``--local-decode``), through real `pdserve sim` processes.

* the prefill leg goes to the table's prefills, every decode leg to the local engine, whose DP
  ranks the sidecar walks itself (other decodes in the table are never used);
* a failed prefill is retried on another prefill, never on another decode;
* a dead local engine makes the sidecar unready and gets 503 before any prefill is spent;
* the pod marked draining in the table turns the sidecar unready, and it still serves.
"""

from __future__ import annotations

import pytest

from tests.support.pdstack import (
    PDStack,
    Sim,
    StackFactory,
    decode_sim,
    http,
    prefill_sim,
    send_requests,
)


@pytest.fixture(scope="module")
def stack(pd_stack: StackFactory) -> PDStack:
    # d0: the local engine; d1: another decode pod, never used by d0's sidecar
    sims = {"p0": prefill_sim(2), "p1": prefill_sim(2), "d0": decode_sim(4), "d1": decode_sim(4)}
    pd = pd_stack("sidecar", sims, routed=(["p0", "p1"], ["d0", "d1"]), proxy=None)
    local = ["--local-decode", pd.sims["d0"].url, "--local-dp-size", "4", "--local-name", "d0"]
    pd.start_proxy(*local, "--instance-index", "1")
    return pd


def ranks(sim: Sim) -> dict[str, int]:
    return dict(sim.stats()["by_rank"])


def test_prefill_remote_decode_local_and_dp_ranks_walked_here(stack: PDStack) -> None:
    p0, p1, d0, d1 = (stack.sims[n] for n in ("p0", "p1", "d0", "d1"))
    stack.route([p0, p1], [d0, d1])
    assert http("GET", stack.url + "/ready").status == 200
    send_requests(stack.url, 8, "flat")
    # 4 prefill slots, 2 requests each; 4 local ranks, 2 each; the other decode pod got nothing
    assert ranks(p0) == {"0": 2, "1": 2} and ranks(p1) == {"0": 2, "1": 2}
    assert ranks(d0) == {"0": 2, "1": 2, "2": 2, "3": 2}
    assert d1.stats()["by_leg"]["decode"] == 0
    # the walk started at this sidecar's offset: index 1 of 2 decodes over 4 prefill slots -> slot 2
    first = [leg for leg in p0.legs() if leg["request_id"] == "flat-0-p1"]
    assert len(first) == 1 and first[0]["rank"] == 1
    debug = stack.debug()
    assert [s["slot"] for s in debug["slots"]["decode"]] == ["d0/0", "d0/1", "d0/2", "d0/3"]
    assert {s["url"] for s in debug["slots"]["decode"]} == {d0.url}


def test_retries_go_across_prefills_only(stack: PDStack) -> None:
    p0, p1, d0, d1 = (stack.sims[n] for n in ("p0", "p1", "d0", "d1"))
    stack.route([p0, p1], [d0, d1])
    p0.faults("http-500")
    retries = stack.metric("pdserve_proxy_retries_total", role="prefill")
    send_requests(stack.url, 8, "retry")
    assert p1.stats()["by_leg"]["prefill"] == 8  # every request ended on the healthy prefill
    assert d0.stats()["by_leg"]["decode"] == 8 and d1.stats()["by_leg"]["decode"] == 0
    assert stack.metric("pdserve_proxy_retries_total", role="prefill") > retries


def test_draining_pod_turns_unready_and_still_serves(stack: PDStack) -> None:
    p0, d0, d1 = stack.sims["p0"], stack.sims["d0"], stack.sims["d1"]
    stack.route([p0], [d0.instance(draining=True), d1])
    ready = http("GET", stack.url + "/ready")
    assert ready.status == 503 and "draining" in ready.json()["reason"], ready.body
    send_requests(stack.url, 2, "drain")  # what a lagging Service still sends is served
    assert d0.stats()["by_leg"]["decode"] == 2
    served = http("GET", stack.url + "/routing/served").json()
    row = served["instances"]["d0"]
    assert row == {"role": "decode", "in_table": True, "routable": False, "in_flight": 0}
    stack.route([p0], [d0, d1])
    assert http("GET", stack.url + "/ready").status == 200


def test_no_prefill_of_the_local_revision_is_unready(stack: PDStack) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    stack.route([p0.instance(revision="other")], [d0])
    ready = http("GET", stack.url + "/ready")
    assert ready.status == 503 and "no routable prefill of the local engine" in ready.json()["reason"]
    answer = stack.complete()
    assert answer.status == 503 and answer.headers.get("x-pdserve-error") == "no_prefill_slot"
    message = answer.body.decode()
    assert "unversioned revision has 4 routable decode slot(s) but no routable prefill" in message
    stack.route([p0], [d0])


def test_dead_local_engine_makes_the_sidecar_unready_and_spends_no_prefill(stack: PDStack) -> None:
    """Last: it kills the local engine."""
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    stack.route([p0], [d0])
    assert http("GET", stack.url + "/ready").status == 200
    d0.proc.kill()
    ready = http("GET", stack.url + "/ready")
    assert ready.status == 503 and "local engine" in ready.json()["reason"], ready.body
    before = p0.stats()["by_leg"]["prefill"]
    first = stack.complete()  # its prefill is spent, then the connect error ejects the engine
    assert first.status == 503, first.body
    for _ in range(3):
        answer = stack.complete()
        assert answer.status == 503 and answer.headers.get("x-pdserve-error") == "no_decode_slot"
        assert "retry-after" in answer.headers
    assert p0.stats()["by_leg"]["prefill"] == before + 1  # only the first request spent one
