"""The live terminal view of `pdserve up`: client requests, per-slot requests, in-flight and
errors, and each engine rank's prefix-cache hit ratio.

It reads the proxy's own ``/debug/routing`` (the counters the router keeps per slot, and the
client requests it answered by outcome), so what you see is what the router did, not a second
count. The header counts client requests: one retried on another slot is one request there, and
a request per slot it was sent to; client errors (4xx: a bad body, a wrong key) never reach a
slot, so only the header shows them. The hit ratios are the engines' own
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` per engine rank, from each
instance's ``/metrics``, read every few seconds). With ``placement: decode-sidecar`` it
reads the front's, which merges every sidecar's (:func:`pdserve.local.front.merge_debug`) and
lists the sidecars: a line per sidecar (state, requests) above the slots. One block per
instance, one column per DP rank, redrawn in place with plain ANSI codes. When stdout is not a
terminal (a log file, CI) it prints one summary line now and then instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp

from pdserve.local.report import Reporter
from pdserve.routing import Role

REFRESH_SECONDS = 0.5
CACHE_SECONDS = 2.0  # engines' /metrics are larger: read less often
_CACHE_SAMPLE = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_ENGINE_LABEL = re.compile(r'engine="(\d+)"')
SUMMARY_SECONDS = 10.0
_HOME_AND_CLEAR = "\x1b[H\x1b[J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
_BOLD, _DIM, _RED, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[31m", "\x1b[0m"


@dataclass(frozen=True)
class SlotCounters:
    role: Role
    instance: str
    rank: int
    requests: int
    in_flight: int
    errors: int


#: Prefix-cache (hits, queries) per engine rank, per instance name.
CacheCounts = Mapping[str, Mapping[int, tuple[float, float]]]


def prefix_cache_counts(metrics_text: str) -> dict[int, tuple[float, float]]:
    """(hits, queries) of prefix-cache tokens per engine rank, from a vLLM ``/metrics`` text."""
    out: dict[int, list[float]] = {}
    for kind, labels, value in _CACHE_SAMPLE.findall(metrics_text):
        engine = _ENGINE_LABEL.search(labels)
        rank = int(engine.group(1)) if engine else 0
        counts = out.setdefault(rank, [0.0, 0.0])
        counts[0 if kind == "hits" else 1] += float(value)
    return {rank: (hits, queries) for rank, (hits, queries) in out.items()}


def hit_ratio(counts: Sequence[tuple[float, float]]) -> str:
    hits, queries = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return f"{100 * hits / queries:.0f}%" if queries else "-"


@dataclass(frozen=True)
class InstanceRow:
    role: Role
    name: str
    url: str
    state: str  # "ready", "not ready", "draining"
    slots: tuple[SlotCounters, ...]


@dataclass(frozen=True)
class RequestTotals:
    """Client requests the router answered, by what they got."""

    ok: int
    client_errors: int  # 4xx: the client's mistake
    failed: int  # the router's or an engine's: 5xx, no slot, shed, a broken stream
    cancelled: int  # the client went away

    @property
    def total(self) -> int:
        return self.ok + self.client_errors + self.failed + self.cancelled

    def describe(self) -> str:
        return (
            f"requests {self.total}: ok {self.ok}, client errors {self.client_errors}, "
            f"failed {self.failed}, cancelled {self.cancelled}"
        )


def request_totals(debug: Mapping[str, Any]) -> RequestTotals:
    """The router's ``requests`` (counts by outcome, pdserve_proxy_requests_total's)."""
    counts = {str(k): int(v) for k, v in (debug.get("requests") or {}).items()}
    ok = counts.pop("ok", 0)
    client = counts.pop("client_error", 0)
    cancelled = counts.pop("cancelled", 0)
    return RequestTotals(ok, client, sum(counts.values()), cancelled)


def slot_counters(debug: Mapping[str, Any]) -> list[SlotCounters]:
    """The proxy's per-slot counters, from its ``/debug/routing`` document."""
    out = []
    slots = debug.get("slots") or {}
    for role in Role:
        for row in slots.get(role.value, []):
            instance, _, rank = str(row["slot"]).rpartition("/")
            out.append(
                SlotCounters(
                    role, instance, int(rank), int(row["requests"]), int(row["in_flight"]), int(row["errors"])
                )
            )
    return out


