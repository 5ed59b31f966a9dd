"""What an engine rank counts, and its Prometheus text under vLLM 0.32's names, types, labels
and histogram buckets (vllm/v1/metrics/loggers.py, buckets.py), so dashboards and routers built
for vLLM read the simulator unchanged (held by tests/unit/test_vllm_fixtures.py).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.sim.engine.request import Request
from pdserve.wire.prometheus import Family

if TYPE_CHECKING:
    from pdserve.sim.engine.scheduler import Step

REQUEST_LATENCY: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0)
REQUEST_LATENCY += (40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TIME_TO_FIRST_TOKEN += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75)
INTER_TOKEN_LATENCY += (1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)


#: Labels of every sample: the global DP rank and the served model.
_ENGINE = ("engine", "model_name")

#: vLLM's families the simulator writes (pdserve.sim.engine.exposition), by name, in vLLM's order.
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", _ENGINE
        ),
        Family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", _ENGINE),
        Family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", _ENGINE),
        Family(
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"),
        ),
        Family(
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            _ENGINE,
        ),
        Family(
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            _ENGINE,
        ),
        Family(
            "vllm:external_prefix_cache_queries",
            "counter",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.",
            _ENGINE,
        ),
        Family(
            "vllm:external_prefix_cache_hits",
            "counter",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
            "number of cached tokens.",
            _ENGINE,
        ),
        Family(
            "vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", _ENGINE
        ),
        Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", _ENGINE),
        Family(
            "vllm:prompt_tokens_cached",
            "counter",
            "Number of cached prompt tokens (local + external).",
            _ENGINE,
        ),
        Family("vllm:generation_tokens", "counter", "Number of generation tokens processed.", _ENGINE),
        Family(
            "vllm:request_success",
            "counter",
            "Count of successfully processed requests.",
            (*_ENGINE, "finished_reason"),
        ),
        Family(
            "vllm:time_to_first_token_seconds",
            "histogram",
            "Histogram of time to first token in seconds.",
            _ENGINE,
            buckets=TIME_TO_FIRST_TOKEN,
        ),
        Family(
            "vllm:inter_token_latency_seconds",
            "histogram",
            "Histogram of inter-token latency in seconds.",
            _ENGINE,
            buckets=INTER_TOKEN_LATENCY,
        ),
        Family(
            "vllm:request_time_per_output_token_seconds",
            "histogram",
            "Histogram of time_per_output_token_seconds per request.",
            _ENGINE,
            buckets=INTER_TOKEN_LATENCY,
        ),
        Family(
            "vllm:e2e_request_latency_seconds",
            "histogram",
            "Histogram of e2e request latency in seconds.",
            _ENGINE,
            buckets=REQUEST_LATENCY,
        ),
        Family(
            "vllm:request_queue_time_seconds",
            "histogram",
            "Histogram of time spent in WAITING phase for request.",
            _ENGINE,
            buckets=REQUEST_LATENCY,
        ),
        Family(
            "vllm:request_inference_time_seconds",
            "histogram",
            "Histogram of time spent in RUNNING phase for request.",
            _ENGINE,
            buckets=REQUEST_LATENCY,
        ),
        Family(
            "vllm:request_prefill_time_seconds",
            "histogram",
            "Histogram of time spent in PREFILL phase for request.",
            _ENGINE,
            buckets=REQUEST_LATENCY,
        ),
        Family(
            "vllm:request_decode_time_seconds",
            "histogram",
            "Histogram of time spent in DECODE phase for request.",
            _ENGINE,
            buckets=REQUEST_LATENCY,
        ),
        Family(
            "vllm:iteration_tokens_total",
            "histogram",
            "Histogram of number of tokens per engine_step.",
            _ENGINE,
            buckets=ITERATION_TOKENS,
        ),
        Family(
            "vllm:request_num_preemptions",
            "histogram",
            "Histogram of the number of times a request was preempted.",
            _ENGINE,
            buckets=REQUEST_NUM_PREEMPTIONS,
        ),
    )
}


@dataclass
class Histogram:
    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1


@dataclass
class RankMetrics:
    """One rank's counters and histograms (gauges are read from the scheduler when rendered)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    success: Counter[str] = field(default_factory=Counter)
    expired_leases: int = 0
    pulls: int = 0
    pulled_tokens: int = 0
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for family in FAMILIES.values():
            if family.kind == "histogram":
                self.histograms[family.name] = Histogram(family.buckets)

    def on_pull(self, request: Request, seconds: float) -> None:
        self.pulls += 1
        self.pulled_tokens += request.num_external_tokens

    def on_step(self, step: Step, emitted: list[Request], now: float) -> None:
        h = self.histograms
        h["vllm:iteration_tokens_total"].observe(sum(n for _, n in step.scheduled))
        for request in emitted:
            self.generation_tokens += 1
            if request.num_output_tokens == 1:  # its prefill just ended
                self.prompt_tokens += request.num_prompt_tokens
                self.cached_prompt_tokens += max(0, request.num_cached_tokens)
                h["vllm:time_to_first_token_seconds"].observe(now - request.arrival)
            elif request.previous_token is not None:
                h["vllm:inter_token_latency_seconds"].observe(now - request.previous_token)
            request.previous_token = now
            if request.finished is not None:
                self._finished(request)

    def _finished(self, request: Request) -> None:
        h = self.histograms
        scheduled = request.first_scheduled if request.first_scheduled is not None else request.arrival
        first = request.first_token if request.first_token is not None else scheduled
        end = request.finished if request.finished is not None else first
        self.success[request.finish_reason] += 1
        h["vllm:e2e_request_latency_seconds"].observe(end - request.arrival)
        h["vllm:request_queue_time_seconds"].observe(scheduled - request.arrival)
        h["vllm:request_inference_time_seconds"].observe(end - scheduled)
        h["vllm:request_prefill_time_seconds"].observe(first - scheduled)
        h["vllm:request_decode_time_seconds"].observe(end - first)
        h["vllm:request_num_preemptions"].observe(request.num_preemptions)
        if request.num_output_tokens > 1:
            h["vllm:request_time_per_output_token_seconds"].observe(
                (end - first) / (request.num_output_tokens - 1)
            )
