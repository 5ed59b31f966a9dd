"""The autoscaler's signals, read from what the routers and the engines answer (pure).

Two sources, each read by whoever is closest to it:

* every Ready router's ``GET /load?window=S`` (pdserve.wire.load): the latencies its clients saw,
  its requests' outcomes, legs in flight and requests queued. Only the routers see a request
  whole (TTFT as the client sees it, the decode stream's gaps), and one router pod answers for
  all its worker processes; the histograms of every router add up to the deployment's.
* every engine's own ``/metrics`` (vLLM's ``vllm:num_requests_waiting``, ``num_requests_running``,
  ``kv_cache_usage_perc``, one series per DP rank): the queue inside the engine, which no router
  sees. The operator (locally: ``pdserve up``'s supervisor) reads them, not the routers: it
  already knows every engine pod and its address, reads each once per decision however many
  routers there are (with decode sidecars, one router per decode), and the routers stay out of
  the business of scraping.

:func:`parse_load` and :func:`parse_engine_metrics` turn the answers into values and refuse what
they cannot read (a report that says so, never an exception), :func:`combine` adds them up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.deployment.plan.fetch import Get, GetError, get_json
from pdserve.wire.load import LATENCIES, Counts, add_counts, add_series, counts_from_json, started_from_json

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RouterLoad:
    """One router's ``/load`` answer, or why it could not be read (``error``)."""

    router: str
    window_seconds: float = 0.0
    covered_seconds: float = 0.0
    ok: int = 0
    failed: int = 0
    started: tuple[int, ...] = ()  # requests that arrived, per second, oldest first
    latency: Mapping[str, Counts] = field(default_factory=dict)
    in_flight: Mapping[str, int] = field(default_factory=dict)
    queued: int = 0
    error: str | None = None


@dataclass(frozen=True)
class EngineLoad:
    """One engine API server's ``/metrics`` (all its DP ranks), or why it could not be read."""

    instance: str
    role: str
    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None  # mean over its ranks
    error: str | None = None


@dataclass(frozen=True)
class Signals:
    """Everything one decision is made on, summed over the routers and engines that answered."""

    window_seconds: float
    covered_seconds: float
    routers: int  # routers that answered
    ok: int
    failed: int
    latency: Mapping[str, Counts]
    in_flight: Mapping[str, int]
    queued: int
    waiting: Mapping[str, int]  # per role, from the engines
    running: Mapping[str, int]
    kv_usage: Mapping[str, float | None]  # per role, mean over the engines that answered
    engines: Mapping[str, int]  # per role, engines that answered
    started: tuple[int, ...] = ()  # requests that arrived at the routers, per second, oldest first
    problems: tuple[str, ...] = ()  # routers and engines that could not be read

    @property
    def requests(self) -> int:
        return self.ok + self.failed

    @property
    def rate(self) -> float:
        return self.requests / self.covered_seconds if self.covered_seconds > 0 else 0.0

    @property
    def known(self) -> bool:
        """Some router answered: the traffic is known."""
        return self.routers > 0

    @property
    def idle(self) -> bool:
        """No request ended, none is in flight or queued: the traffic needs nothing."""
        return self.known and self.requests == 0 and not any(self.in_flight.values()) and self.queued == 0


def parse_load(router: str, doc: object, deployment: str) -> RouterLoad:
    """A router's ``/load`` answer; one for another deployment counts as unreadable."""
    if not isinstance(doc, Mapping):
        return RouterLoad(router, error="/load did not answer a JSON object")
    served = doc.get("deployment")
    if served is not None and served != deployment:
        return RouterLoad(router, error=f"serves deployment {served!r}, not {deployment!r}")
    try:
        latency_doc = doc.get("latency") or {}
        if not isinstance(latency_doc, Mapping):
            raise ValueError("latency is not an object")
        latency = {kind: counts_from_json(latency_doc.get(kind, {})) for kind in LATENCIES}
        requests = doc.get("requests") or {}
        in_flight = doc.get("in_flight") or {}
        if not isinstance(requests, Mapping) or not isinstance(in_flight, Mapping):
            raise ValueError("requests and in_flight must be objects")
        return RouterLoad(
            router,
            window_seconds=_number(doc.get("window_seconds"), "window_seconds"),
            covered_seconds=_number(doc.get("covered_seconds"), "covered_seconds"),
            ok=_count(requests.get("ok", 0), "requests.ok"),
            failed=_count(requests.get("failed", 0), "requests.failed"),
            started=tuple(started_from_json(doc.get("started", []))),
            latency=latency,
            in_flight={role: _count(in_flight.get(role, 0), f"in_flight.{role}") for role in ROLES},
            queued=_count(doc.get("queued", 0), "queued"),
        )
    except ValueError as exc:
        return RouterLoad(router, error=f"unreadable /load: {exc}")


