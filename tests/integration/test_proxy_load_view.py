"""``GET /load``: the latencies and outcomes a router saw in a window, for the autoscaler, through
real `pdserve sim` processes; with two worker processes the answer is the whole router's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.deployment.plan.signals import parse_load
from pdserve.wire.load import percentile
from tests.support.pdstack import PDStack, http
from tests.support.procs import ProcessGroup

#: The simulator's fixed timings here: 40 ms to the first token, 10 ms between tokens, 20 tokens.
SIM = ["--ttft-ms", "40", "--itl-ms", "10", "--tokens", "20"]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-worker", "two-workers"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    group = ProcessGroup(Path(tmp_path_factory.mktemp(f"pd-load-{request.param}")))
    pd = PDStack(group, group.log_dir)
    try:
        pd.sim("p0", "prefill", extra=SIM, wait=False)
        pd.sim("d0", "decode", dp_size=2, extra=SIM, wait=False)
        pd.sim("dslow", "decode", extra=["--itl-ms", "500", "--tokens", "8"], wait=False)
        pd.wait_sims()
        pd.write(pd.table([pd.sims["p0"]], [pd.sims["d0"]]), wait=False)
        pd.start_proxy("--workers", str(request.param))
        yield pd
    finally:
        group.stop_all()


def load(stack: PDStack, window: float = 60) -> dict:  # type: ignore[type-arg]
    answer = http("GET", stack.url + f"/load?window={window:g}")
    assert answer.status == 200, answer.body
    return answer.json()  # type: ignore[no-any-return]


def test_the_window_has_each_requests_latencies(stack: PDStack) -> None:
    before = load(stack)["requests"]["ok"]
    arrived = sum(load(stack)["started"])
    for _ in range(12):
        assert stack.complete(stream=True, max_tokens=20).status == 200
    assert stack.complete(stream=False).status == 200
    doc = load(stack)
    report = parse_load("router", doc, "test")
    assert report.error is None, report.error
    assert report.ok - before == 13 and report.failed == 0
    assert sum(report.started) - arrived == 13 and len(report.started) == 60  # second by second
    itl = percentile(report.latency["itl"], 50)
    assert itl is not None and 0.008 <= itl <= 0.05, itl  # the sim's 10 ms, plus the relay's share
    ttft = percentile(report.latency["ttft"], 50)
    prefill = percentile(report.latency["prefill"], 50)
    decode_first = percentile(report.latency["decode_first"], 50)
    assert ttft is not None and prefill is not None and decode_first is not None
    assert ttft >= prefill * 0.9 and ttft >= decode_first * 0.9  # the client waits for both legs
    assert sum(report.latency["itl"].values()) >= 12  # one sample per streamed request
    assert report.in_flight == {"prefill": 0, "decode": 0} and report.queued == 0
    assert doc["window_seconds"] == 60 and doc["covered_seconds"] > 0


def test_legs_in_flight_are_counted_now(stack: PDStack) -> None:
    stack.write(stack.table([stack.sims["p0"]], [stack.sims["dslow"]]))
    try:
        done = threading.Event()

        def slow() -> None:
            stack.complete(stream=True, max_tokens=8)
            done.set()

        thread = threading.Thread(target=slow)
        thread.start()
        seen = 0
        for _ in range(40):
            seen = max(seen, load(stack)["in_flight"]["decode"])
            if seen or done.wait(0.05):
                break
        thread.join()
        assert seen == 1
    finally:
        stack.write(stack.table([stack.sims["p0"]], [stack.sims["d0"]]))


def test_failures_are_counted_apart(stack: PDStack) -> None:
    before = load(stack)["requests"]
    stack.sims["d0"].faults("http-500")
    try:
        assert stack.complete().status >= 500
    finally:
        stack.sims["d0"].faults()
    after = load(stack)["requests"]
    assert after["failed"] == before["failed"] + 1 and after["ok"] == before["ok"]


@pytest.mark.parametrize("window", ["0", "601", "soon"])
def test_a_bad_window_is_a_400_that_says_what_to_send(stack: PDStack, window: str) -> None:
    answer = http("GET", stack.url + f"/load?window={window}")
    assert answer.status == 400
    assert "window must be a number of seconds from 1 to 600" in answer.json()["error"]["message"]


def test_the_same_figures_are_prometheus_metrics(stack: PDStack) -> None:
    assert stack.complete(stream=True, max_tokens=20).status == 200
    assert stack.metric("pdserve_proxy_itl_seconds_count") >= 1
    assert stack.metric("pdserve_proxy_leg_first_byte_seconds_count", role="prefill") >= 1
    assert stack.metric("pdserve_proxy_leg_first_byte_seconds_count", role="decode") >= 1
