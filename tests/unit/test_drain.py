"""When a draining pod may go (pdserve.deployment.plan.drain), on reports parsed from real
/routing/served answers of the proxy's own view, and how the status summarizes the routers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from pdserve.deployment.plan.drain import (
    DrainReason,
    RouterReport,
    drain_verdict,
    parse_served,
    summarize,
)
from pdserve.deployment.plan.rollout import ActionKind, ObservedPod, RolloutPolicy, plan_role
from pdserve.deployment.plan.status import Observation, compute_status
from pdserve.operator.dataplane.routers import fetch_reports, ready_router_addresses
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.table.served import ServedTable, served_view
from pdserve.routing import Role
from tests.support.procs import free_port
from tests.support.tables import instance as inst
from tests.support.tables import table_json

NOW = 1_000.0


def report(pod: str = "r0", generation: int | None = 5, **in_flight: int) -> RouterReport:
    return RouterReport(pod, generation, "llama", dict(in_flight))


def verdict(reports: list[RouterReport], since: float = NOW - 1, left: int | None = 5) -> Any:
    return drain_verdict("d0", left, since, NOW, 30, reports)


def test_every_router_idle_and_past_the_generation_ends_the_drain() -> None:
    v = verdict([report("r0", 5), report("r1", 6, d1=3)])
    assert (v.done, v.reason, v.routers, v.waiting_for) == (True, DrainReason.ROUTERS_IDLE, 2, ())
    assert v.describe() == "routers-idle, 2 routers"


def test_no_ready_router_ends_the_drain_at_once() -> None:
    v = verdict([])
    assert (v.done, v.reason, v.routers) == (True, DrainReason.NO_ROUTERS, 0)


@pytest.mark.parametrize(
    ("reports", "why"),
    [
        ([report("r0", 4)], "r0: serves generation 4 < 5"),
        ([report("r0", 5, d0=2)], "r0: 2 in flight to d0"),
        ([report("r0", None)], "r0: serves no table yet"),
        ([RouterReport("r0", error="http://x unreachable")], "r0: http://x unreachable"),
        ([RouterReport("r0", 5, "llama", {}, frozenset({"d0"}))], "r0: still routes to d0"),
        ([report("r0", 5), report("r1", 4)], "r1: serves generation 4 < 5"),  # one router is enough
    ],
)
def test_a_router_that_still_may_use_the_pod_keeps_the_drain_waiting(
    reports: list[RouterReport], why: str
) -> None:
    v = verdict(reports)
    assert (v.done, v.reason, v.waiting_for) == (False, DrainReason.WAITING, (why,))


def test_unknown_leave_generation_waits() -> None:
    """After an operator restart the generation without the pod is learnt on the next pass."""
    v = verdict([report("r0", 9)], left=None)
    assert not v.done and "not known yet" in v.waiting_for[0]


def test_drain_seconds_is_the_upper_bound() -> None:
    stuck = [RouterReport("r0", error="unreachable"), report("r1", 5, d0=1)]
    assert not verdict(stuck, since=NOW - 29.9).done
    v = verdict(stuck, since=NOW - 30)
    assert (v.done, v.reason) == (True, DrainReason.TIMEOUT)
    assert v.describe() == "timeout, 2 routers (r0: unreachable; r1: 1 in flight to d0)"
    # Idle routers win over the bound when both hold.
    assert verdict([report()], since=NOW - 60).reason is DrainReason.ROUTERS_IDLE


def real_view(generation: int, decode: list[Any], busy: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a proxy's /routing/served answers (its own function), through JSON."""
    served = ServedTable(ProxyMetrics(), "configmap ns/llama-routing")
    assert served.offer(table_json(generation, [inst("p0")], decode), "t")
    book = SlotBook(10)
    for key in busy:
        book.started(Role.DECODE, key)
    return dict(json.loads(json.dumps(served_view(served, book))))


