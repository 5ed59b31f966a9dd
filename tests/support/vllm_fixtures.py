"""Recorded real-vLLM exchanges (tests/fixtures/vllm-<version>/) and how answers are compared to them.

Values differ between any two answers (ids, timestamps, text); what must not differ is the
shape: the same keys, the same JSON types (null is a type of its own), the same status, and
for a stream the same kinds of events in the same order (opening role chunk, token chunks,
the chunk with ``finish_reason``, the usage chunk, ``[DONE]``). Written by
tests/e2e_vllm/record.py; used by tests/unit/test_vllm_fixtures.py and the e2e itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.wire import vllm

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = vllm.VERSION
FIXTURES = REPO / "tests" / "fixtures" / f"vllm-{VLLM_VERSION}"


def load(name: str, root: Path = FIXTURES) -> dict[str, Any]:
    return dict(json.loads((root / f"{name}.json").read_text()))


def names(root: Path = FIXTURES) -> list[str]:
    return sorted(
        str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.json") if p.name != "index.json"
    )


def kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object" if isinstance(value, Mapping) else type(value).__name__


def shape_problems(expected: object, actual: object, path: str = "") -> list[str]:
    """Where ``actual`` has other keys or JSON types than ``expected`` (lists: their first items)."""
    where = path or "(top)"
    if kind(expected) != kind(actual):
        return [f"{where}: {kind(expected)} in vLLM's answer, {kind(actual)} here ({_short(actual)})"]
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        out = []
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        if missing:
            out.append(f"{where}: missing {missing}")
        if extra:
            out.append(f"{where}: not in vLLM's answer {extra}")
        for key in sorted(set(expected) & set(actual)):
            out += shape_problems(expected[key], actual[key], f"{path}.{key}")
        return out
    if isinstance(expected, list) and isinstance(actual, list) and expected and actual:
        return shape_problems(expected[0], actual[0], f"{path}[0]")
    return []


def event_kind(event: object) -> str:
    """What an SSE event of an OpenAI stream is: done, error, usage, role, final or token."""
    if event == "[DONE]":
        return "done"
    if not isinstance(event, Mapping):
        return "other"
    if "error" in event:
        return "error"
    choices = event.get("choices") or []
    if not choices:
        return "usage" if event.get("usage") else "empty"
    choice = choices[0]
    if "role" in (choice.get("delta") or {}):
        return "role"
    return "final" if choice.get("finish_reason") else "token"


def events_problems(expected: Sequence[object], actual: Sequence[object]) -> list[str]:
    """Same kinds of events in the same order (tokens may repeat), each kind with vLLM's shape."""

    def collapse(events: Sequence[object]) -> list[str]:
        kinds: list[str] = []
        for event in events:
            k = event_kind(event)
            if not kinds or kinds[-1] != k or k != "token":
                kinds.append(k)
        return kinds

    out = []
    if collapse(expected) != collapse(actual):
        out.append(f"stream events {collapse(actual)}, vLLM sends {collapse(expected)}")
    first = {event_kind(e): e for e in reversed(expected)}
    for event in actual:
        k = event_kind(event)
        if k in first and k != "done":
            out += shape_problems(first[k], event, f"<{k} event>")
    return out


def response_problems(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """A recorded ``response`` against another answer to the same request."""
    out = []
    if expected["status"] != actual["status"]:
        out.append(f"status {actual['status']}, vLLM answers {expected['status']}")
    want, got = _media(expected.get("content_type", "")), _media(actual.get("content_type", ""))
    if want != got:
        out.append(f"content type {got!r}, vLLM sends {want!r}")
    if "events" in expected:
        out += events_problems(expected["events"], actual.get("events") or [])
    elif "body" in expected:
        out += shape_problems(expected["body"], actual.get("body"))
    return out


def metric_problems(vllm: Mapping[str, Any], ours: Mapping[str, Any], subset: bool = True) -> list[str]:
    """Every metric family of ``ours`` exists in ``vllm`` with its type and label names; with
    ``subset=False`` also the reverse."""
    out = []
    for name, family in ours.items():
        theirs = vllm.get(name)
        if theirs is None:
            out.append(f"metric {name} is not one of vLLM's")
            continue
        if theirs["type"] != family["type"]:
            out.append(f"metric {name}: type {family['type']}, vLLM's is {theirs['type']}")
        for sample, labels in family["samples"].items():
            want = theirs["samples"].get(sample)
            if want is None:
                out.append(f"metric {name}: sample {sample} is not one of vLLM's")
            elif not set(labels) <= set(want):
                out.append(f"metric {sample}: labels {sorted(set(labels) - set(want))} are not vLLM's")
    if not subset:
        out += [f"metric {name} missing" for name in vllm if name not in ours]
    return out


def compare_recordings(expected_root: Path, actual_root: Path) -> list[str]:
    """Two recordings of vLLM (the committed fixtures and a fresh one): same files, same shapes."""
    out = []
    for name in names(expected_root):
        path = actual_root / f"{name}.json"
        if not path.exists():
            out.append(f"{name}: not recorded this time")
            continue
        want, got = load(name, expected_root), load(name, actual_root)
        if name.startswith("metrics-"):
            out += [f"{name}: {p}" for p in metric_problems(want["families"], got["families"], subset=False)]
        else:
            out += [f"{name}: {p}" for p in response_problems(want["response"], got["response"])]
    return out


def _media(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
