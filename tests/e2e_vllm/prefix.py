"""Real vLLM's prefix cache under the prefill policies (issue 26 item 5): prefill DP2 with prefix
caching, a multi-turn workload, and vLLM's own ``vllm:prefix_cache_hits_total``.

`pdserve up examples/cpu/nixl-2p-dp2-prefix.yaml --engine vllm` serves through its router, which
walks the two prefill ranks with the flat interleave; a second router, ``pdserve proxy
--prefill-policy prefix-affinity``, reads the same routing file. The same workload shape goes
through each (conversations of several turns, each turn the previous prompt plus new text, the
conversations interleaved), with new texts for the second so that nothing the first left in the
cache can be hit. Under the flat interleave a turn lands on the rank holding its earlier turns
about half the time; under prefix-affinity every turn after the first should. The check: the
prefill's hits rise more with prefix-affinity, and the router sent every later turn by affinity.

The prompts are short (the tiny model's context is 512 tokens), so the router's chunks and
minimum match are small too (``--prefix-chunk-chars 64 --prefix-min-match 128``).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e_vllm.common import REPO, SERVED_NAME, check, engine_env, metrics, request, say, total
from tests.e2e_vllm.up import Up
from tests.support.procs import free_port, wait_http

MANIFEST = REPO / "examples" / "cpu" / "nixl-2p-dp2-prefix.yaml"
CONVERSATIONS = 6
TURNS = 4
WORDS_PER_TURN = 45
FILLER = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "model"]
AFFINITY_FLAGS = [
    "--prefill-policy",
    "prefix-affinity",
    "--prefix-chunk-chars",
    "64",
    "--prefix-min-match",
    "128",
]


def workload(seed: int) -> list[str]:
    """Every turn's prompt, conversations interleaved at random (the same shape for every seed)."""
    rng = random.Random(seed)
    prompts = {c: f"conversation {seed}-{c}:" for c in range(CONVERSATIONS)}
    order = [c for c in range(CONVERSATIONS) for _ in range(TURNS)]
    rng.shuffle(order)
    out = []
    for c in order:
        prompts[c] += " " + " ".join(rng.choice(FILLER) for _ in range(WORDS_PER_TURN))
        out.append(prompts[c])
    return out


def through(url: str, prompts: list[str], prefill_url: str) -> dict[str, float]:
    """Each prompt through the router at ``url`` (one at a time); the prefill's prefix-cache
    hits and queries meanwhile (tokens, all ranks)."""
    before = metrics(prefill_url)
    for prompt in prompts:
        answer = request(
            "POST", url + "/v1/completions", {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2}
        )
        check(answer.status == 200, f"a multi-turn request failed: {answer.status} {answer.body[:300]!r}")
    after = metrics(prefill_url)
    hits = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
    queries = total(after, "vllm:prefix_cache_queries_total") - total(
        before, "vllm:prefix_cache_queries_total"
    )
    return {"hits": hits, "queries": queries, "hit_ratio": round(hits / queries, 3) if queries else 0.0}


def prefix_policies(work: Path) -> dict[str, Any]:
    up = Up(work / "up-prefix", manifest=MANIFEST)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        up.start()
        say(f"prefill DP2 with prefix caching serving after {up.wait_serving():.0f} s")
        prefill = up.engine("prefill")["url"]
        flat = through(up.url, workload(1), prefill)
        say(f"flat interleave: prefill prefix-cache hits {flat['hits']:.0f} of {flat['queries']:.0f} tokens")
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "proxy",
            "--routing-file",
            str(up.log_dir / "routing.json"),
        ]
        argv += [*AFFINITY_FLAGS, "--workers", "2", "--host", "127.0.0.1", "--port", str(port)]
        with (work / "prefix-proxy.log").open("wb") as log:
            proxy = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=engine_env())
        router = f"http://127.0.0.1:{port}"
        wait_http(router + "/ready", timeout=60, proc=proxy)
        affinity = through(router, workload(2), prefill)
        hits, queries = affinity["hits"], affinity["queries"]
        say(f"prefix-affinity: prefill prefix-cache hits {hits:.0f} of {queries:.0f} tokens")
        routed = total(metrics(router), "pdserve_proxy_prefix_routed_total", how="affinity")
        check(
            routed == CONVERSATIONS * (TURNS - 1),
            f"prefix-affinity sent {routed:.0f} turns by affinity, expected {CONVERSATIONS * (TURNS - 1)}",
        )
        check(
            affinity["hits"] > flat["hits"],
            f"real vLLM's prefix-cache hits did not rise more with prefix-affinity ({affinity['hits']:.0f}) "
            f"than with the flat interleave ({flat['hits']:.0f})",
        )
    except BaseException:
        up.kill()
        raise
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
    up.stop()
    return {"flat": flat, "prefix_affinity": affinity, "affinity_turns": routed}
