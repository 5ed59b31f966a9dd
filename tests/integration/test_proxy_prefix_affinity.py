"""prefix-affinity through a real router and simulated engines with prefix caching (issue 26):
the turns of a conversation reach the rank that holds their prefix, the engines' own prefix
cache says so, an unchunkable prompt is counted, and the index is sized from the engine's KV
capacity. (The fairness properties are unit-tested; this checks the wiring end to end, with the
worker processes `make test-workers` asks for.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pdstack import PDStack, eventually, http
from tests.support.procs import ProcessGroup

ENGINE = ["--profile", "h200-llama-3.1-8b", "--block-size", "16", "--num-gpu-blocks-override", "2000"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    group = ProcessGroup(Path(tmp_path_factory.mktemp("pd-prefix")))
    pd = PDStack(group, group.log_dir)
    try:
        pd.sim("p0", "prefill", dp_size=2, extra=ENGINE, wait=False)
        pd.sim("d0", "decode", dp_size=1, extra=ENGINE, wait=False)
        pd.wait_sims()
        pd.write(pd.table([pd.sims["p0"]], [pd.sims["d0"]]), wait=False)
        pd.start_proxy(
            "--prefill-policy", "prefix-affinity", "--prefix-chunk-chars", "32", "--prefix-min-match", "64"
        )
        yield pd
    finally:
        group.stop_all()


def engine_counts(url: str) -> tuple[float, float]:
    """The engine's prefix-cache (hits, queries), all ranks."""
    text = http("GET", url + "/metrics").body.decode()
    hits = sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))
    queries = sum(
        float(v) for v in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)", text, re.M)
    )
    return hits, queries


def test_conversations_stay_on_the_rank_that_holds_them(stack: PDStack) -> None:
    prefill = stack.sims["p0"]
    eventually(lambda: stack.debug()["prefix"]["slots"].get("p0/0", {}).get("sized_from") == "engine")
    capacity = stack.debug()["prefix"]["slots"]["p0/0"]["capacity"]
    assert capacity == 2000 * 16 * 4 // 32  # blocks x block size x chars per token / chunk chars
    conversations = 6
    turns = 4
    for c in range(conversations):
        text = f"conversation {c} opens:"
        for t in range(turns):
            text += " " + " ".join(f"c{c}t{t}w{i}" for i in range(40))
            answer = stack.complete(prompt=text, max_tokens=2)
            assert answer.status == 200, answer.body
    # every turn after a conversation's first went where its prefix was
    affinity = stack.metric("pdserve_proxy_prefix_routed_total", how="affinity")
    assert affinity == conversations * (turns - 1)
    # ... and the engine found it there: every later turn's earlier turns (whole 16-token
    # blocks) were hits, so at least half of all prompt blocks were
    hits, queries = engine_counts(prefill.url)
    assert queries > 0 and hits / queries >= 0.5, (hits, queries)
    matched = stack.metric("pdserve_proxy_prefix_matched_chars_total")
    assert matched > 0
    rows = {row["slot"]: row for row in stack.debug()["slots"]["prefill"]}
    assert all(row["prefix_index_chunks"] > 0 for row in rows.values())  # both ranks got conversations


def test_a_prompt_without_text_goes_flat_and_is_counted(stack: PDStack) -> None:
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    body = {"messages": [{"role": "user", "content": image}], "max_tokens": 2}
    answer = http("POST", stack.url + "/v1/chat/completions", body)
    assert answer.status == 200, answer.body
    assert stack.metric("pdserve_proxy_prefix_unchunkable_total", reason="non_text") == 1
    assert stack.metric("pdserve_proxy_prefix_routed_total", how="unchunkable") == 1