def test_reports_parse_the_proxys_own_view() -> None:
    # d0 draining in generation 7, one stream still on it from an older table.
    doc = real_view(7, [inst("d0", draining=True), inst("d1")], busy=("d0/0",))
    rep = parse_served("r0", doc, "llama")
    assert (rep.answered, rep.generation, rep.deployment) == (True, 7, "llama")
    assert rep.routable == {"p0", "d1"}
    assert rep.in_flight == {"p0": 0, "d0": 1, "d1": 0}
    assert drain_verdict("d0", 7, NOW, NOW, 30, [rep]).waiting_for == ("r0: 1 in flight to d0",)
    # The stream ended and d0 left the table: it may go.
    gone = parse_served("r0", real_view(8, [inst("d1")]), "llama")
    assert drain_verdict("d0", 7, NOW, NOW, 30, [gone]).reason is DrainReason.ROUTERS_IDLE


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ([], "did not answer a JSON object"),
        ({"deployment": "other", "generation": 1, "instances": {}}, "serves deployment 'other'"),
        ({"deployment": "llama", "generation": "1", "instances": {}}, "unreadable generation"),
        ({"deployment": "llama", "generation": 1}, "no instances object"),
        ({"deployment": "llama", "generation": 1, "instances": {"d0": {"in_flight": -1}}}, "in_flight"),
    ],
)
def test_unreadable_answers_are_errors(doc: object, error: str) -> None:
    rep = parse_served("r0", doc, "llama")
    assert not rep.answered and error in str(rep.error)


def test_summary_counts_current_routers_and_the_oldest_generation() -> None:
    reports = [report("r0", 7), report("r1", 6), RouterReport("r2", error="unreachable")]
    s = summarize(reports, 7)
    assert (s.ready, s.current, s.served_generation, s.behind) == (3, 1, 6, 1)
    assert s.to_status() == {"ready": 3, "current": 1, "summary": "1/3"}
    none = summarize([RouterReport("r0", error="unreachable")], 7)
    assert (none.served_generation, none.current, none.behind) == (None, 0, 0)


def test_status_shows_written_and_served_generations() -> None:
    obs = Observation(3, 7, (), 1, 1, routers=summarize([report("r0", 6)], 7))
    status = compute_status(obs, None, "2026-01-01T00:00:00Z")
    assert (status["routingGeneration"], status["servedGeneration"]) == (7, 6)
    assert status["routers"] == {"ready": 1, "current": 0, "summary": "0/1"}
    # Nobody answers: servedGeneration null (the merge patch removes it).
    obs = Observation(3, 7, (), 1, 1, routers=summarize([], 7))
    assert compute_status(obs, status, "t")["servedGeneration"] is None
    # Not asked this pass: the stored values stay.
    kept = compute_status(Observation(3, 7, (), 1, 1), status, "t")
    assert (kept["servedGeneration"], kept["routers"]) == (6, status["routers"])


def test_released_drains_are_deleted_before_the_bound() -> None:
    pods = [ObservedPod(0, "d0", "new", True), ObservedPod(1, "d1", "new", True, draining_since=NOW - 1)]

    def plan(released: dict[str, str]) -> list[tuple[ActionKind, int, str]]:
        p = plan_role(
            Role.DECODE,
            instances=1,
            template_hash="new",
            pods=pods,
            policy=RolloutPolicy(max_unavailable=1, drain_seconds=30),
            now=NOW,
            released=released,
        )
        return [(a.kind, a.index, a.reason) for a in p.actions]

    assert plan({}) == []
    assert plan({"d1": "drained: routers-idle"}) == [(ActionKind.DELETE, 1, "drained: routers-idle")]


def test_only_ready_live_router_pods_with_an_ip_are_asked() -> None:
    def pod(name: str, ready: str = "True", ip: str | None = "127.128.0.9", gone: bool = False) -> Any:
        meta: dict[str, Any] = {"name": name}
        if gone:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}

    pods = [pod("a"), pod("b", ready="False"), pod("c", ip=None), pod("d", gone=True)]
    assert ready_router_addresses(pods) == [("a", "127.128.0.9")]


def test_fetch_reports_over_loopback() -> None:
    """One router answers its view, one answers 500, one port is closed: three reports at once."""

    async def run() -> list[RouterReport]:
        view = real_view(4, [inst("d0")])

        async def answer(_: web.Request) -> web.Response:
            return web.json_response(view)

        async def fail(_: web.Request) -> web.Response:
            return web.Response(status=500)

        app = web.Application()
        app.router.add_get("/routing/served", answer)
        broken = web.Application()
        broken.router.add_get("/routing/served", fail)
        runners = []
        ports = []
        for a in (app, broken):
            runner = web.AppRunner(a)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            ports.append(port)
        try:
            closed = free_port()
            reports = []
            for name, port in (("ok", ports[0]), ("bad", ports[1]), ("closed", closed)):
                reports += await fetch_reports([(name, "127.0.0.1")], port, "llama", 2.0)
            return reports
        finally:
            for runner in runners:
                await runner.cleanup()

    ok, bad, closed = asyncio.run(run())
    assert (ok.answered, ok.generation, ok.routable) == (True, 4, frozenset({"p0", "d0"}))
    assert not bad.answered and "answered 500" in str(bad.error)
    assert not closed.answered and "unreachable" in str(closed.error)
