"""The engines of one simulator process: a :class:`RankEngine` per DP rank it serves, and the
pull notices between prefill and decode simulators. The HTTP server's answer of an accepted
generation request (pdserve.sim.answer) hands it to the rank's engine and streams the tokens as
they come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.kv.base import PullNotice
from pdserve.sim.engine.exposition import metrics_text
from pdserve.sim.engine.loop import RankEngine
from pdserve.sim.engine.profile import Profile
from pdserve.sim.engine.pull import PullNotices
from pdserve.sim.engine.request import Kind, Request
from pdserve.sim.engine.scheduler import EngineConfig


@dataclass(frozen=True)
class EngineSetup:
    """What ``--profile`` and vLLM's engine flags make of a simulator."""

    profile: Profile
    config: EngineConfig
    #: --enable-prompt-tokens-details: usage carries prompt_tokens_details.cached_tokens.
    prompt_tokens_details: bool = False


class Engines:
    def __init__(
        self, setup: EngineSetup, ranks: Sequence[int], engine_rank: Callable[[str], int | None]
    ) -> None:
        self.setup = setup
        self.engine_rank = engine_rank  # a prefill engine id -> the rank it names (the connector's)
        self.ranks = {rank: RankEngine(rank, setup.config, setup.profile, self._pulled) for rank in ranks}
        self.notices = PullNotices(self._release)
        self._handoffs: dict[int, PullNotice] = {}  # id(decode request) -> whom to tell once pulled

    async def start(self, listen: tuple[str, int] | None) -> None:
        """Start every rank's loop; ``listen``: where pull notices arrive (a prefill's side channel)."""
        if listen is not None:
            await self.notices.listen(*listen)
        for engine in self.ranks.values():
            engine.start()

    async def close(self) -> None:
        for engine in self.ranks.values():
            await engine.stop()
        await self.notices.close()

    def submit(
        self,
        rank: int,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        kind: Kind,
        finish_reason: str,
        handoff: PullNotice | None = None,
    ) -> Request:
        request = Request(request_id, token_ids or [0], max_tokens, 0.0, kind, finish_reason=finish_reason)
        if handoff is not None:
            self._handoffs[id(request)] = handoff
        self.ranks[rank].submit(request)
        return request

    async def wait(self, rank: int, request: Request, seen: int) -> int:
        return await self.ranks[rank].wait(request, seen)

    def done(self, rank: int, request: Request) -> None:
        """The handler is done with the request (answered, failed or cancelled)."""
        self._handoffs.pop(id(request), None)
        self.ranks[rank].abort(request)

    def block_ids(self, rank: int, request: Request) -> list[int]:
        """The blocks the request holds, or held when it finished (a freed MoRIIO leg's)."""
        return self.ranks[rank].scheduler.kv.block_ids(request) or list(request.blocks_at_finish)

    def metrics_text(self, model: str) -> str:
        return metrics_text(model, list(self.ranks.values()))

    def _pulled(self, request: Request) -> None:
        handoff = self._handoffs.pop(id(request), None)
        if handoff is not None:
            self.notices.send(handoff)

    def _release(self, engine_id: str, request_id: str) -> bool:
        rank = self.engine_rank(engine_id)
        engine = self.ranks.get(rank) if rank is not None else None
        return engine is not None and engine.release(request_id)
