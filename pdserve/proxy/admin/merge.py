"""Merging the workers' admin views into the router's (pure; pdserve.proxy.serving.worker_views fetches them).

Counts add up (requests and legs in flight per instance and per slot, errors, ejections). What
the table says is taken from the worker that serves the *oldest* generation, so the router never
claims a table before every worker serves it: ``generation`` is the minimum (null while any
worker has none), an instance is in the table or routable if any worker has it so. For
``/routing/served`` that is the safe side of a drain: an instance is idle only once no worker
routes to it and no worker has a request on it. Each view carries ``worker``, ``generation``
and ``loaded_at``; the merged view lists them under ``workers`` (the swap window is visible there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_SUMMED_SLOT_FIELDS = ("requests", "in_flight", "pinned", "errors", "ejections")


def sum_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Counts by key (client requests by outcome) of several routers or workers, added up."""
    total: dict[str, int] = {}
    for each in counts:
        for key, n in each.items():
            total[key] = total.get(key, 0) + int(n)
    return total


def _oldest(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def age(view: dict[str, Any]) -> tuple[int, int]:
        generation = view.get("generation")
        return (0, 0) if generation is None else (1, int(generation))

    return min(views, key=age)


def _workers(views: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for view in views:
        row = {k: view.get(k) for k in ("worker", "generation", "loaded_at")}
        if "requests" in view:
            row["requests"] = view["requests"]  # generation requests the worker took
        rows.append(row)
    return sorted(rows, key=lambda r: r["worker"] if isinstance(r["worker"], int) else -1)


def merge_served(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``GET /routing/served`` answer from every worker's."""
    base = _oldest(views)
    instances: dict[str, dict[str, Any]] = {}
    slots: dict[tuple[str, str, int], dict[str, Any]] = {}
    for view in views:
        for name, row in view.get("instances", {}).items():
            merged = instances.get(name)
            if merged is None:
                instances[name] = dict(row)
                continue
            merged["in_flight"] += row.get("in_flight", 0)
            merged["in_table"] = merged["in_table"] or row.get("in_table", False)
            merged["routable"] = merged["routable"] or row.get("routable", False)
        for row in view.get("slots", []):
            key = (row["role"], row["instance"], row["dp_rank"])
            if key in slots:
                slots[key]["in_flight"] += row.get("in_flight", 0)
            else:
                slots[key] = dict(row)
    out = {k: v for k, v in base.items() if k not in ("worker", "requests")}
    out["instances"] = instances
    out["slots"] = list(slots.values())
    out["error"] = next((v["error"] for v in views if v.get("error")), None)
    out["workers"] = _workers(views)
    return out


def merge_debug(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``GET /debug/routing`` answer from every worker's."""
    base = _oldest(views)
    unreachable: dict[str, dict[str, float]] = {}
    for view in views:
        for role, names in view.get("unreachable", {}).items():
            for name, left in names.items():
                row = unreachable.setdefault(role, {})
                row[name] = max(row.get(name, 0.0), left)
    slots: dict[str, list[dict[str, Any]]] = {}
    for role in {r for v in views for r in v.get("slots", {})}:
        rows: dict[str, dict[str, Any]] = {}
        for view in [base, *(v for v in views if v is not base)]:
            for row in view.get("slots", {}).get(role, []):
                merged = rows.get(row["slot"])
                if merged is None:
                    rows[row["slot"]] = dict(row)
                    continue
                for field in _SUMMED_SLOT_FIELDS:
                    merged[field] = merged.get(field, 0) + row.get(field, 0)
                merged["ejected_for_seconds"] = max(
                    merged.get("ejected_for_seconds", 0.0), row.get("ejected_for_seconds", 0.0)
                )
        slots[role] = list(rows.values())
    out = {k: v for k, v in base.items() if k not in ("worker", "loaded_at")}
    out["unreachable"] = unreachable
    out["requests"] = sum_counts(v.get("requests") or {} for v in views)
    out["slots"] = slots
    out["workers"] = _workers(views)
    return out
