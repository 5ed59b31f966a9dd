"""Prometheus metrics of the proxy, on a registry per app (tests build several apps per process)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from pdserve.wire.prometheus import Family, Kind, register

#: Set by pdserve.proxy.serving.workers before prometheus_client is imported: values go to files there.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

M = TypeVar("M", Counter, Gauge, Histogram)

# Streams run for minutes: the buckets reach 10 min.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


#: The router's families, by the name of the ProxyMetrics attribute that counts them.
FAMILIES: dict[str, Family] = {
    "requests": Family(
        "pdserve_proxy_requests",
        "counter",
        "Client requests by endpoint and outcome (ok, client_error, upstream_error, no_slot, cancelled)",
        ("endpoint", "outcome"),
    ),
    "upstream": Family(
        "pdserve_proxy_upstream_requests",
        "counter",
        "Upstream legs by role, slot and outcome (ok, http_4xx, http_5xx, connect_error, dropped, "
        "timeout, bad_handoff, cancelled)",
        ("role", "slot", "outcome"),
    ),
    "ttft": Family(
        "pdserve_proxy_ttft_seconds",
        "histogram",
        "Time from the client's request to the first byte sent back to it",
        ("endpoint",),
        buckets=_LATENCY_BUCKETS,
    ),
    "itl": Family(
        "pdserve_proxy_itl_seconds",
        "histogram",
        "Mean time between two events of a decode's stream, one sample per streamed request",
        ("endpoint",),
        buckets=_ITL_BUCKETS,
    ),
    "leg_ttfb": Family(
        "pdserve_proxy_leg_first_byte_seconds",
        "histogram",
        "Time from sending a leg to its first byte: the prefill's whole answer, the decode's first "
        "chunk (after its KV pull)",
        ("role",),
        buckets=_LATENCY_BUCKETS,
    ),
    "total": Family(
        "pdserve_proxy_request_seconds",
        "histogram",
        "Time from the client's request to the end of its response",
        ("endpoint",),
        buckets=_LATENCY_BUCKETS,
    ),
    "in_flight": Family(
        "pdserve_proxy_in_flight", "gauge", "Client requests being served", combine="livesum"
    ),
    "slot_in_flight": Family(
        "pdserve_proxy_slot_in_flight",
        "gauge",
        "Upstream legs in flight per slot",
        ("role", "slot"),
        combine="livesum",
    ),
    "generation": Family(
        "pdserve_proxy_routing_generation",
        "gauge",
        "Generation of the routing table being served (with workers: the oldest any worker serves)",
        combine="livemin",
    ),
    "slots": Family(
        "pdserve_proxy_routing_slots", "gauge", "Routable slots per role", ("role",), combine="livemostrecent"
    ),
    "loaded_at": Family(
        "pdserve_proxy_routing_loaded_timestamp_seconds",
        "gauge",
        "Unix time the served routing table was loaded (with workers: the earliest of theirs)",
        combine="livemin",
    ),
    "unpaired": Family(
        "pdserve_proxy_routing_unpaired_slots",
        "gauge",
        "Ready slots of a revision that the other role lacks: they take no traffic",
        ("role", "revision"),
        combine="livemostrecent",
    ),
    "queue_depth": Family(
        "pdserve_proxy_admission_queue_depth",
        "gauge",
        "Requests waiting for a slot with room (per-slot limit reached)",
        combine="livesum",
    ),
    "queue_wait": Family(
        "pdserve_proxy_admission_wait_seconds",
        "histogram",
        "Time requests waited in the admission queue (admitted or shed)",
        buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    ),
    "shed": Family(
        "pdserve_proxy_shed_requests",
        "counter",
        "Requests answered 429 because the admission queue was full (queue_full) or their wait "
        "passed the deadline (queue_timeout)",
        ("reason",),
    ),
    "reloads": Family(
        "pdserve_proxy_routing_reloads", "counter", "Routing tables loaded from the table source"
    ),
    "reload_errors": Family(
        "pdserve_proxy_routing_reload_errors",
        "counter",
        "Routing tables that could not be served (the last good table was kept)",
    ),
    "source_up": Family(
        "pdserve_proxy_routing_source_up",
        "gauge",
        "1 while the table source is read and holds a table, 0 while it cannot be read or the "
        "ConfigMap is missing",
        combine="livemin",
    ),
    "watch_restarts": Family(
        "pdserve_proxy_routing_watch_restarts",
        "counter",
        "ConfigMap watches started again, by reason (expired, closed, gone, error)",
        ("reason",),
    ),
    "watch_errors": Family(
        "pdserve_proxy_routing_watch_errors",
        "counter",
        "Failed ConfigMap list/watch requests, by reason (unreachable, unauthorized, forbidden, "
        "not_found, http_error, bad_event, internal)",
        ("reason",),
    ),
    "retries": Family(
        "pdserve_proxy_retries",
        "counter",
        "Attempts repeated on another slot, by failed role and reason",
        ("role", "reason"),
    ),
    "ejections": Family(
        "pdserve_proxy_ejections",
        "counter",
        "Slots ejected for a cool-down after a failure",
        ("role", "slot"),
    ),
    "handoff_failures": Family(
        "pdserve_proxy_handoff_failures",
        "counter",
        "Prefill answers whose kv_transfer_params a decode could not use (decode not sent)",
        ("slot",),
    ),
    "deadline_expiries": Family(
        "pdserve_proxy_deadline_expiries",
        "counter",
        "Upstream deadlines that expired (prefill_ttfb, decode_ttfb, stream_idle); upstream cancelled",
        ("role", "deadline"),
    ),
    "stream_errors": Family(
        "pdserve_proxy_stream_errors",
        "counter",
        "Streams ended with an error event after the first byte had reached the client",
        ("reason",),
    ),
    "background_prefill_failures": Family(
        "pdserve_proxy_background_prefill_failures",
        "counter",
        "MoRIIO WRITE prefills that failed after their decode had started streaming",
        ("slot",),
    ),
}
#: The prefix-affinity policy's families (registered only when it routes the prefills).
PREFIX_FAMILIES: dict[str, Family] = {
    "routed": Family(
        "pdserve_proxy_prefix_routed",
        "counter",
        "Prefill legs by slot and how prefix-affinity chose the slot: affinity (its longest "
        "prompt-prefix match within the load bound), flat (no match of the minimum length: the flat "
        "interleave's next slot), spread (a match, but only on slots over the bound: the next slot "
        "within it), rendezvous (no match: the slot the first chunk hashes to, within the bound), "
        "unchunkable (no prompt text to match: flat)",
        ("slot", "how"),
    ),
    "matched_chars": Family(
        "pdserve_proxy_prefix_matched_chars",
        "counter",
        "Prompt characters that matched the slot's index when a prefill was sent to it",
        ("slot",),
    ),
    "prompt_chars": Family(
        "pdserve_proxy_prefix_prompt_chars",
        "counter",
        "Prompt characters of the prefills sent to the slot (matched / prompt: the router's expected "
        "prefix hit ratio)",
        ("slot",),
    ),
    "unchunkable": Family(
        "pdserve_proxy_prefix_unchunkable",
        "counter",
        "Prefills whose prompt could not be cut into chunks (empty, non_text content parts, "
        "unreadable): routed by the flat interleave",
        ("reason",),
    ),
    "index_chunks": Family(
        "pdserve_proxy_prefix_index_chunks",
        "gauge",
        "Chunk hashes in the slot's prefix index (each worker holds the whole index)",
        ("slot",),
        combine="livemax",
    ),
}


class _Silent:
    """A counter that counts nothing: a table source's events are counted by one worker only."""

    def labels(self, *_: str) -> _Silent:
        return self

    def inc(self, amount: float = 1) -> None:
        pass