def parse_engine_metrics(instance: str, role: str, text: str) -> EngineLoad:
    """The queue and KV use of one engine API server from its Prometheus text."""
    waiting = running = 0
    usage: list[float] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:num_requests_waiting":
                    waiting += int(sample.value)
                elif sample.name == "vllm:num_requests_running":
                    running += int(sample.value)
                elif sample.name == "vllm:kv_cache_usage_perc":
                    usage.append(float(sample.value))
    except (ValueError, TypeError) as exc:
        return EngineLoad(instance, role, error=f"unreadable /metrics: {exc}")
    return EngineLoad(instance, role, waiting, running, sum(usage) / len(usage) if usage else None)


async def read_signals(
    get: Get,
    deployment: str,
    routers: Sequence[tuple[str, str]],
    engines: Sequence[tuple[str, str, str]],
    window: float,
) -> Signals:
    """Every router's ``/load`` and every engine's ``/metrics`` at once; ``routers`` are (name,
    base URL), ``engines`` (instance, role, base URL) of the API servers to read."""

    async def load(name: str, base: str) -> RouterLoad:
        doc, problem = await get_json(get, f"{base}/load?window={window:g}")
        return RouterLoad(name, error=problem) if problem else parse_load(name, doc, deployment)

    async def metrics(instance: str, role: str, base: str) -> EngineLoad:
        url = f"{base}/metrics"
        try:
            status, body = await get(url)
        except GetError as exc:
            return EngineLoad(instance, role, error=f"{url} unreachable: {exc}")
        if status != 200:
            return EngineLoad(instance, role, error=f"{url} answered {status}")
        return parse_engine_metrics(instance, role, body)

    loads = await asyncio.gather(*(load(n, u) for n, u in routers))
    gauges = await asyncio.gather(*(metrics(i, r, u) for i, r, u in engines))
    return combine(window, loads, gauges)


def combine(window: float, routers: Sequence[RouterLoad], engines: Iterable[EngineLoad]) -> Signals:
    """The deployment's signals (``routers`` 0: no router answered, nothing is known of the traffic)."""
    answered = [r for r in routers if r.error is None]
    problems = [f"router {r.router}: {r.error}" for r in routers if r.error is not None]
    latency: dict[str, Counts] = {kind: {} for kind in LATENCIES}
    for report in answered:
        for kind, counts in report.latency.items():
            add_counts(latency[kind], counts)
    started: list[int] = []
    for report in answered:
        started = add_series(started, report.started)
    waiting = dict.fromkeys(ROLES, 0)
    running = dict.fromkeys(ROLES, 0)
    usage: dict[str, list[float]] = {role: [] for role in ROLES}
    counted = dict.fromkeys(ROLES, 0)
    for engine in engines:
        if engine.error is not None:
            problems.append(f"engine {engine.instance}: {engine.error}")
            continue
        counted[engine.role] += 1
        waiting[engine.role] += engine.waiting
        running[engine.role] += engine.running
        if engine.kv_usage is not None:
            usage[engine.role].append(engine.kv_usage)
    return Signals(
        window_seconds=window,
        covered_seconds=min((r.covered_seconds for r in answered), default=0.0),
        routers=len(answered),
        ok=sum(r.ok for r in answered),
        failed=sum(r.failed for r in answered),
        latency=latency,
        in_flight={role: sum(r.in_flight.get(role, 0) for r in answered) for role in ROLES},
        queued=sum(r.queued for r in answered),
        started=tuple(started),
        waiting=waiting,
        running=running,
        kv_usage={role: sum(v) / len(v) if v else None for role, v in usage.items()},
        engines=counted,
        problems=tuple(problems),
    )


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{name} is not a number >= 0: {value!r}")
    return float(value)


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is not an integer >= 0: {value!r}")
    return value