def instance_rows(debug: Mapping[str, Any]) -> list[InstanceRow]:
    """Every instance of the table, routable or not, with the counters of its slots."""
    by_instance: dict[tuple[Role, str], list[SlotCounters]] = {}
    for counters in slot_counters(debug):
        by_instance.setdefault((counters.role, counters.instance), []).append(counters)
    table = debug.get("table") or {}
    rows = []
    for role in Role:
        for inst in table.get(role.value, []):
            state = "draining" if inst.get("draining") else "ready" if inst.get("ready") else "not ready"
            slots = sorted(by_instance.get((role, inst["name"]), []), key=lambda s: s.rank)
            rows.append(InstanceRow(role, str(inst["name"]), str(inst["url"]), state, tuple(slots)))
    return rows


def render_frame(
    debug: Mapping[str, Any],
    events: Sequence[str],
    color: bool = True,
    cache: CacheCounts | None = None,
    scaling: Sequence[str] = (),
) -> list[str]:
    """The full screen: a header, the autoscaler's state (with spec.autoscaling), one block per
    instance (a column per DP rank), recent events; ``cache``: the engines' prefix-cache counts,
    when read."""

    def style(code: str, text: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    def warn(text: str, count: int) -> str:
        return style(_RED, text) if count else text

    counters = slot_counters(debug)
    totals = request_totals(debug)
    errors = sum(c.errors for c in counters)
    sidecars = debug.get("sidecars") or []
    placement = debug.get("placement", "deployment")
    routers = f"{len(sidecars)} sidecar routers" if sidecars else "one router"
    lines = [
        style(_BOLD, f"pdserve up — {(debug.get('table') or {}).get('deployment', '?')}")
        + f"  placement {placement} ({routers})  routing generation {debug.get('generation')}"
        + f"  policy {debug.get('policy')}",
        f"requests {totals.total}   ok {totals.ok}   "
        + warn(f"client errors {totals.client_errors}", totals.client_errors)
        + "   "
        + warn(f"failed {totals.failed}", totals.failed)
        + f"   cancelled {totals.cancelled}   in flight {sum(c.in_flight for c in counters)}"
        + "   "
        + warn(f"slot errors {errors}", errors)
        + _cache_summary(debug, cache),
        "",
    ]
    if scaling:
        lines += [style(_BOLD, scaling[0]), *scaling[1:], ""]
    for sidecar in sidecars:
        state = "ready" if sidecar.get("ready") else style(_RED, "not ready")
        lines.append(
            f"{style(_BOLD, ' sidecar')} {sidecar.get('instance')}  {style(_DIM, str(sidecar.get('url')))}  "
            f"{state}  requests {sidecar.get('requests', 0)}"
        )
    if sidecars:
        lines.append("")
    for row in instance_rows(debug):
        state = row.state if row.state == "ready" else style(_RED, row.state)
        lines.append(f"{style(_BOLD, f'{row.role.value:>8}')} {row.name}  {style(_DIM, row.url)}  {state}")
        if row.slots:
            width = max(4, *(len(str(s.requests)) + 1 for s in row.slots))
            lines.append("   rank     " + "".join(f"{s.rank:>{width}}" for s in row.slots))
            lines.append("   requests " + "".join(f"{s.requests:>{width}}" for s in row.slots))
            lines.append("   in-flight" + "".join(f"{s.in_flight:>{width}}" for s in row.slots))
            cells = "".join(
                style(_RED, f"{s.errors:>{width}}") if s.errors else f"{s.errors:>{width}}" for s in row.slots
            )
            lines.append("   errors   " + cells)
            ranks = (cache or {}).get(row.name)
            if ranks:
                lines.append(
                    "   cache hit"
                    + "".join(f"{hit_ratio([ranks.get(s.rank, (0, 0))]):>{width}}" for s in row.slots)
                )
            index = (debug.get("prefix") or {}).get("slots") or {}
            if row.role is Role.PREFILL and index:
                lines.append(
                    "   index    "
                    + "".join(
                        f"{index.get(f'{row.name}/{s.rank}', {}).get('chunks', 0):>{width}}"
                        for s in row.slots
                    )
                )
    if debug.get("last_reload_error"):
        lines += ["", style(_RED, f"routing file rejected: {debug['last_reload_error']}")]
    if events:
        lines += ["", *events]
    lines += ["", style(_DIM, "Ctrl-C stops every process.")]
    return lines


def _cache_summary(debug: Mapping[str, Any], cache: CacheCounts | None) -> str:
    """The prefill engines' prefix-cache hit ratio, and the prefill policy when it is not --policy's."""
    out = ""
    prefill_policy = debug.get("prefill_policy")
    if prefill_policy and prefill_policy != debug.get("policy"):
        out += f"   prefill policy {prefill_policy}"
    if cache:
        prefills = {str(i["name"]) for i in (debug.get("table") or {}).get(Role.PREFILL.value, [])}
        counts = [c for name, ranks in cache.items() if name in prefills for c in ranks.values()]
        out += f"   prefill prefix-cache hits {hit_ratio(counts)}"
    return out


def summary_line(debug: Mapping[str, Any], cache: CacheCounts | None = None) -> str:
    """One line for logs: totals and the spread of requests over the decode and prefill slots."""
    counters = slot_counters(debug)
    parts = [f"generation {debug.get('generation')}", request_totals(debug).describe()]
    for role in Role:
        mine = [c.requests for c in counters if c.role is role]
        if mine:
            parts.append(
                f"{role.value} {sum(mine)} requests over {len(mine)} slots (min {min(mine)}, max {max(mine)})"
            )
        else:
            parts.append(f"{role.value}: no routable slot")
    sidecars = [int(s.get("requests", 0)) for s in debug.get("sidecars") or []]
    if sidecars:
        parts.append(f"{len(sidecars)} sidecars (min {min(sidecars)}, max {max(sidecars)} requests)")
    parts.append(f"in flight {sum(c.in_flight for c in counters)}")
    parts.append(f"errors {sum(c.errors for c in counters)}")
    return ", ".join(parts) + _cache_summary(debug, cache).replace("   ", ", ")


class LiveView(Reporter):
    """Redraws the frame in place; events are kept and shown under it instead of scrolling it away."""

    def __init__(self, out: TextIO = sys.stdout, keep_events: int = 6) -> None:
        super().__init__()
        self.out = out
        self.events: deque[str] = deque(maxlen=keep_events)

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._t0:6.1f}s  {text.splitlines()[0] if text else text}")
        if "\n" in text:  # multi-line errors (a log tail) still reach the terminal whole, after the view
            super().event(text)

    async def run(self, router_url: str, stop: asyncio.Event) -> None:
        self.out.write(_HIDE_CURSOR)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                cache: CacheCounts = {}
                read_at = 0.0
                while not stop.is_set():
                    debug = await fetch_debug(session, router_url)
                    if debug and time.monotonic() - read_at >= CACHE_SECONDS:
                        cache, read_at = await fetch_cache(session, debug), time.monotonic()
                    frame = (
                        render_frame(debug, list(self.events), cache=cache, scaling=self.scaling_lines)
                        if debug
                        else self._waiting()
                    )
                    self.out.write(_HOME_AND_CLEAR + "\n".join(frame) + "\n")
                    self.out.flush()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), REFRESH_SECONDS)
        finally:
            self.out.write(_SHOW_CURSOR)
            self.out.flush()

    def final(self, text: str) -> None:
        """Printed under the last frame, once the view has stopped redrawing."""
        self.out.write(f"{time.monotonic() - self._t0:6.1f}s  {text}\n")
        self.out.flush()

    def _waiting(self) -> list[str]:
        return ["pdserve up — waiting for the router ...", "", *self.events]


