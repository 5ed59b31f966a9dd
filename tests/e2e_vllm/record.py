"""Record real vLLM exchanges as JSON fixtures (tests/fixtures/vllm-<version>/).

Sent straight to the engines (not through the router), the way the router sends its legs: a
NIXL prefill leg built by pdserve's own connector, the decode leg with the prefill's
``kv_transfer_params`` unchanged, and the bad inputs a client may send (whose error bodies the
router passes through, or mimics when it refuses them itself). Unit tests hold the simulator and
the router to these files (tests/unit/test_vllm_fixtures.py) without vLLM installed.

One file per exchange: ``{"request": {"method", "path", "headers", "body" | "raw"},
"response": {"status", "content_type", "body" | "events" | "text"}}``; ``metrics-*.json``
hold the metric families (name, type, label names per sample), ``index.json`` what was
recorded and how. Values (ids, timestamps, generated text) differ between recordings; the
tests compare keys, types, statuses and error shapes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.kv.base import prefill_only
from pdserve.kv.nixl import prefill_params as nixl_prefill_params
from pdserve.wire.headers import DP_RANK, REQUEST_ID
from tests.e2e_vllm.common import MAX_MODEL_LEN, SERVED_NAME, VLLM_VERSION, Answer, check, request, say

PROMPT = "the of and to in is that for it as with was on the tiny model"
CHAT = [{"role": "user", "content": PROMPT}]
TOO_LONG = "hello " * (MAX_MODEL_LEN + 100)

#: (name, path, body, raw body, headers, engine): what clients get wrong, and how vLLM answers.
BAD_INPUTS: list[tuple[str, str, object, bytes | None, dict[str, str], str]] = [
    (
        "unknown-model",
        "/v1/completions",
        {"model": "nope", "prompt": "hi", "max_tokens": 2},
        None,
        {},
        "decode",
    ),
    ("prompt-too-long", "/v1/completions", {"prompt": TOO_LONG, "max_tokens": 2}, None, {}, "decode"),
    ("wrong-type-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "x"}, None, {}, "decode"),
    ("wrong-type-temperature", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, None, {}, "decode"),
    (
        "rank-out-of-range",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2},
        None,
        {DP_RANK: "5"},
        "decode",
    ),
    ("missing-prompt", "/v1/completions", {"max_tokens": 2}, None, {}, "decode"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, {}, "decode"),
    # pydantic takes "yes"/"true"/"1" for true: only other strings are refused
    ("stream-not-bool", "/v1/completions", {"prompt": "hi", "stream": "maybe"}, None, {}, "decode"),
    ("model-not-string", "/v1/completions", {"model": 5, "prompt": "hi"}, None, {}, "decode"),
    ("body-not-object", "/v1/completions", None, b'["hi"]', {}, "decode"),
    ("invalid-json", "/v1/completions", None, b'{"prompt": ', {}, "decode"),
    ("chat-messages-not-list", "/v1/chat/completions", {"messages": "x"}, None, {}, "decode"),
    ("chat-missing-messages", "/v1/chat/completions", {"max_tokens": 2}, None, {}, "decode"),
    ("chat-empty-messages", "/v1/chat/completions", {"messages": []}, None, {}, "decode"),
]


def exchange(
    url: str,
    method: str,
    path: str,
    body: object = None,
    raw: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], Answer]:
    answer = request(method, url + path, body, headers=headers, raw=raw)
    req: dict[str, Any] = {"method": method, "path": path, "headers": dict(headers or {})}
    if raw is not None:
        req["raw"] = raw.decode(errors="replace")
    elif body is not None:
        req["body"] = body
    content_type = answer.headers.get("content-type", "")
    resp: dict[str, Any] = {"status": answer.status, "content_type": content_type}
    if "event-stream" in content_type:
        resp["events"] = answer.events()
    elif "json" in content_type:
        resp["body"] = answer.json()
    else:
        resp["text"] = answer.body.decode(errors="replace")
    return {"request": req, "response": resp}, answer


def metric_families(url: str) -> dict[str, Any]:
    text = request("GET", url + "/metrics").body.decode()
    families: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        samples: dict[str, list[str]] = {}
        for sample in family.samples:
            names = samples.setdefault(sample.name, [])
            names.extend(k for k in sample.labels if k not in names)
        families[family.name] = {"type": family.type, "samples": {k: sorted(v) for k, v in samples.items()}}
    return families


def record(prefill_url: str, decode_url: str, out: Path) -> dict[str, Any]:
    """Record every exchange into ``out``; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "errors").mkdir(exist_ok=True)
    files: dict[str, Any] = {}

    def save(name: str, data: Mapping[str, Any]) -> None:
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        files[name] = data

    for endpoint, path, body in (
        ("completions", "/v1/completions", {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4}),
        ("chat", "/v1/chat/completions", {"model": SERVED_NAME, "messages": CHAT, "max_tokens": 4}),
    ):
        rid = f"fixture-{endpoint}-{int(time.time())}"
        prefill_body = {**prefill_only(body), "kv_transfer_params": nixl_prefill_params()}
        data, answer = exchange(prefill_url, "POST", path, prefill_body, headers={REQUEST_ID: rid})
        check(answer.status == 200, f"prefill {endpoint}: HTTP {answer.status}: {answer.body[:500]!r}")
        save(f"prefill-{endpoint}", data)
        handoff = answer.json()["kv_transfer_params"]
        check(isinstance(handoff, dict) and bool(handoff.get("remote_host")), f"prefill handoff: {handoff}")
        streamed = {
            **body,
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": handoff,
        }
        data, answer = exchange(decode_url, "POST", path, streamed, headers={REQUEST_ID: rid, DP_RANK: "0"})
        check(
            answer.status == 200 and answer.events()[-1] == "[DONE]",
            f"decode {endpoint} stream: {answer.body[:500]!r}",
        )
        save(f"decode-{endpoint}-stream", data)
        # A second prefill for the buffered decode (a handoff is pulled once).
        _, again = exchange(prefill_url, "POST", path, prefill_body, headers={REQUEST_ID: rid + "-b"})
        buffered = {**body, "kv_transfer_params": again.json()["kv_transfer_params"]}
        data, answer = exchange(
            decode_url, "POST", path, buffered, headers={REQUEST_ID: rid + "-b", DP_RANK: "1"}
        )
        check(answer.status == 200, f"decode {endpoint}: HTTP {answer.status}: {answer.body[:500]!r}")
        save(f"decode-{endpoint}", data)

    for name, path, body, raw, headers, engine in BAD_INPUTS:
        url = decode_url if engine == "decode" else prefill_url
        if isinstance(body, dict) and "model" not in body:
            body = {"model": SERVED_NAME, **body}
        data, answer = exchange(url, "POST", path, body, raw=raw, headers=headers)
        check(400 <= answer.status < 500, f"bad input {name}: HTTP {answer.status}: {answer.body[:300]!r}")
        save(f"errors/{name}", data)

    data, _ = exchange(decode_url, "GET", "/health")
    save("health", data)
    data, _ = exchange(decode_url, "GET", "/v1/models")
    save("models", data)
    save("metrics-prefill", {"families": metric_families(prefill_url)})
    save("metrics-decode", {"families": metric_families(decode_url)})
    index = {
        "vllm_version": VLLM_VERSION,
        "recorded_with": "make record-vllm-fixtures (tests/e2e_vllm/record.py)",
        "setup": "examples/cpu/nixl-1p-1d-dp2.yaml: NIXL prefill DP1, decode DP2, tiny random Llama, "
        f"--max-model-len {MAX_MODEL_LEN}",
        "files": sorted(files),
    }
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    say(f"recorded {len(files)} vLLM exchanges into {out}")
    return index
