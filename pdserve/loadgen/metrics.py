"""The engines' side of a replay, from their Prometheus ``/metrics``: prefix-cache hit ratio and load
per slot (an engine is a DP rank: vLLM labels its series ``engine="<global rank>"``).

Pure: :func:`parse_metrics` reads the exposition text, :func:`engine_summary` takes the difference
of two snapshots (counters only grow; a counter that went down means the engine restarted, and its
difference is then not trusted), :func:`load_series` the gauges over time. The HTTP is in
``engines.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
SUCCESS = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"

COUNTERS = (
    HITS,
    QUERIES,
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    SUCCESS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREEMPTIONS,
)
GAUGES = (RUNNING, WAITING, KV_USAGE)
_WANTED = tuple(name + c for name in (*COUNTERS, *GAUGES) for c in ("{", " "))
_ENGINE = re.compile(r'engine="([^"]*)"')


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """``{engine label: {metric: value}}`` for the metrics a replay reads, summed over their other
    labels (``finished_reason``, ``model_name``). Other lines are skipped without parsing, so a
    large exposition costs little. A series without an ``engine`` label counts as engine ``""``."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            labels, _, value_part = rest.rpartition("}")
        else:
            name, _, value_part = line.partition(" ")
            labels = ""
        try:
            value = float(value_part.split()[0])
        except (ValueError, IndexError):
            continue
        match = _ENGINE.search(labels)
        engine = match.group(1) if match else ""
        values = out.setdefault(engine, {})
        values[name] = values.get(name, 0.0) + value
    return out


@dataclass(frozen=True)
class Slot:
    """One engine (DP rank) of one instance, as the routing table names it."""

    role: str  # "prefill", "decode", or "engine" (found with --engine-url: role unknown)
    instance: str
    engine: str

    @property
    def key(self) -> str:
        return f"{self.role}/{self.instance}/{self.engine}"


@dataclass
class Snapshot:
    """Every slot's metrics at one time (seconds from the replay's start), and the router's own
    per-slot request counts when it was asked (``/debug/routing``)."""

    t_s: float
    slots: dict[Slot, dict[str, float]] = field(default_factory=dict)
    router_requests: dict[str, int] = field(default_factory=dict)  # "role/instance/rank" -> requests
    unreachable: list[str] = field(default_factory=list)
    retry: bool = False  # the router could not answer for now: worth asking again


def _ratio(hits: float, queries: float) -> float | None:
    return round(hits / queries, 4) if queries > 0 else None


def engine_summary(first: Snapshot, last: Snapshot) -> dict[str, Any]:
    """What changed between two snapshots: per slot and per role, requests finished, prompt and
    generated tokens, and the prefix cache's hits over queries (tokens, as vLLM counts them)."""
    slots: dict[str, dict[str, Any]] = {}
    roles: dict[str, dict[str, float]] = {}
    restarted = []
    for slot, after in sorted(last.slots.items(), key=lambda kv: kv[0].key):
        before = first.slots.get(slot, {})
        delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS if name in after}
        if any(v < 0 for v in delta.values()):
            restarted.append(slot.key)
            continue
        slots[slot.key] = {
            "role": slot.role,
            "instance": slot.instance,
            "engine": slot.engine,
            "requests": int(delta.get(SUCCESS, 0)),
            "prompt_tokens": int(delta.get(PROMPT_TOKENS, 0)),
            "generation_tokens": int(delta.get(GENERATION_TOKENS, 0)),
            "prefix_cache_queries": int(delta[QUERIES]) if QUERIES in delta else None,
            "prefix_cache_hits": int(delta[HITS]) if HITS in delta else None,
            "prefix_cache_hit_ratio": _ratio(delta.get(HITS, 0), delta[QUERIES])
            if QUERIES in delta
            else None,
            "preemptions": int(delta[PREEMPTIONS]) if PREEMPTIONS in delta else None,
        }
        totals = roles.setdefault(slot.role, {})
        for name, value in delta.items():
            totals[name] = totals.get(name, 0.0) + value
    by_role = {}
    for role, t in roles.items():
        requests = [s["requests"] for s in slots.values() if s["role"] == role]
        mean = sum(requests) / len(requests) if requests else 0
        by_role[role] = {
            "slots": len(requests),
            "requests": int(t.get(SUCCESS, 0)),
            # max over mean requests per slot: 1.0 is an even spread
            "imbalance": round(max(requests) / mean, 3) if mean > 0 else None,
            "prefix_cache_queries": int(t[QUERIES]) if QUERIES in t else None,
            "prefix_cache_hits": int(t[HITS]) if HITS in t else None,
            "prefix_cache_hit_ratio": _ratio(t.get(HITS, 0), t[QUERIES]) if QUERIES in t else None,
            "external_prefix_cache_hit_ratio": _ratio(t.get(EXTERNAL_HITS, 0), t[EXTERNAL_QUERIES])
            if EXTERNAL_QUERIES in t
            else None,
            "preemptions": int(t[PREEMPTIONS]) if PREEMPTIONS in t else None,
        }
    router = {
        key: n - first.router_requests.get(key, 0)
        for key, n in sorted(last.router_requests.items())
        if n >= first.router_requests.get(key, 0)
    }
    return {
        "by_role": by_role,
        "slots": slots,
        "router_requests": router or None,
        "restarted": restarted,
        "unreachable": sorted(set(first.unreachable) | set(last.unreachable)),
    }


def load_series(snapshots: Sequence[Snapshot]) -> list[dict[str, Any]]:
    """Per snapshot and role: requests running and waiting (summed over slots) and the mean KV
    cache usage, for the load-over-time plot."""
    out = []
    for snap in snapshots:
        row: dict[str, Any] = {"t_s": round(snap.t_s, 3)}
        for role in sorted({s.role for s in snap.slots}):
            values = [v for s, v in snap.slots.items() if s.role == role]
            row[f"{role}_running"] = sum(v.get(RUNNING, 0) for v in values)
            row[f"{role}_waiting"] = sum(v.get(WAITING, 0) for v in values)
            usage = [v[KV_USAGE] for v in values if KV_USAGE in v]
            row[f"{role}_kv_usage"] = round(sum(usage) / len(usage), 4) if usage else None
        out.append(row)
    return out


def slots_of(
    role: str, instance: str, parsed: Mapping[str, Mapping[str, float]]
) -> dict[Slot, dict[str, float]]:
    return {Slot(role, instance, engine): dict(values) for engine, values in parsed.items()}
