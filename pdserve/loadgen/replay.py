"""One replay from start to end: ask the server what it serves, read the engines' metrics, send the
schedule, read the metrics again, and put every figure into one results document.

The imperative shell over the pure modules; the CLI (``cli.py``) and the benches call
:func:`run_replay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import resource
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp

from pdserve.loadgen import cachemodel
from pdserve.loadgen.client import ClientConfig, Counts, replay
from pdserve.loadgen.engines import EngineWatch, describe
from pdserve.loadgen.metrics import Snapshot, engine_summary, load_series
from pdserve.loadgen.progress import finish, show_progress
from pdserve.loadgen.prompts import BodyOptions, Endpoint
from pdserve.loadgen.results import RequestRecord, Slo, summarize, timeline
from pdserve.loadgen.schedule import Arrival, offered_rate
from pdserve.wire.headers import AUTHORIZATION

PROBE_TIMEOUT_S = 10.0
#: A router that answers /debug/routing with 5xx (still starting) is asked again, once a second.
DISCOVERY_RETRIES = 5
#: p99 send lag above this: the client could not keep the schedule (the figures say so).
SATURATED_LAG_MS = 50.0


class ReplayError(Exception):
    """The replay cannot start; the message says what to do."""


@dataclass(frozen=True)
class ReplayOptions:
    url: str
    endpoint: Endpoint = "completions"
    model: str | None = None
    api_key: str | None = None
    speedup: float = 1.0
    workload: str = "trace"
    slo: Slo = field(default_factory=Slo)
    engine_urls: tuple[str, ...] = ()
    admin_url: str | None = None  # None: the --url itself (a pdserve router serves /debug/routing there)
    metrics_interval_s: float = 1.0
    timeout_s: float = 600.0
    max_connections: int = 0
    ignore_eos: bool = True
    bin_s: float = 1.0
    block_size: int = 16  # of the offline "ideal" prefix reuse figure
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the results' config as given


@dataclass
class ReplayOutcome:
    results: dict[str, Any]
    records: list[RequestRecord]


async def _models(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The server's /v1/models list; ReplayError says what to do when it is not there."""
    target = url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with session.get(target, headers=headers) as resp:
                if resp.status == 401:
                    raise ReplayError(
                        f"{target} answered 401: the server wants an API key; "
                        "pass --api-key or set OPENAI_API_KEY"
                    )
                if resp.status != 200:
                    raise ReplayError(
                        f"{target} answered {resp.status}: is {url} an OpenAI-compatible server "
                        "(vLLM, a pdserve router)? Check --url"
                    )
                doc = await resp.json(content_type=None)
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        reason = "no answer within 10 s" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        raise ReplayError(
            f"cannot reach {url} ({reason}). Is the server up? Start one with "
            "`pdserve up examples/sim/quickstart.yaml` (serves http://127.0.0.1:8000), or give its address "
            "with --url"
        ) from None
    except ValueError:
        raise ReplayError(
            f"{target} did not answer JSON: is {url} an OpenAI-compatible server? Check --url"
        ) from None
    data = doc.get("data") if isinstance(doc, dict) else None
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _sample(watch: EngineWatch, snapshots: list[Snapshot], interval: float, start: float) -> None:
    while True:
        await asyncio.sleep(interval)
        snapshots.append(await watch.snapshot(time.perf_counter() - start))