class SummaryLines(Reporter):
    """For a stdout that is not a terminal: events as lines, plus a summary every few seconds
    (with the autoscaler's measured latencies against its objectives, with spec.autoscaling)."""

    async def run(self, router_url: str, stop: asyncio.Event) -> None:
        last = ""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SUMMARY_SECONDS)
                debug = await fetch_debug(session, router_url)
                line = summary_line(debug, await fetch_cache(session, debug)) if debug else ""
                if line and self.scaling_lines:
                    line += "; " + "; ".join(x.strip() for x in self.scaling_lines[:2])
                if line and line != last:
                    self.event(line)
                    last = line


async def fetch_debug(session: aiohttp.ClientSession, router_url: str) -> dict[str, Any] | None:
    try:
        async with session.get(router_url + "/debug/routing") as resp:
            if resp.status != 200:
                return None
            data = await resp.json()
            return data if isinstance(data, dict) else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


async def fetch_cache(session: aiohttp.ClientSession, debug: Mapping[str, Any]) -> CacheCounts:
    """Every instance's prefix-cache counts per engine rank (instances that do not answer: none)."""
    table = debug.get("table") or {}
    instances = [(str(i["name"]), str(i["url"])) for role in Role for i in table.get(role.value, [])]

    async def one(url: str) -> dict[int, tuple[float, float]]:
        try:
            async with session.get(url + "/metrics") as resp:
                return prefix_cache_counts(await resp.text()) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return {}

    found = await asyncio.gather(*(one(url) for _, url in instances))
    return {name: counts for (name, _), counts in zip(instances, found, strict=True) if counts}
