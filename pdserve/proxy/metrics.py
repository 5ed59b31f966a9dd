"""Prometheus metrics of the proxy, on a registry per app (tests build several apps per process)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

#: Set by pdserve.proxy.serving.workers before prometheus_client is imported: values go to files there.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

M = TypeVar("M", Counter, Gauge, Histogram)

# Streams run for minutes: the buckets reach 10 min.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class _Silent:
    """A counter that counts nothing: a table source's events are counted by one worker only."""

    def labels(self, *_: str) -> _Silent:
        return self

    def inc(self, amount: float = 1) -> None:
        pass


class PrefixMetrics:
    """The prefix-affinity policy's metrics (registered only when it routes the prefills)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.routed = Counter(
            "pdserve_proxy_prefix_routed",
            "Prefill legs by slot and how prefix-affinity chose the slot: affinity (its longest "
            "prompt-prefix match within the load bound), flat (no match of the minimum length: the flat "
            "interleave's next slot), spread (a match, but only on slots over the bound: the next slot "
            "within it), rendezvous (no match: the slot the first chunk hashes to, within the bound), "
            "unchunkable (no prompt text to match: flat)",
            ["slot", "how"],
            registry=r,
        )
        self.matched_chars = Counter(
            "pdserve_proxy_prefix_matched_chars",
            "Prompt characters that matched the slot's index when a prefill was sent to it",
            ["slot"],
            registry=r,
        )
        self.prompt_chars = Counter(
            "pdserve_proxy_prefix_prompt_chars",
            "Prompt characters of the prefills sent to the slot (matched / prompt: the router's expected "
            "prefix hit ratio)",
            ["slot"],
            registry=r,
        )
        self.unchunkable = Counter(
            "pdserve_proxy_prefix_unchunkable",
            "Prefills whose prompt could not be cut into chunks (empty, non_text content parts, "
            "unreadable): routed by the flat interleave",
            ["reason"],
            registry=r,
        )
        self.index_chunks = Gauge(
            "pdserve_proxy_prefix_index_chunks",
            "Chunk hashes in the slot's prefix index (each worker holds the whole index)",
            ["slot"],
            registry=r,
            multiprocess_mode="livemax",
        )


class ProxyMetrics:
    def __init__(self, primary: bool = True) -> None:
        """``primary``: this process counts the table source's events (loads, rejections, watch
        restarts and errors); with worker processes only the first does, since every worker
        reads the same source and the router loaded each table once."""
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._unpaired_labels: set[tuple[str, str]] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdserve_proxy_requests",
            "Client requests by endpoint and outcome (ok, client_error, upstream_error, no_slot, cancelled)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.upstream = Counter(
            "pdserve_proxy_upstream_requests",
            "Upstream legs by role, slot and outcome (ok, http_4xx, http_5xx, connect_error, dropped, "
            "timeout, bad_handoff, cancelled)",
            ["role", "slot", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_proxy_ttft_seconds",
            "Time from the client's request to the first byte sent back to it",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_proxy_itl_seconds",
            "Mean time between two events of a decode's stream, one sample per streamed request",
            ["endpoint"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.leg_ttfb = Histogram(
            "pdserve_proxy_leg_first_byte_seconds",
            "Time from sending a leg to its first byte: the prefill's whole answer, the decode's first "
            "chunk (after its KV pull)",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.total = Histogram(
            "pdserve_proxy_request_seconds",
            "Time from the client's request to the end of its response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # multiprocess_mode says how worker processes' values combine (pdserve.proxy.serving.workers);
        # a single process ignores it.
        self.in_flight = Gauge(
            "pdserve_proxy_in_flight", "Client requests being served", registry=r, multiprocess_mode="livesum"
        )
        self.slot_in_flight = Gauge(
            "pdserve_proxy_slot_in_flight",
            "Upstream legs in flight per slot",
            ["role", "slot"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.generation = Gauge(
            "pdserve_proxy_routing_generation",
            "Generation of the routing table being served (with workers: the oldest any worker serves)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.slots = Gauge(
            "pdserve_proxy_routing_slots",
            "Routable slots per role",
            ["role"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.loaded_at = Gauge(
            "pdserve_proxy_routing_loaded_timestamp_seconds",
            "Unix time the served routing table was loaded (with workers: the earliest of theirs)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.unpaired = Gauge(
            "pdserve_proxy_routing_unpaired_slots",
            "Ready slots of a revision that the other role lacks: they take no traffic",
            ["role", "revision"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.queue_depth = Gauge(
            "pdserve_proxy_admission_queue_depth",
            "Requests waiting for a slot with room (per-slot limit reached)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            "pdserve_proxy_admission_wait_seconds",
            "Time requests waited in the admission queue (admitted or shed)",
            buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.shed = Counter(
            "pdserve_proxy_shed_requests",
            "Requests answered 429 because the admission queue was full (queue_full) or their wait "
            "passed the deadline (queue_timeout)",
            ["reason"],
            registry=r,
        )
        self.reloads = Counter(
            "pdserve_proxy_routing_reloads", "Routing tables loaded from the table source", registry=r
        )
        self.reload_errors = Counter(
            "pdserve_proxy_routing_reload_errors",
            "Routing tables that could not be served (the last good table was kept)",
            registry=r,
        )
        self.source_up = Gauge(
            "pdserve_proxy_routing_source_up",
            "1 while the table source is read and holds a table, 0 while it cannot be read or the "
            "ConfigMap is missing",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.watch_restarts = Counter(
            "pdserve_proxy_routing_watch_restarts",
            "ConfigMap watches started again, by reason (expired, closed, gone, error)",
            ["reason"],
            registry=r,
        )
        self.watch_errors = Counter(
            "pdserve_proxy_routing_watch_errors",
            "Failed ConfigMap list/watch requests, by reason (unreachable, unauthorized, forbidden, "
            "not_found, http_error, bad_event, internal)",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_proxy_retries",
            "Attempts repeated on another slot, by failed role and reason",
            ["role", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "pdserve_proxy_ejections",
            "Slots ejected for a cool-down after a failure",
            ["role", "slot"],
            registry=r,
        )
        self.handoff_failures = Counter(
            "pdserve_proxy_handoff_failures",
            "Prefill answers whose kv_transfer_params a decode could not use (decode not sent)",
            ["slot"],
            registry=r,
        )
        self.deadline_expiries = Counter(
            "pdserve_proxy_deadline_expiries",
            "Upstream deadlines that expired (prefill_ttfb, decode_ttfb, stream_idle); upstream cancelled",
            ["role", "deadline"],
            registry=r,
        )
        self.stream_errors = Counter(
            "pdserve_proxy_stream_errors",
            "Streams ended with an error event after the first byte had reached the client",
            ["reason"],
            registry=r,
        )
        self.background_prefill_failures = Counter(
            "pdserve_proxy_background_prefill_failures",
            "MoRIIO WRITE prefills that failed after their decode had started streaming",
            ["slot"],
            registry=r,
        )

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
        missing = []
        for family in self.registry.collect():
            if family.name not in present:
                name = f"{family.name}_total" if family.type == "counter" else family.name
                doc = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
                missing.append(f"# HELP {name} {doc}\n# TYPE {name} {family.type}\n")
        return body + "".join(missing).encode(), CONTENT_TYPE_LATEST
