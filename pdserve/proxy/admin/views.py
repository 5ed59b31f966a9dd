"""What the router says about its table and slots: ``/routing/served`` and ``/debug/routing``.

Each worker process knows only its own requests; with several workers, the one that takes the
admin request asks the others for theirs (pdserve.proxy.serving.worker_views) and merges them
(pdserve.proxy.admin.merge), so the answer is the router's, never one worker's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.proxy.admin.merge import merge_debug, merge_served
from pdserve.proxy.flow.dispatcher import Dispatcher
from pdserve.proxy.serving.worker_views import Views, WorkerInfo, gather_views
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.table.served import ServedTable, endpoint_fields, served_view
from pdserve.routing import Role
from pdserve.wire.load import merge_views

MERGES: dict[str, Callable[[list[dict[str, Any]]], dict[str, Any]]] = {
    "served": merge_served,
    "debug": merge_debug,
    "load": merge_views,
}
#: ``GET /load`` without ``window``: the autoscaler's default window (spec.autoscaling.objectives).
DEFAULT_LOAD_WINDOW_S = 60


@dataclass(frozen=True)
class RouterState:
    """The parts of this process the admin views read."""

    served: ServedTable
    book: SlotBook
    dispatcher: Dispatcher
    policy: str
    #: The policy's own state (prefix-affinity: its index), for /debug/routing.
    policy_state: Callable[[], dict[str, Any]] = dict


def debug_view(router: RouterState) -> dict[str, Any]:
    """``GET /debug/routing`` of this process: the table, its slots with their URLs and counts."""
    served, book = router.served, router.book
    state = served.current
    out: dict[str, Any] = {
        "source": served.source,
        "policy": router.policy,
        "last_reload_error": served.rejected,
        "source_problem": served.problem,
        "generation": state.generation if state else None,
        "table": state.slots.table.to_dict() if state else None,
        "revisions": state.slots.revisions() if state else {},
        "unpaired": [u.describe() for u in state.slots.unpaired] if state else [],
        "unreachable": router.dispatcher.unreachable.snapshot(),
        # Client requests answered, by outcome: a request retried on another slot counts once
        # here and once per slot tried below.
        "requests": router.dispatcher.metrics.request_outcomes(),
        "slots": {},
    }
    for role in Role:
        rows = []
        for slot in state.slots.slots(role) if state else ():
            s = book.state(role, slot.key)
            rows.append(
                {
                    "slot": slot.key,
                    "url": slot.url,
                    "revision": slot.revision,
                    "dp_rank": slot.dp_rank,
                    "rank_header": slot.rank_header,
                    **endpoint_fields(slot),
                    "requests": s.requests,
                    "in_flight": s.in_flight,
                    "pinned": s.pinned,
                    "errors": s.errors,
                    "ejections": s.ejections,
                    "ejected_for_seconds": round(book.ejected_for(role, slot.key), 3),
                }
            )
        out["slots"][role.value] = rows
    described = router.policy_state()
    if described:  # prefix-affinity: its settings and each prefill slot's index size
        out["prefill_policy"] = described["policy"]
        out["prefix"] = described
        for row in out["slots"].get(Role.PREFILL.value, []):
            row["prefix_index_chunks"] = described["slots"].get(row["slot"], {}).get("chunks", 0)
    return out


def local_views(router: RouterState, worker: WorkerInfo | None) -> Views:
    """This process's views by name, as the other workers ask for them (with what merging needs)."""
    index = worker.index if worker else 0
    return {
        "served": lambda _: {
            **served_view(router.served, router.book),
            "worker": index,
            "requests": router.dispatcher.served_requests,
        },
        "debug": lambda _: {**debug_view(router), "worker": index, "loaded_at": router.served.loaded_at},
        "load": lambda window: load_view(router, float(window or DEFAULT_LOAD_WINDOW_S)),
    }


def load_view(router: RouterState, window: float) -> dict[str, Any]:
    """``GET /load`` of this process (pdserve.wire.load): its latencies and outcomes of the last
    ``window`` seconds, its own legs in flight and queue (the workers' views add up)."""
    state = router.served.current
    busy = list(router.book.busy_slots())
    return {
        **router.dispatcher.load.view(window),
        "deployment": state.slots.table.deployment if state else None,
        "in_flight": {role.value: sum(n for r, _, n in busy if r is role) for role in Role},
        "queued": router.dispatcher.admission.depth,
    }


async def router_view(
    name: str, views: Views, worker: WorkerInfo | None, argument: str = ""
) -> dict[str, Any]:
    """The view ``name`` of the whole router: this process's alone, or every worker's merged.

    Raises WorkerViewsError when a worker does not answer (a partial count is never given)."""
    if worker is None or worker.count == 1:
        view = views[name](argument)
        merge_only = {"served": ("worker", "requests"), "debug": ("worker", "requests", "loaded_at")}
        for key in merge_only.get(name, ()):
            view.pop(key, None)
        return view
    return MERGES[name](await gather_views(worker, name, views[name], argument))
