"""The Mooncake case of `make e2e-vllm`: examples/cpu/mooncake-1p-1d-dp2.yaml on real vLLM, where
it runs (vLLM 0.32's MooncakeConnector, the Mooncake transfer engine over TCP).

It runs where vLLM starts a MooncakeConnector: then every request of a burst succeeds, the
decode's external prefix-cache hits rise by exactly the prompt tokens (the KV came from the
prefill), each decode rank serves exactly half, the prefill exactly one leg per request, and a
greedy answer through P/D equals the prefill engine's own answer to the same prompt (a decode with
KV that never came would compute from nothing and answer otherwise). Where it cannot run (on this
project's CPU machines vLLM 0.32's connector asks torch for an accelerator and its engines die
with "Found no NVIDIA driver"; or the mooncake package cannot load) the case says exactly why and
the e2e goes on: it is reported, not failed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.e2e_vllm.common import REPO, SERVED_NAME, check, metrics, request, say, total
from tests.e2e_vllm.up import Up

MANIFEST = REPO / "examples" / "cpu" / "mooncake-1p-1d-dp2.yaml"
BURST = 12
GREEDY = 3
#: A line of an engine's log that means vLLM could not start the engine at all.
FATAL = "Engine core initialization failed"


def mooncake_case(work: Path, manifest: Path = MANIFEST) -> dict[str, Any]:
    up = Up(work / "up-mooncake", manifest=manifest)
    up.start()
    try:
        reason = _wait_serving_or_reason(up)
        if reason is not None:
            say(f"Mooncake: not runnable here: {reason}")
            up.kill()
            return {"runnable": False, "reason": reason}
        prefill, decode = up.engine("prefill"), up.engine("decode")
        figures: dict[str, Any] = {"runnable": True, **burst(up, prefill["url"], decode["url"])}
        figures["greedy_equal"] = greedy(up, prefill["url"])
        figures["seconds_to_stop"] = round(up.stop(), 1)
        return figures
    except BaseException:
        say(f"Mooncake case failed; logs kept in {up.log_dir}")
        up.kill()
        raise


def _wait_serving_or_reason(up: Up, timeout: float = 900.0) -> str | None:
    """None once the router serves every instance; else why not: pdserve up's refusal, or the
    root cause an engine logged when vLLM could not start it."""
    assert up.popen is not None
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if up.popen.poll() is not None:
            return f"pdserve up exited with {up.popen.returncode}: " + " / ".join(up.lines[-3:])
        for log in sorted(up.log_dir.glob("*.log")):
            text = log.read_text(errors="replace")
            if FATAL in text:
                return f"{log.stem}: {_root_cause(text)}"
        if _serving(up):
            return None
        time.sleep(1.0)
    check(False, f"Mooncake: not serving after {timeout:.0f} s and no engine said why")
    return None


def _serving(up: Up) -> bool:
    try:
        if request("GET", up.url + "/ready", timeout=2).status != 200:
            return False
        return all(i["ready"] for i in [*up.table()["prefill"], *up.table()["decode"]])
    except (OSError, ValueError, KeyError):
        return False


def _root_cause(text: str) -> str:
    """The first exception an engine's log names (vLLM prints its workers' tracebacks first)."""
    for line in text.splitlines():
        for marker in ("RuntimeError: ", "ImportError: ", "ModuleNotFoundError: ", "ValueError: "):
            if marker in line:
                return line[line.index(marker) :].strip()
    return "see the engine's log"


def _body(i: int) -> dict[str, Any]:
    prompt = " ".join(["mooncake", "moves", "the", "cache", "of", "request", str(i)] * (1 + i % 3))
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}


def burst(up: Up, prefill_url: str, decode_url: str) -> dict[str, Any]:
    say(f"Mooncake: {BURST} requests through the router, 4 at a time")
    before_d, before_p, before_r = metrics(decode_url), metrics(prefill_url), metrics(up.url)
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda i: request("POST", up.url + "/v1/completions", _body(i)), range(BURST))
        )
    for answer in answers:
        check(answer.status == 200, f"Mooncake: HTTP {answer.status}: {answer.body[:300]!r}")
    prompt_tokens = sum(int(a.json()["usage"]["prompt_tokens"]) for a in answers)
    after_d, after_p, after_r = metrics(decode_url), metrics(prefill_url), metrics(up.url)

    def delta(after: Any, before: Any, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    figures = {
        "requests": BURST,
        "prompt_tokens": prompt_tokens,
        "decode_external_prefix_cache_hits": delta(
            after_d, before_d, "vllm:external_prefix_cache_hits_total"
        ),
        "decode_success_per_rank": [
            delta(after_d, before_d, "vllm:request_success_total", engine=str(r)) for r in (0, 1)
        ],
        "prefill_success": delta(after_p, before_p, "vllm:request_success_total"),
        "router_ok": delta(after_r, before_r, "pdserve_proxy_requests_total", outcome="ok"),
    }
    say(f"Mooncake burst: {figures}")
    hits = figures["decode_external_prefix_cache_hits"]
    check(
        hits == prompt_tokens,
        f"Mooncake: the decode got {hits} prompt tokens' KV, prompts had {prompt_tokens}",
    )
    check(figures["decode_success_per_rank"] == [BURST / 2] * 2, f"Mooncake: per-rank {figures}")
    check(figures["prefill_success"] == BURST, f"Mooncake: {figures['prefill_success']} prefills")
    check(figures["router_ok"] == BURST, f"Mooncake: router ok {figures['router_ok']}")
    return figures


def greedy(up: Up, prefill_url: str) -> int:
    """Greedy answers through P/D equal the prefill engine's own: the decode computed from the KV
    the prefill made, not from an empty cache."""
    for i in range(GREEDY):
        body = {**_body(100 + i), "max_tokens": 8}
        through = request("POST", up.url + "/v1/completions", body)
        alone = request("POST", prefill_url + "/v1/completions", body)
        check(through.status == alone.status == 200, f"Mooncake greedy: {through.status}, {alone.status}")
        a, b = through.json()["choices"][0]["text"], alone.json()["choices"][0]["text"]
        check(a == b, f"Mooncake: P/D answered {a!r}, the prefill alone {b!r}")
    say(f"Mooncake: {GREEDY} greedy answers through P/D equal the prefill's own")
    return GREEDY
