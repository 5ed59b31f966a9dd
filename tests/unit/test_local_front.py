"""The front of `pdserve up` with placement decode-sidecar: round robin over the Ready sidecars,
and one /debug/routing merged from theirs for the view and the demo."""

from __future__ import annotations

from typing import Any

from pdserve.local.front import Front, SidecarEndpoint, merge_debug
from pdserve.local.view import render_frame, slot_counters, summary_line
from pdserve.routing import Role

D0 = SidecarEndpoint("d-0", "http://127.0.0.1:9101")
D1 = SidecarEndpoint("d-1", "http://127.0.0.1:9102")
D2 = SidecarEndpoint("d-2", "http://127.0.0.1:9103")


def test_round_robin_over_the_ready_sidecars_only() -> None:
    front = Front([D0, D1, D2], "127.0.0.1", 0)
    assert front.pick() is None
    front.set_ready(["d-0", "d-1", "d-2"])
    assert [front.pick() for _ in range(6)] == [D0, D1, D2, D0, D1, D2]
    front.set_ready(["d-0", "d-2"])  # d-1 left the endpoints
    picks = [front.pick() for _ in range(4)]
    assert D1 not in picks and {p.instance for p in picks if p} == {"d-0", "d-2"}


def _doc(decode: str, generation: int, prefill: list[tuple[str, int]], ranks: list[int]) -> dict[str, Any]:
    def row(slot: str, n: int) -> dict[str, Any]:
        return {"slot": slot, "url": "u", "requests": n, "in_flight": 0, "errors": 0, "pinned": 0}

    return {
        "source": "file r.json",
        "policy": "flat-interleaved",
        "last_reload_error": None,
        "generation": generation,
        "table": {"deployment": "demo", "prefill": [], "decode": []},
        "slots": {
            "prefill": [row(slot, n) for slot, n in prefill],
            "decode": [row(f"{decode}/{r}", n) for r, n in enumerate(ranks)],
        },
    }


def test_merge_sums_prefill_slots_and_keeps_each_sidecars_decode_ranks() -> None:
    # Each sidecar walks every prefill slot from its own offset: the order of sidecar 0 is the flat one.
    docs = [
        (D0, _doc("d-0", 5, [("p-0/0", 2), ("p-0/1", 2), ("p-1/0", 1)], [3, 2])),
        (D1, _doc("d-1", 4, [("p-1/0", 2), ("p-0/0", 1), ("p-0/1", 1)], [2, 2])),
        (D2, None),  # did not answer
    ]
    merged = merge_debug(docs, {"d-0", "d-1"}, {"d-0": 5, "d-1": 4})
    assert merged["placement"] == "decode-sidecar"
    assert merged["generation"] == 4, "the generation every answering sidecar has reached"
    counters = slot_counters(merged)
    assert [(c.role, c.instance, c.rank, c.requests) for c in counters] == [
        (Role.PREFILL, "p-0", 0, 3),
        (Role.PREFILL, "p-0", 1, 3),
        (Role.PREFILL, "p-1", 0, 3),
        (Role.DECODE, "d-0", 0, 3),
        (Role.DECODE, "d-0", 1, 2),
        (Role.DECODE, "d-1", 0, 2),
        (Role.DECODE, "d-1", 1, 2),
    ]
    assert [
        (s["instance"], s["ready"], s["answered"], s["requests"], s["sent"]) for s in merged["sidecars"]
    ] == [
        ("d-0", True, True, 5, 5),
        ("d-1", True, True, 4, 4),
        ("d-2", False, False, 0, 0),
    ]


def test_view_says_which_placement_runs_and_shows_each_sidecar() -> None:
    merged = merge_debug(
        [(D0, _doc("d-0", 2, [("p-0/0", 1)], [1])), (D1, _doc("d-1", 2, [("p-0/0", 1)], [1]))]
    )
    frame = "\n".join(render_frame(merged, [], color=False))
    assert "placement decode-sidecar (2 sidecar routers)" in frame
    assert "sidecar d-0  http://127.0.0.1:9101  not ready  requests 1" in frame
    assert "2 sidecars (min 1, max 1 requests)" in summary_line(merged)
    plain = {k: v for k, v in merged.items() if k not in ("placement", "sidecars")}
    assert "placement deployment (one router)" in "\n".join(render_frame(plain, [], color=False))


def test_view_shows_the_autoscalers_counts_and_measured_latencies() -> None:
    """With spec.autoscaling the frame has the autoscaler's lines under the header (pdserve.local.scaler)."""
    from pdserve.deployment.plan.autoscale import Memory, RoleState
    from pdserve.local.scaler import LocalScaler
    from tests.unit.test_autoscale import autoscaling, signals

    scaler = LocalScaler(autoscaling(), {"prefill": 2, "decode": 3})
    assert scaler.lines() == [
        "autoscaling: prefill 2 wanted (1-16)  decode 3 wanted (1-16)",
        "  no decision yet",
    ]
    roles = {"prefill": RoleState(2, 2), "decode": RoleState(3, 3)}
    decision = scaler.decide(0.0, roles, signals(ttft_ms=2300, itl_ms=20))
    scaler.apply(decision, 0.0, 0.0, [])
    assert scaler.memory != Memory() and scaler.desired == {"prefill": 3, "decode": 3}
    lines = scaler.lines()
    assert lines[0] == "autoscaling: prefill 3 wanted (1-16)  decode 3 wanted (1-16)"
    assert "p90 TTFT 2." in lines[1] and "/ 2.00 s" in lines[1] and "ITL 20 ms / 50 ms" in lines[1]
    assert lines[2].startswith("  last decision: prefill 2 -> 3")
    merged = merge_debug([(D0, _doc("d-0", 2, [("p-0/0", 1)], [1]))])
    frame = render_frame(merged, [], color=False, scaling=lines)
    assert frame[frame.index(lines[0]) + 1] == lines[1]
