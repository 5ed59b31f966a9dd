"""One simulator process per node of a multi-node vLLM instance, with vLLM's group semantics.

Shapes (flags named like vLLM's, see :class:`GroupConfig`):

* **DP, one API server per node** (``--data-parallel-hybrid-lb``): every process serves the
  OpenAI API for its own ranks ``start .. start + local - 1`` and takes them as *local* ranks in
  ``X-data-parallel-rank`` (out of range: vLLM's 400 ``data_parallel_rank 5 is out of range
  [0, 2).``), as vLLM's hybrid load balancing does (``ParallelConfig.local_engines_only``).
* **DP, the leader's API server for every rank** (workers ``--headless``): the leader (start
  rank 0) takes global ranks and forwards a rank it does not hold to the worker that does;
  headless workers serve no OpenAI API (only ``/sim/*`` on their own port for tests, and the
  engine path the leader forwards to).
* **TP/PP across nodes** (``--nnodes N --node-rank K``): node 0 serves every rank; nodes >= 1
  are ``--headless`` and hold no rank of their own.

The group forms like vLLM's: every non-leader process *joins* the leader over HTTP on the
leader's RPC port (``--data-parallel-rpc-port``, or ``--master-port`` for TP/PP) and keeps that
request open; the leader's ``/health`` is 503 until every rank (node) has joined, a perNode
node's until the leader says the group is complete. Once formed, a member that goes away
*breaks* the group, for good, on every process: vLLM cannot lose a DP or TP member and go on.
A broken process fails what it has in flight (connections cut), answers new generation
requests 500 as vLLM's ``EngineDeadError`` handler does, ``/health`` 503, and exits shortly
after, as vLLM's API server does (``terminate_if_errored``), unless
``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.sim import payloads
from pdserve.wire.headers import AUTHORIZATION, DP_RANK, REQUEST_ID
from pdserve.wire.openai import RequestError, error_body

log = logging.getLogger("pdserve.sim.group")

#: Path prefix of the engine API a headless worker serves to its leader.
ENGINE_PREFIX = "/sim/engine"
JOIN_PATH = "/sim/group/join"
HEARTBEAT_S = 0.5
REJOIN_S = 0.2
#: What a dead engine makes vLLM answer (its EngineDeadError handler: HTTP 500).
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class GroupConfigError(ValueError):
    """A flag combination vLLM would refuse; the message names the flag."""


@dataclass(frozen=True)
class GroupConfig:
    dp_size: int = 1  # --dp-size: global
    dp_local: int | None = None  # --data-parallel-size-local (None: dp_size)
    start_rank: int = 0  # --data-parallel-start-rank
    address: str | None = None  # --data-parallel-address / --master-addr: the leader
    rpc_port: int | None = None  # --data-parallel-rpc-port / --master-port: the leader's
    hybrid_lb: bool = False  # --data-parallel-hybrid-lb
    headless: bool = False  # --headless
    nnodes: int = 1  # --nnodes (TP/PP across nodes)
    node_rank: int = 0  # --node-rank

    @property
    def local(self) -> int:
        return self.dp_size if self.dp_local is None else self.dp_local

    @property
    def multi_node(self) -> bool:
        return self.local < self.dp_size or self.nnodes > 1

    @property
    def leader(self) -> bool:
        return self.multi_node and self.start_rank == 0 and self.node_rank == 0 and not self.headless

    @property
    def first_served(self) -> int:
        """The first global rank this process answers for (the leader of a leader-mode group: 0)."""
        return self.start_rank

    @property
    def served(self) -> int:
        """How many ranks this process answers for: every rank for a leader-mode leader (and node 0
        of a TP/PP group), none for a headless TP/PP node."""
        if self.nnodes > 1:
            return 0 if self.headless else self.dp_size
        if self.leader and not self.hybrid_lb:
            return self.dp_size
        return self.local

    @property
    def header_ranks(self) -> int:
        """The range of X-data-parallel-rank the API takes: local ranks under hybrid LB."""
        return self.local if self.hybrid_lb else self.dp_size

    def owns(self, rank: int) -> bool:
        """Global ``rank`` runs in this process (else the leader forwards it)."""
        if self.nnodes > 1:
            return True
        return self.start_rank <= rank < self.start_rank + self.local

    def required(self) -> frozenset[str]:
        """What must join the leader before the group is complete."""
        if not self.leader:
            return frozenset()
        if self.nnodes > 1:
            return frozenset(f"node:{n}" for n in range(1, self.nnodes))
        return frozenset(f"rank:{r}" for r in range(self.local, self.dp_size))

    def provides(self) -> list[str]:
        if self.nnodes > 1:
            return [f"node:{self.node_rank}"]
        return [f"rank:{r}" for r in range(self.start_rank, self.start_rank + self.local)]

    def check(self) -> GroupConfig:
        """Refuse what vLLM would refuse (or what the simulator cannot play), naming the flag."""
        if self.dp_local is not None and not 1 <= self.dp_local <= self.dp_size:
            raise GroupConfigError(
                f"--data-parallel-size-local: expected 1..{self.dp_size} (--dp-size), got {self.dp_local}"
            )
        if self.start_rank < 0 or self.start_rank + self.local > self.dp_size:
            raise GroupConfigError(
                f"--data-parallel-start-rank: {self.start_rank} + {self.local} local rank(s) exceeds "
                f"--dp-size {self.dp_size}"
            )
        if self.hybrid_lb and self.headless:
            raise GroupConfigError("--data-parallel-hybrid-lb and --headless exclude each other")
        if self.nnodes > 1:
            if self.local != self.dp_size or self.start_rank:
                raise GroupConfigError(
                    "--nnodes: a DP rank spanning nodes (TP/PP across nodes) takes no "
                    "--data-parallel-size-local or --data-parallel-start-rank"
                )
            if not 0 <= self.node_rank < self.nnodes:
                raise GroupConfigError(f"--node-rank: expected 0..{self.nnodes - 1}, got {self.node_rank}")
            if (self.node_rank > 0) != self.headless:
                raise GroupConfigError("--headless: required on every node but node 0 (and only there)")
        elif self.node_rank:
            raise GroupConfigError("--node-rank: needs --nnodes > 1")
        if self.headless and self.nnodes == 1 and self.start_rank == 0:
            raise GroupConfigError("--headless: the node with --data-parallel-start-rank 0 serves the API")
        if self.multi_node and (self.rpc_port is None or (not self.leader and not self.address)):
            flags = (
                "--master-addr/--master-port"
                if self.nnodes > 1
                else "--data-parallel-address/--data-parallel-rpc-port"
            )
            raise GroupConfigError(f"{flags}: required on every node of a multi-node group")
        return self


# --- the leader ---------------------------------------------------------------------------------


@dataclass
class Member:
    provides: tuple[str, ...]
    url: str | None  # a headless DP worker's engine URL (the leader forwards its ranks there)
    ranks: tuple[int, ...]


@dataclass
class GroupState:
    """One process's view of its group: complete (ready), or broken (for good)."""

    config: GroupConfig
    members: dict[str, Member] = field(default_factory=dict)  # by provided key
    complete: bool = False
    formed: bool = False  # complete at least once: a loss from now on breaks the group
    broken: str | None = None
    joined: bool = False  # a non-leader: its join request is open
    on_broken: list[Callable[[str], None]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if not self.config.multi_node:
            self.complete = self.formed = True
        elif self.config.leader:
            self._update()

    def health_problem(self) -> str | None:
        """None when this process may take requests (its /health is 200)."""
        if self.broken:
            return f"group broken: {self.broken}"
        if not self.complete:
            if self.config.leader:
                missing = sorted(self.config.required() - set(self.members))
                return f"waiting for the group: {', '.join(missing)} not joined"
            return "waiting for the leader to report the group complete"
        return None

    def remote_url(self, rank: int) -> str | None:
        """The engine URL of the worker holding global ``rank`` (None: this process holds it)."""
        if self.config.owns(rank):
            return None
        member = self.members.get(f"rank:{rank}")
        return member.url if member is not None else None

    def break_group(self, reason: str) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        self.complete = False
        log.error("group broken: %s", reason)
        self._notify()
        for callback in self.on_broken:
            callback(reason)

    def _update(self) -> None:
        self.complete = self.broken is None and self.config.required() <= set(self.members)
        self.formed = self.formed or self.complete
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _status_line(self) -> bytes:
        return (json.dumps({"complete": self.complete, "broken": self.broken}) + "\n").encode()

    async def join(self, request: web.Request) -> web.StreamResponse:
        """``POST /sim/group/join`` on the leader's RPC port: held open for the member's life."""
        try:
            body = json.loads(await request.read())
            provides = tuple(str(p) for p in body["provides"])
            url = body.get("url")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response(error_body(400, f"bad join request: {exc}"), status=400)
        required = self.config.required()
        unknown = [p for p in provides if p not in required]
        taken = [p for p in provides if p in self.members]
        if self.broken or unknown or taken or not provides:
            why = self.broken or (f"unknown {unknown}" if unknown else f"already joined {taken}")
            return web.json_response(error_body(409, f"cannot join: {why}"), status=409)
        ranks = tuple(int(p.split(":")[1]) for p in provides if p.startswith("rank:"))
        member = Member(provides, url if isinstance(url, str) else None, ranks)
        for key in provides:
            self.members[key] = member
        self._update()
        log.info("joined: %s (%s)", ", ".join(provides), "complete" if self.complete else "waiting")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(request)
            while True:
                await response.write(self._status_line())
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), HEARTBEAT_S)
        except ConnectionError:
            pass
        finally:
            for key in provides:
                self.members.pop(key, None)
            if self.formed:
                self.break_group(f"{', '.join(provides)} left the group")
            else:
                self._update()
        return response

    async def keep_joined(self, engine_url: str | None, stopping: asyncio.Event) -> None:
        """A non-leader: join the leader and follow its status until the process stops."""
        c = self.config
        leader = f"http://{c.address}:{c.rpc_port}{JOIN_PATH}"
        payload = {"provides": c.provides(), "url": engine_url}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stopping.is_set() and self.broken is None:
                try:
                    async with session.post(leader, json=payload) as resp:
                        if resp.status == 200:
                            self.joined = True
                            async for line in resp.content:
                                status = json.loads(line)
                                if status.get("broken"):
                                    self.break_group(f"the leader reports: {status['broken']}")
                                self.complete = bool(status.get("complete")) and self.broken is None
                                self.formed = self.formed or self.complete
                        else:
                            log.warning("join refused by %s: %s", leader, (await resp.text())[:200])
                except (aiohttp.ClientError, ValueError, OSError):
                    pass
                self.joined = False
                self.complete = False
                if self.formed:
                    self.break_group(f"lost the leader {c.address}:{c.rpc_port}")
                    return
                await asyncio.sleep(REJOIN_S)