class PrefixMetrics:
    """The prefix-affinity policy's metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        m = register(PREFIX_FAMILIES, registry)
        self.routed: Counter = m["routed"]
        self.matched_chars: Counter = m["matched_chars"]
        self.prompt_chars: Counter = m["prompt_chars"]
        self.unchunkable: Counter = m["unchunkable"]
        self.index_chunks: Gauge = m["index_chunks"]


class ProxyMetrics:
    def __init__(self, primary: bool = True) -> None:
        """``primary``: this process counts the table source's events (loads, rejections, watch
        restarts and errors); with worker processes only the first does, since every worker
        reads the same source and the router loaded each table once."""
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._unpaired_labels: set[tuple[str, str]] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        # Typed attributes for the callers (the hot path counts through them); FAMILIES says what each is.
        m = register(FAMILIES, self.registry)
        self.requests: Counter = m["requests"]
        self.upstream: Counter = m["upstream"]
        self.ttft: Histogram = m["ttft"]
        self.itl: Histogram = m["itl"]
        self.leg_ttfb: Histogram = m["leg_ttfb"]
        self.total: Histogram = m["total"]
        self.in_flight: Gauge = m["in_flight"]
        self.slot_in_flight: Gauge = m["slot_in_flight"]
        self.generation: Gauge = m["generation"]
        self.slots: Gauge = m["slots"]
        self.loaded_at: Gauge = m["loaded_at"]
        self.unpaired: Gauge = m["unpaired"]
        self.queue_depth: Gauge = m["queue_depth"]
        self.queue_wait: Histogram = m["queue_wait"]
        self.shed: Counter = m["shed"]
        self.reloads: Counter = m["reloads"]
        self.reload_errors: Counter = m["reload_errors"]
        self.source_up: Gauge = m["source_up"]
        self.watch_restarts: Counter = m["watch_restarts"]
        self.watch_errors: Counter = m["watch_errors"]
        self.retries: Counter = m["retries"]
        self.ejections: Counter = m["ejections"]
        self.handoff_failures: Counter = m["handoff_failures"]
        self.deadline_expiries: Counter = m["deadline_expiries"]
        self.stream_errors: Counter = m["stream_errors"]
        self.background_prefill_failures: Counter = m["background_prefill_failures"]

        self.prefix: PrefixMetrics | None = None  # enable_prefix()

        if not primary:
            silent = cast(Counter, _Silent())
            self.reloads = self.reload_errors = self.watch_restarts = self.watch_errors = silent

    def enable_prefix(self) -> PrefixMetrics:
        """Register the prefix-affinity metrics (once)."""
        if self.prefix is None:
            self.prefix = PrefixMetrics(self.registry)
        return self.prefix

    def set_unpaired(self, unpaired: Iterable[tuple[str, str, int]]) -> None:
        """(role, revision, slots) of the table now served; revisions no longer unpaired drop out."""
        now = {(role, revision): slots for role, revision, slots in unpaired}
        for labels in self._unpaired_labels - now.keys():
            self.unpaired.labels(*labels).set(0)  # clear() is not offered in multiprocess mode
        for labels, slots in now.items():
            self.unpaired.labels(*labels).set(slots)
        self._unpaired_labels = set(now)

    def request_outcomes(self) -> dict[str, int]:
        """Client requests this process answered, by outcome (its share of ``requests_total``)."""
        counts: dict[str, int] = {}
        for family in self.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels["outcome"]
                    counts[outcome] = counts.get(outcome, 0) + int(sample.value)
        return counts

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, cached: the hot path touches a few children per request."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[no-any-return]

    def render(self) -> tuple[bytes, str]:
        """This registry's metrics; with worker processes every worker's, combined (Prometheus
        multiprocess mode: each worker writes its values to files in PROMETHEUS_MULTIPROC_DIR)."""
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
        body = generate_latest(registry)
        # Families no worker has a sample of yet are absent from the files: list them as a
        # single process does (HELP and TYPE), so the exposition does not depend on the traffic.
        present = {family.name for family in registry.collect()}
        missing = [
            f"{line}\n"
            for family in self.registry.collect()
            if family.name not in present
            for line in Family(family.name, cast(Kind, family.type), family.documentation).header()
        ]
        return body + "".join(missing).encode(), CONTENT_TYPE_LATEST