async def run_replay(
    arrivals: Sequence[Arrival], options: ReplayOptions, err: TextIO = sys.stderr
) -> ReplayOutcome:
    headers = {AUTHORIZATION: f"Bearer {options.api_key}"} if options.api_key else {}
    timeout = aiohttp.ClientTimeout(total=options.timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=options.max_connections, limit_per_host=0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        models = await _models(session, options.url, headers)
        model = options.model or (str(models[0].get("id")) if models else None)
        if not model:
            raise ReplayError(f"{options.url}/v1/models lists no model: name one with --model")
        listed = next((m for m in models if m.get("id") == model), {})
        max_len = listed.get("max_model_len")
        if isinstance(max_len, int):
            too_long = sum(1 for a in arrivals if a.request.input_length + a.request.output_length > max_len)
            if too_long:
                err.write(
                    f"warning: {too_long} of {len(arrivals)} requests are longer than {model}'s context "
                    f"(max_model_len {max_len}): the server will refuse them; "
                    "serve a longer --max-model-len\n"
                )

        metrics_headers = {} if options.engine_urls else headers
        watch = EngineWatch(session, metrics_headers, options.admin_url or options.url, options.engine_urls)
        first = await watch.snapshot(0.0)
        for _ in range(DISCOVERY_RETRIES):
            if not first.retry:
                break
            await asyncio.sleep(1.0)
            first = await watch.snapshot(0.0)
        engines_note = _engines_note(first, options)
        err.write(f"engines: {engines_note}\n")
        run_id = f"replay-{uuid.uuid4().hex[:8]}"
        config = ClientConfig(
            options.url,
            BodyOptions(options.endpoint, model, options.ignore_eos),
            headers,
            options.timeout_s,
            run_id,
        )
        counts = Counts(len(arrivals))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, stop.set)
        expected = arrivals[-1].at_s if arrivals else None
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        cpu_before, wall_before = _cpu_seconds(), time.perf_counter()
        start = time.perf_counter()
        snapshots = [first]
        side_tasks = []
        if options.progress:
            side_tasks.append(asyncio.create_task(show_progress(counts, err, start, expected)))
        if options.metrics_interval_s > 0 and first.slots:
            side_tasks.append(
                asyncio.create_task(_sample(watch, snapshots, options.metrics_interval_s, start))
            )
        try:
            records = await replay(session, config, arrivals, counts, stop, start)
        finally:
            for task in side_tasks:
                task.cancel()
            await asyncio.gather(*side_tasks, return_exceptions=True)
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
        cpu = _cpu_seconds() - cpu_before
        wall = time.perf_counter() - wall_before
        if options.progress:
            finish(counts, err, start, expected)
        last = await watch.snapshot(time.perf_counter() - start) if first.slots else first
        snapshots.append(last)

    summary = summarize(records, options.slo)
    engines = engine_summary(first, last) if first.slots else {"note": engines_note}
    chunks = sum(r.chunks for r in records)
    lag_p99 = (summary.get("send_lag_ms") or {}).get("p99") or 0.0
    results = {
        "config": {
            "url": options.url,
            "model": model,
            "endpoint": options.endpoint,
            "workload": options.workload,
            "run_id": run_id,
            "speedup": options.speedup,
            "requests": len(arrivals),
            "offered_rate": offered_rate(arrivals),
            "slo_ttft_ms": options.slo.ttft_ms,
            "slo_itl_ms": options.slo.itl_ms,
            "interrupted": stop.is_set(),
            "bin_s": options.bin_s,
            "started": started,
            **options.extra,
        },
        "summary": summary,
        "engines": engines,
        "trace": {
            "ideal_hit_ratio": _round(
                cachemodel.ideal_hit_ratio((a.request for a in arrivals), options.block_size)
            ),
            "ideal_block_size": options.block_size,
        },
        "client": {
            "cpu_s": round(cpu, 3),
            "wall_s": round(wall, 3),
            "cpu_share": round(cpu / wall, 3) if wall > 0 else None,
            "cpu_ms_per_request": round(1000 * cpu / max(1, counts.sent), 3),
            "cpu_us_per_chunk": round(1e6 * cpu / chunks, 2) if chunks else None,
            "max_in_flight": counts.max_in_flight,
            "saturated": lag_p99 > SATURATED_LAG_MS,
        },
        "timeline": timeline(records, options.bin_s),
        "load": load_series(snapshots),
    }
    return ReplayOutcome(results, records)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _engines_note(first: Snapshot, options: ReplayOptions) -> str:
    if first.slots:
        roles: dict[str, int] = {}
        for slot in first.slots:
            roles[slot.role] = roles.get(slot.role, 0) + 1
        found = ", ".join(f"{n} {role} slot{'s' if n > 1 else ''}" for role, n in roles.items())
        missing = f"; not read: {', '.join(first.unreachable)}" if first.unreachable else ""
        return f"{found} (prefix-cache and per-slot figures from their /metrics){missing}"
    why = "; ".join(first.unreachable) or "no engine series (vllm:*) in their /metrics"
    hint = (
        "check the --engine-url addresses"
        if options.engine_urls
        else "a router with an admin port answers /debug/routing there: pass --admin-url, "
        "or --engine-url per engine API server"
    )
    return f"none read ({why}); prefix-cache and per-slot figures are left out: {hint}"


__all__ = ["ReplayError", "ReplayOptions", "ReplayOutcome", "describe", "run_replay"]