def resolve_rank(group: GroupConfig, value: str | None, engine_path: bool) -> int | None:
    """The global rank a request asks for, or None (the process balances itself).

    On the API: ``[0, header_ranks)``, vLLM's check and message; under hybrid LB the header is
    local. On a worker's engine path (the leader forwarding): the global rank it holds.
    """
    if not engine_path:
        rank = payloads.parse_rank_header(value, group.header_ranks)
        return None if rank is None else rank + (group.start_rank if group.hybrid_lb else 0)
    if value is None:
        return None
    rank = payloads.rank_number(value)
    if not group.owns(rank):
        first, end = group.start_rank, group.start_rank + group.local
        raise RequestError(400, f"data_parallel_rank {rank} is not held here [{first}, {end}).")
    return rank


async def forward(
    request: web.Request, session: aiohttp.ClientSession, url: str, rank: int, body: bytes
) -> web.StreamResponse:
    """Relay one request to the worker holding ``rank``; its death fails the request (500 before
    the answer started, the connection cut after), as a dead engine fails vLLM's."""
    headers = {"Content-Type": "application/json", DP_RANK: str(rank)}
    for name in (REQUEST_ID, AUTHORIZATION):
        if name in request.headers:
            headers[name] = request.headers[name]
    target = f"{url}{ENGINE_PREFIX}{request.path}"
    try:
        async with session.post(target, data=body, headers=headers) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
            )
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError):
                if request.transport is not None:
                    request.transport.abort()  # the answer had started: cut it, as a dead engine does
                await asyncio.Future()  # aiohttp cancels the handler once the connection is gone
            await response.write_eof()
            return response
    except (aiohttp.ClientError, OSError):
        return web.json_response(error_body(500, ENGINE_DEAD), status=500)


def engine_dead_reply() -> web.Response:
    return web.json_response(error_body(500, ENGINE_DEAD), status=500)


def describe(group: GroupConfig) -> dict[str, Any]:
    """The group as /sim/stats and the start line show it."""
    c = group
    return {
        "dp_size": c.dp_size,
        "dp_local": c.local,
        "start_rank": c.start_rank,
        "hybrid_lb": c.hybrid_lb,
        "headless": c.headless,
        "leader": c.leader,
        "nnodes": c.nnodes,
        "node_rank": c.node_rank,
    }
