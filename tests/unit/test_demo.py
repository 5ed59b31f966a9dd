"""`make demo`'s verdict: it passes only on an even, complete, failure-free run."""

from __future__ import annotations

from pathlib import Path

from pdserve.local.demo import SlotResult, _report
from pdserve.routing import Role


def _results(decode_counts: list[int], engine_offset: int = 0) -> list[SlotResult]:
    prefill = [SlotResult(Role.PREFILL, "p-0", r, 4, 0, 4) for r in range(2)]
    decode = [SlotResult(Role.DECODE, "d-0", r, n, 0, n + engine_offset) for r, n in enumerate(decode_counts)]
    return prefill + decode


def test_even_run_passes_and_writes_the_chart(tmp_path: Path) -> None:
    chart = tmp_path / "out" / "slots.png"
    assert _report(_results([4, 4]), [], 8, 0.5, chart) is True
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_a_slot_without_requests_fails(tmp_path: Path) -> None:
    assert _report(_results([8, 0]), [], 8, 0.5, tmp_path / "c.png") is False


def test_a_failed_request_fails(tmp_path: Path) -> None:
    assert _report(_results([4, 4]), ["request 3: HTTP 502"], 8, 0.5, tmp_path / "c.png") is False


def test_engine_counts_that_disagree_with_the_router_fail(tmp_path: Path) -> None:
    assert _report(_results([4, 4], engine_offset=1), [], 8, 0.5, tmp_path / "c.png") is False
