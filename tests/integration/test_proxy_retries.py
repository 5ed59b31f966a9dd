"""Retries that spend no prefill they need not, through a real proxy in front of real
`pdserve sim` processes, some of them killed (issue 12, part 5c).

* A decode that refuses the connection (its process is gone) is replaced by another decode with
  the same KV handoff: the prefill counts at the simulators equal the successful requests.
* A refused connection ejects every slot of the instance at once, and the retry goes to
  another instance; the instance is not tried again during the cool-down.
* With no reachable decode (or prefill) left, the router answers 503 with Retry-After before
  spending a prefill.

Each test kills simulators of its own (names are not reused: the router remembers which
instances refused connections for ``--eject-seconds``).
"""

from __future__ import annotations

from tests.support.pdstack import (
    PDStack,
    Sim,
    decode_sim,
    module_stack,
    prefill_sim,
    proxy_args,
    send_requests,
)
from tests.support.procs import Proc

# --eject-seconds 10 (the default): unreachable instances stay out meanwhile
stack = module_stack("retries", {"p0": prefill_sim(), "d0": decode_sim()}, routed=(["p0"], ["d0"]))


def dead(stack: PDStack, name: str, role: str, dp_size: int = 1) -> Sim:
    """A simulator that served once and was then killed: its port refuses connections."""
    sim = stack.sim(name, role, dp_size=dp_size)
    sim.proc.kill()
    del stack.sims[name]  # nothing to reset any more
    return sim


def test_unreachable_decode_is_replaced_with_the_same_handoff(stack: PDStack) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    victim = dead(stack, "victim-d", "decode", dp_size=4)
    stack.route([p0], [victim, d0])  # flat order: victim/0, d0/0, victim/1, victim/2, victim/3
    retries = stack.metric("pdserve_proxy_retries_total", role="decode", reason="connect_error")
    refused = stack.metric("pdserve_proxy_upstream_requests_total", role="decode", outcome="connect_error")
    send_requests(stack.url, 10)
    # every request succeeded with ONE prefill each: no prefill was spent on the dead decode
    assert p0.stats()["by_leg"]["prefill"] == 10
    assert d0.stats()["by_leg"]["decode"] == 10 and d0.stats()["malformed_handoff"] == 0
    # one request met the dead instance; its retry reused the handoff of its only prefill
    assert stack.metric("pdserve_proxy_retries_total", role="decode", reason="connect_error") == retries + 1
    answers = {leg["request_id"]: leg["kv_answer"] for leg in p0.legs()}
    reused = [leg for leg in d0.legs() if leg["request_id"].endswith("-d2")]
    assert len(reused) == 1
    rid = reused[0]["request_id"].removesuffix("-d2")
    assert f"{rid}-p2" not in answers
    assert reused[0]["kv_transfer_params"] == answers[f"{rid}-p1"]
    # the whole instance was ejected at once, and no other request was sent to it
    for rank in range(4):
        assert stack.metric("pdserve_proxy_ejections_total", role="decode", slot=f"victim-d/{rank}") == 1
    assert (
        stack.metric("pdserve_proxy_upstream_requests_total", role="decode", outcome="connect_error")
        == refused + 1
    )
    view = stack.debug()
    assert "victim-d" in view["unreachable"]["decode"]
    assert all(
        row["ejected_for_seconds"] > 0
        for row in view["slots"]["decode"]
        if row["slot"].startswith("victim-d/")
    )
    assert "instance ejected: role=decode instance=victim-d slots=4 reason=connect_error" in (
        stack.proxy.log() if stack.proxy else ""
    )


def test_without_handoff_reuse_each_unreachable_decode_costs_a_prefill(stack: PDStack) -> None:
    """--kv-lease-seconds 0: the handoff is never reused, the failed attempt is prefilled again."""
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    victim = dead(stack, "victim-lease", "decode")
    stack.route([p0], [victim, d0])
    proxy: Proc = stack.group.start(
        "proxy-no-lease", proxy_args(stack.routing_file, "--kv-lease-seconds", "0")
    )
    send_requests(proxy.url, 6)
    assert d0.stats()["by_leg"]["decode"] == 6
    assert p0.stats()["by_leg"]["prefill"] == 7  # one new prefill for the request that met the dead decode
    proxy.stop()


def test_no_reachable_decode_answers_503_before_spending_a_prefill(stack: PDStack) -> None:
    p0 = stack.sims["p0"]
    victim = dead(stack, "victim-only-d", "decode")
    stack.route([p0], [victim])
    first = stack.complete()
    assert first.status == 503, first.body  # it found out: one prefill, then no decode to send to
    assert p0.stats()["by_leg"]["prefill"] == 1
    for stream in (False, True, False, True):
        answer = stack.complete(stream=stream)
        assert answer.status == 503 and 1 <= int(answer.headers["retry-after"]) <= 10
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
        assert error["message"].startswith("no routable decode instance: victim-only-d refused connections")
    assert p0.stats()["by_leg"]["prefill"] == 1  # no prefill spent on the four requests


def test_no_reachable_prefill_answers_503_before_anything(stack: PDStack) -> None:
    d0 = stack.sims["d0"]
    victim = dead(stack, "victim-only-p", "prefill")
    stack.route([victim], [d0])
    assert stack.complete().status == 503
    before = stack.metric("pdserve_proxy_upstream_requests_total", role="prefill")
    for stream in (False, True):
        answer = stack.complete(stream=stream)
        assert answer.status == 503 and int(answer.headers["retry-after"]) >= 1
        assert answer.json()["error"]["message"].startswith(
            "no routable prefill instance: victim-only-p refused connections"
        )
    assert stack.metric("pdserve_proxy_upstream_requests_total", role="prefill") == before  # none sent
    assert d0.stats()["requests"] == 0
    assert stack.metric("pdserve_proxy_requests_total", outcome="no_slot") >= 3


def test_unreachable_prefill_retry_goes_to_another_instance(stack: PDStack) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    victim = dead(stack, "victim-p8", "prefill", dp_size=8)
    stack.route([victim, p0], [d0])  # 9 prefill slots, 8 of them on the dead instance
    refused = stack.metric("pdserve_proxy_upstream_requests_total", role="prefill", outcome="connect_error")
    send_requests(stack.url, 9)
    # the first request to meet it ejected all 8 slots; its retry and every later request went to p0
    assert p0.stats()["by_leg"]["prefill"] == 9 and d0.stats()["by_leg"]["decode"] == 9
    assert (
        stack.metric("pdserve_proxy_upstream_requests_total", role="prefill", outcome="connect_error")
        == refused + 1
    )
    assert (
        sum(
            stack.metric("pdserve_proxy_ejections_total", role="prefill", slot=f"victim-p8/{r}")
            for r in range(8)
        )
        == 8
    )
