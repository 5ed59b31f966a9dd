"""`make demo`'s verdict: it passes only on an even, complete, failure-free run."""

from __future__ import annotations

from pathlib import Path

from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.local.demo import EXAMPLE, SlotResult, _report, with_placement
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


# --- placement decode-sidecar: the sidecars' counts summed, and equal traffic per sidecar ---------


def _exact(prefill: list[int], decode: list[int]) -> list[SlotResult]:
    return [SlotResult(Role.PREFILL, "p-0", r, n, 0, n) for r, n in enumerate(prefill)] + [
        SlotResult(Role.DECODE, f"d-{r // 2}", r % 2, n, 0, n) for r, n in enumerate(decode)
    ]


def test_sidecar_run_with_exact_shares_and_equal_traffic_passes(tmp_path: Path) -> None:
    results = _exact([4, 4], [2, 2, 2, 2])
    assert _report(results, [], 8, 0.5, tmp_path / "c.png", {"d-0": 4, "d-1": 4}) is True


def test_sidecars_with_unequal_traffic_fail(tmp_path: Path) -> None:
    results = _exact([4, 4], [3, 3, 1, 1])
    assert _report(results, [], 8, 0.5, tmp_path / "c.png", {"d-0": 6, "d-1": 2}) is False


def test_a_burst_that_divides_evenly_must_give_every_slot_exactly_its_share(tmp_path: Path) -> None:
    assert (
        _report(_exact([5, 3], [2, 2, 2, 2]), [], 8, 0.5, tmp_path / "c.png", {"d-0": 4, "d-1": 4}) is False
    )
    assert _report(_exact([4, 4], [3, 1, 2, 2]), [], 8, 0.5, tmp_path / "c.png") is False


def test_with_placement_sets_the_field_and_keeps_the_manifest(tmp_path: Path) -> None:
    copy = tmp_path / "m.yaml"
    copy.write_text(with_placement(EXAMPLE.read_text(), "decode-sidecar"))
    pdd, original = load_manifest_file(copy), load_manifest_file(EXAMPLE)
    assert pdd.spec.router.decode_sidecar
    assert pdd.name == original.name and pdd.spec.decode == original.spec.decode


def test_both_placements_list_slots_in_the_tables_order() -> None:
    """A router lists slots in its walk's order, merged sidecars each their own: the report and
    the chart list them instance by instance, rank by rank, in both."""
    from pdserve.local.demo import in_slot_order

    table = {"prefill": [{"name": "p-0"}, {"name": "p-1"}], "decode": [{"name": "d-0"}, {"name": "d-1"}]}
    walk = [
        SlotResult(Role.DECODE, "d-1", 0, 1, 0, 1),
        SlotResult(Role.PREFILL, "p-1", 0, 1, 0, 1),
        SlotResult(Role.DECODE, "d-0", 1, 1, 0, 1),
        SlotResult(Role.PREFILL, "p-0", 1, 1, 0, 1),
        SlotResult(Role.PREFILL, "p-0", 0, 1, 0, 1),
        SlotResult(Role.DECODE, "d-0", 0, 1, 0, 1),
    ]
    assert [(r.instance, r.rank) for r in in_slot_order(walk, table)] == [
        ("p-0", 0), ("p-0", 1), ("p-1", 0), ("d-0", 0), ("d-0", 1), ("d-1", 0),
    ]  # fmt: skip


def test_a_chart_with_errors_and_an_uneven_spread_is_drawn(tmp_path: Path) -> None:
    results = [SlotResult(Role.PREFILL, "p-0", r, n, e, n) for r, (n, e) in enumerate([(5, 1), (3, 0)])]
    results += [SlotResult(Role.DECODE, "d-0", 0, 8, 0, 8)]
    chart = tmp_path / "c.png"
    assert _report(results, ["request 1: HTTP 502"], 8, 0.5, chart) is False
    assert chart.read_bytes().startswith(b"\x89PNG")
