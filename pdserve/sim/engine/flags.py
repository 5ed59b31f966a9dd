"""``pdserve sim``'s engine flags, named and defaulted as vLLM's, and what they make."""

from __future__ import annotations

import argparse

from pdserve.argtypes import positive_int
from pdserve.sim.engine.profile import ProfileError, load, packaged_names
from pdserve.sim.engine.runtime import EngineSetup
from pdserve.sim.engine.scheduler import EngineConfig

#: NIXL's default kv_lease_duration (seconds), vLLM 0.32.
KV_LEASE_SECONDS = 30.0


class EngineFlagError(ValueError):
    """Engine flags that cannot work together; the message names them."""


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "step-based engine (--profile; vLLM's flag names and defaults; docs/simulator.md)"
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="FILE|NAME",
        help="time answers with a per-rank step engine and this performance profile (a YAML file, or "
        f"a packaged one: {', '.join(packaged_names())}); without it: fixed --ttft-ms/--itl-ms",
    )
    g.add_argument("--max-num-seqs", type=positive_int, default=None, help="running sequences per rank")
    g.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=None, help="token budget of one step"
    )
    g.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None, help="KV blocks per rank")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a cached prompt prefix (default: on, as vLLM)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens in answers, as vLLM",
    )
    g.add_argument(
        "--kv-lease-duration",
        type=float,
        default=KV_LEASE_SECONDS,
        help="seconds a prefill holds a finished leg's KV for its decode (NIXL's kv_lease_duration, "
        "default: 30)",
    )


def engine_setup(args: argparse.Namespace, max_model_len: int) -> EngineSetup | None:
    """The engine ``args`` ask for (None without --profile); ProfileError or EngineFlagError."""
    if args.profile is None:
        return None
    profile = load(args.profile)
    d = profile.engine
    if args.kv_lease_duration < 0:
        raise EngineFlagError(f"--kv-lease-duration must not be negative, got {args.kv_lease_duration:g}")
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs or d.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or d.max_num_batched_tokens,
        block_size=args.block_size or d.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override or d.num_gpu_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_lease_seconds=args.kv_lease_duration,
    )
    capacity = (config.num_gpu_blocks - 1) * config.block_size
    if capacity < max_model_len:
        # vLLM refuses to start when one request of max_model_len cannot fit in the KV cache.
        raise EngineFlagError(
            f"the KV cache holds {capacity} tokens ({config.num_gpu_blocks} blocks of {config.block_size}, "
            f"one of them vLLM's null block), fewer than --max-model-len {max_model_len}: raise "
            "--num-gpu-blocks-override or lower --max-model-len"
        )
    return EngineSetup(profile, config)


def ignored_without_profile(args: argparse.Namespace) -> list[str]:
    """Engine flags given without --profile (they change nothing then)."""
    named = {
        "--max-num-seqs": args.max_num_seqs,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--block-size": args.block_size,
        "--num-gpu-blocks-override": args.num_gpu_blocks_override,
    }
    return [flag for flag, value in named.items() if value is not None] if args.profile is None else []


__all__ = ["EngineFlagError", "ProfileError", "configure", "engine_setup", "ignored_without_profile"]
