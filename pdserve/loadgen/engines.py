"""Where the engines are and what their ``/metrics`` say, read over HTTP during a replay.

Two ways to find them: a pdserve router's ``/debug/routing`` (the routing table it serves, with
every instance's API server, and its own per-slot request counts), read again at every snapshot so
instances that join or leave during the run (a rollout, an autoscaler) are followed; or the
``--engine-url`` list, for any other server. A router with an admin port answers
``/debug/routing`` there only (``--admin-url``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdserve.loadgen.metrics import Slot, Snapshot, parse_metrics, slots_of
from pdserve.routing import Role, RoutingTableError, parse_routing_table

SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Target:
    role: str
    instance: str
    url: str  # an API server: its /metrics covers the engines (DP ranks) behind it


class DiscoveryError(Exception):
    def __init__(self, message: str, passing: bool = False) -> None:
        super().__init__(message)
        #: The router answered 5xx (starting, its workers' views not merged yet): ask again soon.
        self.passing = passing


def targets_from_debug(debug: Mapping[str, Any]) -> tuple[list[Target], dict[str, int]]:
    """Every API server of the router's table, and the router's requests per slot
    (``role/instance/rank``), from its ``/debug/routing`` document."""
    if not isinstance(debug.get("table"), Mapping):
        raise DiscoveryError("its /debug/routing has no routing table yet")
    try:
        table = parse_routing_table(debug["table"])
    except RoutingTableError as exc:
        raise DiscoveryError(f"its routing table does not parse: {exc}") from None
    targets = [
        Target(role.value, inst.name, url)
        for role in Role
        for inst in table.instances(role)
        for url in inst.api_urls()
    ]
    counts = {}
    for role, rows in (debug.get("slots") or {}).items():
        for row in rows or []:
            if isinstance(row, Mapping) and "slot" in row and isinstance(row.get("requests"), int):
                counts[f"{role}/{row['slot']}"] = row["requests"]
    return targets, counts


class EngineWatch:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        headers: Mapping[str, str],
        admin_url: str | None,
        engine_urls: Sequence[str] = (),
    ) -> None:
        self.session = session
        self.headers = dict(headers)
        self.admin_url = admin_url.rstrip("/") if admin_url else None
        self.fixed = [Target("engine", urlsplit(u).netloc or u, u.rstrip("/")) for u in engine_urls]

    async def _debug(self) -> Mapping[str, Any]:
        assert self.admin_url is not None
        url = self.admin_url + "/debug/routing"
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with self.session.get(url, headers=self.headers) as resp:
                    if resp.status != 200:
                        raise DiscoveryError(f"GET {url} answered {resp.status}", passing=resp.status >= 500)
                    doc = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise DiscoveryError(f"GET {url} failed: {exc or type(exc).__name__}") from None
        if not isinstance(doc, Mapping):
            raise DiscoveryError(f"GET {url} did not answer a JSON object")
        return doc

    async def targets(self) -> tuple[list[Target], dict[str, int]]:
        if self.fixed or self.admin_url is None:
            return self.fixed, {}
        return targets_from_debug(await self._debug())

    async def _scrape(self, target: Target) -> str | None:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with self.session.get(target.url + "/metrics", headers=self.headers) as resp:
                    return await resp.text() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return None

    async def snapshot(self, t_s: float) -> Snapshot:
        """Every engine's metrics now; engines that do not answer are listed, not fatal."""
        snap = Snapshot(t_s)
        try:
            targets, snap.router_requests = await self.targets()
        except DiscoveryError as exc:
            snap.unreachable.append(f"router: {exc}")
            snap.retry = exc.passing
            return snap
        texts = await asyncio.gather(*(self._scrape(t) for t in targets))
        for target, text in zip(targets, texts, strict=True):
            if text is None:
                snap.unreachable.append(target.url)
                continue
            snap.slots.update(slots_of(target.role, target.instance, parse_metrics(text)))
        return snap


def describe(targets: Sequence[Target]) -> str:
    roles: dict[str, int] = {}
    for t in targets:
        roles[t.role] = roles.get(t.role, 0) + 1
    return ", ".join(f"{n} {role} API server{'s' if n > 1 else ''}" for role, n in roles.items())


__all__ = ["DiscoveryError", "EngineWatch", "Slot", "Target", "describe", "targets_from_debug"]
