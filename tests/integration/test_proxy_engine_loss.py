"""Losing an engine costs nothing extra (issue 23), through a real router in front of real
`pdserve sim` processes, some of them killed mid-request:

* the live ranks keep exact shares among themselves while an instance is out;
* a retry after a lost decode connection spends no prefill that no decode can take: requests in
  flight when the only decode dies end 503 after their one prefill;
* a retry routes by the table served *now*, not the one its request started with;
* a failed prefill is retried by the same rule as a failed decode, on a single slot too.

Also run with 2 worker processes (`make test-workers`): the counter and the ejection state are
the router's, not a worker's.
"""

from __future__ import annotations

import threading
import time

from tests.support.pdstack import HttpAnswer, PDStack, Sim, decode_sim, http, module_stack, prefill_sim

# a cool-down longer than any test here: what was found dead stays out meanwhile
stack = module_stack(
    "engine-loss",
    {"p0": prefill_sim(2), "d0": decode_sim(2)},
    routed=(["p0"], ["d0"]),
    proxy=["--eject-seconds", "60"],
)


def killed(sim: Sim) -> None:
    sim.proc.kill()
    sim.proc.popen.wait(10)


def until_unreachable(stack: PDStack, role: str, name: str) -> None:
    """Send requests until the router has found ``name`` dead (at most a few)."""
    for _ in range(20):
        if name in stack.debug()["unreachable"].get(role, {}):
            return
        stack.complete()
    raise AssertionError(f"{name} was never found unreachable: {stack.debug()['unreachable']}")


def concurrently(
    stack: PDStack, n: int, stream: bool = False
) -> tuple[list[threading.Thread], list[HttpAnswer]]:
    answers: list[HttpAnswer] = []

    def one(i: int) -> None:
        body = {"prompt": "hello", "max_tokens": 3, "stream": stream}
        answers.append(
            http("POST", stack.url + "/v1/completions", body, headers={"X-Request-Id": f"loss-{i}"})
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    return threads, answers


def wait_in_flight(sim: Sim, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sim.stats()["in_flight"] < n:
        assert time.monotonic() < deadline, f"{sim.name} never had {n} requests in flight: {sim.stats()}"
        time.sleep(0.02)


def test_one_dead_instance_per_role_leaves_exact_shares_to_the_live_ranks(stack: PDStack) -> None:
    p0, d0 = stack.sims["p0"], stack.sims["d0"]
    gone_p = stack.sim("gone-p", "prefill", dp_size=2)
    gone_d = stack.sim("gone-d", "decode", dp_size=2)
    stack.route([p0, gone_p], [d0, gone_d])  # flat orders: p0/0, gone-p/0, p0/1, gone-p/1 (and d)
    killed(gone_p)
    killed(gone_d)
    del stack.sims["gone-p"], stack.sims["gone-d"]
    until_unreachable(stack, "prefill", "gone-p")
    until_unreachable(stack, "decode", "gone-d")
    p0.reset()
    d0.reset()
    for i in range(40):
        assert stack.complete(stream=i % 2 == 1).status == 200
    # the dead ranks' turns went to no one in particular: 20 and 20, not 14 and 26
    assert p0.stats()["by_rank"] == {"0": 20, "1": 20}
    assert d0.stats()["by_rank"] == {"0": 20, "1": 20}
    assert p0.stats()["by_leg"]["prefill"] == 40  # and not one prefill more


def test_requests_in_flight_when_the_only_decode_dies_spend_no_second_prefill(stack: PDStack) -> None:
    p0 = stack.sims["p0"]
    doomed = stack.sim("doomed-d", "decode", dp_size=2)
    stack.route([p0], [doomed])
    doomed.faults("slow-first-byte:5000")
    threads, answers = concurrently(stack, 4, stream=True)
    wait_in_flight(doomed, 4)
    killed(doomed)  # every decode connection drops before its first byte
    del stack.sims["doomed-d"]
    for thread in threads:
        thread.join(30)
    assert len(answers) == 4
    for answer in answers:
        assert answer.status == 503, answer.body
        assert answer.json()["error"]["message"].startswith("no routable decode instance: doomed-d")
    assert p0.stats()["by_leg"]["prefill"] == 4  # one each: no retry prefilled for a dead decode
    assert stack.metric("pdserve_proxy_requests_total", outcome="no_slot") >= 4


def test_a_retry_routes_by_the_table_served_now(stack: PDStack) -> None:
    p0 = stack.sims["p0"]
    old = stack.sim("old-d", "decode")
    new = stack.sim("new-d", "decode")
    stack.route([p0], [old])
    old.faults("slow-first-byte:5000")
    threads, answers = concurrently(stack, 1)
    wait_in_flight(old, 1)
    stack.write(stack.table([p0], [new]))  # the operator replaced the decode meanwhile
    killed(old)
    del stack.sims["old-d"]
    threads[0].join(30)
    assert answers[0].status == 200, answers[0].body  # retried on new-d, which it never knew of
    assert new.stats()["by_leg"]["decode"] == 1
    assert p0.stats()["by_leg"]["prefill"] == 2  # the old decode may have pulled the first KV


def test_a_failed_prefill_is_retried_like_a_failed_decode_on_a_single_slot_too(stack: PDStack) -> None:
    d0 = stack.sims["d0"]
    lone = stack.sim("lone-p", "prefill")
    stack.route([lone], [d0])
    lone.faults("http-500")
    answer = stack.complete()
    assert answer.status == 502, answer.body
    # --max-retries 2: three attempts, all on the only prefill slot (none was skipped)
    assert "failed after 3 attempt(s)" in answer.json()["error"]["message"]
    assert lone.stats()["faults"]["http-500"] == 3
    lone.faults()
    assert stack.complete().status == 200  # ejected, yet the last resort: served
