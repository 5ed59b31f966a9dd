"""The engines' figures as vLLM's Prometheus logger writes them (the text of ``GET /metrics``).

Apart from pdserve.sim.engine.metrics, which counts: this module reads the running engines
(pdserve.sim.engine.loop), which themselves own their counters, so the two would import each
other if they were one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.sim.engine.loop import RankEngine
from pdserve.sim.engine.metrics import FAMILIES


def _le(bound: float) -> str:
    return f"{float(bound)}"


def metrics_text(model: str, engines: Sequence[RankEngine]) -> str:
    """Every rank's families, ``engine`` the global DP rank, as vLLM's Prometheus logger writes them."""
    lines: list[str] = []

    def family(name: str) -> None:
        lines.extend(FAMILIES[name].header())

    def lab(e: RankEngine, **extra: object) -> str:
        parts = [f'engine="{e.rank}"', f'model_name="{model}"', *(f'{k}="{v}"' for k, v in extra.items())]
        return "{" + ",".join(parts) + "}"

    gauges: dict[str, Callable[[RankEngine], float]] = {
        "vllm:num_requests_running": lambda e: len(e.scheduler.running),
        "vllm:num_requests_waiting": lambda e: len(e.scheduler.waiting),
        "vllm:kv_cache_usage_perc": lambda e: e.scheduler.kv.usage(),
    }
    for name, read in gauges.items():
        family(name)
        lines += [f"{name}{lab(e)} {read(e)}" for e in engines]
    family("vllm:cache_config_info")
    for e in engines:
        c = e.config
        lines.append(
            f'vllm:cache_config_info{{block_size="{c.block_size}",enable_prefix_caching='
            f'"{c.enable_prefix_caching}",engine="{e.rank}",num_gpu_blocks="{c.num_gpu_blocks}"}} 1.0'
        )
    counters: dict[str, Callable[[RankEngine], int]] = {
        "vllm:prefix_cache_queries": lambda e: e.scheduler.counters.prefix_queries,
        "vllm:prefix_cache_hits": lambda e: e.scheduler.counters.prefix_hits,
        "vllm:external_prefix_cache_queries": lambda e: e.scheduler.counters.external_queries,
        "vllm:external_prefix_cache_hits": lambda e: e.scheduler.counters.external_hits,
        "vllm:num_preemptions": lambda e: e.scheduler.counters.preemptions,
        "vllm:prompt_tokens": lambda e: e.metrics.prompt_tokens,
        "vllm:prompt_tokens_cached": lambda e: e.metrics.cached_prompt_tokens,
        "vllm:generation_tokens": lambda e: e.metrics.generation_tokens,
    }
    for name, count in counters.items():
        family(name)
        lines += [f"{name}_total{lab(e)} {count(e)}" for e in engines]
    family("vllm:request_success")
    for e in engines:
        for reason in ("length", "stop"):
            lines.append(
                f"vllm:request_success_total{lab(e, finished_reason=reason)} {e.metrics.success[reason]}"
            )
    for name in engines[0].metrics.histograms if engines else ():
        family(name)
        for e in engines:
            h = e.metrics.histograms[name]
            running = 0
            for bound, n in zip([*h.bounds, float("inf")], h.counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else _le(bound)
                lines.append(f"{name}_bucket{lab(e, le=le)} {running}")
            lines.append(f"{name}_count{lab(e)} {h.n}")
            lines.append(f"{name}_sum{lab(e)} {h.total}")
    return "\n".join(lines) + "\n"
