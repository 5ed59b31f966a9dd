"""The autoscaler's pure decision (pdserve.deployment.plan.autoscale): each rule on its own, then
properties over simulated half hours: noise does not make it flap, bounds and the ratio always
hold, scale-down waits its window, limited capacity stops the asking."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.deployment.plan.autoscale import Decision, Memory, RoleState, decide, initial_count
from pdserve.deployment.plan.behavior import History
from pdserve.deployment.plan.need import MIN_SAMPLES, decode_base, prefill_base
from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.spec.autoscaling import AutoscalingSpec, parse_autoscaling
from pdserve.wire.load import bucket_of


def autoscaling(**overrides: Any) -> AutoscalingSpec:
    doc: dict[str, Any] = {
        "prefill": {"minInstances": 1, "maxInstances": 16},
        "decode": {"minInstances": 1, "maxInstances": 16},
        "objectives": {"ttftMilliseconds": 2000, "itlMilliseconds": 50},
    }
    doc.update(overrides)
    spec = parse_autoscaling(doc, "spec.autoscaling")
    assert spec is not None
    return spec


def signals(
    ttft_ms: float | None = 1000,
    itl_ms: float | None = 25,
    requests: int = 200,
    prefill_ms: float | None = None,
    decode_first_ms: float | None = None,
    in_flight: int = 10,
    window: float = 60,
    routers: int = 1,
    prefill_now: int | None = None,
    arriving: float = 1.0,
) -> Signals:
    """A window in which every request saw these latencies; ``in_flight`` decode legs now, and
    the prefill legs now as many as the window averaged (``prefill_now``: another count).
    Requests arrive as fast as they ended, or ``arriving`` times as fast in the last quarter."""

    def hist(ms: float | None) -> dict[int, int]:
        return {} if ms is None else {bucket_of(ms / 1000): requests}

    prefill_ms = prefill_ms if prefill_ms is not None else (None if ttft_ms is None else ttft_ms * 0.8)
    decode_first_ms = (
        decode_first_ms if decode_first_ms is not None else (None if ttft_ms is None else ttft_ms * 0.1)
    )
    prefill_average = 0 if prefill_ms is None else round(requests / window * prefill_ms / 1000)
    return Signals(
        window_seconds=window,
        covered_seconds=window,
        routers=routers,
        ok=requests,
        failed=0,
        latency={
            "ttft": hist(ttft_ms),
            "itl": hist(itl_ms),
            "prefill": hist(prefill_ms),
            "decode_first": hist(decode_first_ms),
        },
        in_flight={"prefill": prefill_average if prefill_now is None else prefill_now, "decode": in_flight},
        queued=0,
        waiting={"prefill": 0, "decode": 0},
        running={"prefill": 0, "decode": 0},
        kv_usage={"prefill": None, "decode": None},
        engines={"prefill": 1, "decode": 1},
        started=arrivals(requests / window, window, arriving),
    )


def arrivals(rate: float, window: float, recent_x: float = 1.0) -> tuple[int, ...]:
    """Requests arriving per second over ``window`` seconds at ``rate`` (``recent_x`` times that
    in the last quarter), and the current second still counting."""
    seconds = int(window)
    recent = seconds - seconds // 4
    rates = [rate * (recent_x if i >= recent else 1.0) for i in range(seconds)]
    totals = list(itertools.accumulate(rates, initial=0.0))
    return (*(round(b) - round(a) for a, b in itertools.pairwise(totals)), 0)


def states(prefill: int, decode: int, **extra: Any) -> dict[str, RoleState]:
    return {"prefill": RoleState(prefill, prefill, **extra), "decode": RoleState(decode, decode)}


OLD = Memory(History(started=-10_000.0))  # a memory older than every window: nothing waits for it
#: ... that has also seen the decode at several loads: ITL ratio = 0.2 + 0.02 per sequence per slot.
KNOWN = replace(OLD, samples=tuple((-100.0 + i, b, 0.2 + 0.02 * b) for i, b in enumerate((5, 10, 20, 40))))


def test_the_role_missing_its_objective_grows_and_the_other_holds() -> None:
    """TTFT at 1.4 of its objective, a no-load ratio of 0.29 (this window's, ``q / (1 + N)``): the
    part over no load must shrink from 1.11 to 0.71 of the objective, so 2 instances become 4."""
    d = decide(autoscaling(), 0.0, states(2, 2), signals(ttft_ms=2800, itl_ms=45), OLD)
    assert d.counts == {"prefill": 4, "decode": 2}
    assert "its traffic needs 3.1 of 2" in d.prefill.why
    assert "TTFT p90" in d.prefill.why and "> objective 2000 ms" in d.prefill.why
    assert d.prefill.ratio == pytest.approx(1.4, rel=0.06)
    assert d.decode.after == 2 and "ITL p90" in d.decode.why
    assert "prefill 2 -> 4" in d.reason and "decode stays 2" in d.reason


def test_itl_missed_grows_decode() -> None:
    d = decide(autoscaling(), 0.0, states(2, 2), signals(ttft_ms=1800, itl_ms=80), OLD)
    assert d.counts == {"prefill": 2, "decode": 3}  # no base known: one more
    d = decide(autoscaling(), 0.0, states(2, 2), signals(ttft_ms=1800, itl_ms=130), OLD)
    assert d.counts == {"prefill": 2, "decode": 6}  # missed over twice: HPA's ready x ratio


def test_a_ttft_missed_at_the_decode_grows_decode_not_prefill() -> None:
    s = signals(ttft_ms=3000, itl_ms=30, prefill_ms=800, decode_first_ms=2000)
    d = decide(autoscaling(), 0.0, states(2, 2), s, OLD)
    assert d.counts["prefill"] == 2
    assert d.counts["decode"] == 3
    assert "TTFT missed at the decode" in d.decode.why


def test_within_tolerance_nothing_moves() -> None:
    for ttft in (1900, 2000, 2150):
        d = decide(autoscaling(), 0.0, states(4, 4), signals(ttft_ms=ttft, itl_ms=48), OLD)
        assert d.counts == {"prefill": 4, "decode": 4}, ttft
        assert not d.changed


def test_too_few_samples_hold_and_no_router_holds() -> None:
    few = signals(ttft_ms=9000, itl_ms=400, requests=MIN_SAMPLES - 1)
    d = decide(autoscaling(), 0.0, states(2, 2), few, OLD)
    assert d.counts == {"prefill": 2, "decode": 2}
    assert "fewer than 10 requests" in d.prefill.why
    d = decide(autoscaling(), 0.0, states(2, 2), signals(ttft_ms=9000, routers=0), OLD)
    assert d.counts == {"prefill": 2, "decode": 2} and "no router answered" in d.decode.why


def test_ratio_bounds_pull_the_other_role_up() -> None:
    spec = autoscaling(prefillPerDecode={"min": 0.5, "max": 2})
    d = decide(spec, 0.0, states(4, 2), signals(ttft_ms=4000, itl_ms=40), OLD)
    assert d.counts == {"prefill": 8, "decode": 4}
    assert "pulled up to 4 by prefillPerDecode [0.5, 2] (prefill 8)" in d.decode.why


def test_ratio_never_takes_a_role_below_its_need() -> None:
    """Decode would shrink to 1, but 4 prefills need 2 decodes at most 2:1: decode stays 2."""
    spec = autoscaling(prefillPerDecode={"max": 2})
    d = decide(spec, 0.0, states(4, 3), signals(ttft_ms=1900, itl_ms=10.7, in_flight=2), KNOWN)
    assert d.decode.recommendation == 1  # its own traffic needs one
    assert d.counts == {"prefill": 4, "decode": 2}
    assert "pulled up to 2 by prefillPerDecode [-, 2] (prefill 4)" in d.decode.why


def test_scale_down_waits_its_window() -> None:
    spec = autoscaling()
    memory = replace(KNOWN, history=History())
    low = signals(ttft_ms=500, itl_ms=12)
    counts = {"prefill": 8, "decode": 8}
    seen = []
    for t in range(0, 601, 15):
        d = decide(spec, float(t), states(counts["prefill"], counts["decode"]), low, memory)
        memory, counts = d.memory, d.counts
        seen.append((t, counts["prefill"], counts["decode"]))
    before = [c for t, *c in seen if t < 300]
    assert all(c == [8, 8] for c in before), before
    first_drop = next(t for t, p, dd in seen if (p, dd) != (8, 8))
    assert first_drop >= 300
    assert "scale-down waits its 300 s window" in decide(spec, 0.0, states(8, 8), low, Memory()).prefill.why


def test_scale_down_stabilisation_keeps_the_highest_recommendation() -> None:
    spec = autoscaling()
    d = decide(spec, 0.0, states(4, 4), signals(ttft_ms=2000, itl_ms=50), KNOWN)  # recommends 4
    d = decide(spec, 100.0, states(4, 4), signals(ttft_ms=500, itl_ms=12), d.memory)  # recommends less
    assert d.prefill.recommendation < 4 and d.decode.recommendation < 4
    assert d.counts == {"prefill": 4, "decode": 4}
    d = decide(spec, 301.0, states(4, 4), signals(ttft_ms=500, itl_ms=10), d.memory)
    assert d.counts["prefill"] < 4 and d.counts["decode"] < 4


def test_step_limits_follow_the_policies() -> None:
    spec = autoscaling(
        behavior={"scaleUp": {"policies": [{"type": "Instances", "value": 1, "periodSeconds": 60}]}}
    )
    memory = OLD
    counts = {"prefill": 1, "decode": 1}
    history = []
    for t in range(0, 181, 15):
        d = decide(spec, float(t), states(counts["prefill"], 1), signals(ttft_ms=8000, itl_ms=20), memory)
        memory, counts = d.memory, d.counts
        history.append(counts["prefill"])
    assert history[0] == 2 and history[3] == 2  # one a minute
    assert history[4] == 3 and history[-1] == 5
    assert "step limited" in decide(spec, 0.0, states(1, 1), signals(ttft_ms=8000), OLD).prefill.why


def test_default_policies_double_or_add_four() -> None:
    d = decide(autoscaling(), 0.0, states(1, 1), signals(ttft_ms=20000, itl_ms=500), OLD)
    assert d.counts == {"prefill": 5, "decode": 5}  # max(100 %, 4 instances)
    d = decide(autoscaling(), 0.0, states(8, 8), signals(ttft_ms=20000, itl_ms=500), OLD)
    assert d.counts == {"prefill": 16, "decode": 16}


def test_select_policy_disabled_never_moves_that_way() -> None:
    spec = autoscaling(behavior={"scaleDown": {"selectPolicy": "Disabled", "stabilizationWindowSeconds": 0}})
    d = decide(spec, 0.0, states(6, 6), signals(ttft_ms=200, itl_ms=5), OLD)
    assert d.counts == {"prefill": 6, "decode": 6}


def test_starting_pods_hold_the_next_scale_up() -> None:
    roles = {"prefill": RoleState(4, 2, starting=2), "decode": RoleState(2, 2)}
    d = decide(autoscaling(), 0.0, roles, signals(ttft_ms=6000, itl_ms=40), OLD)
    assert d.counts["prefill"] == 4
    assert "held at 4: 2 instance(s) still starting" in d.prefill.why


def test_unschedulable_pods_stop_the_asking_and_name_the_resource() -> None:
    roles = {
        "prefill": RoleState(
            4, 3, starting=1, unschedulable=1, unschedulable_reason="Insufficient nvidia.com/gpu"
        ),
        "decode": RoleState(2, 2),
    }
    d = decide(autoscaling(), 0.0, roles, signals(ttft_ms=6000, itl_ms=40), OLD)
    assert d.counts["prefill"] == 4
    [limit] = d.limits
    assert limit.role == "prefill" and limit.reason == "InsufficientResources"
    assert "nvidia.com/gpu" in limit.message


def test_too_many_instances_is_a_limit() -> None:
    spec = autoscaling(prefill={"minInstances": 1, "maxInstances": 3})
    d = decide(spec, 0.0, states(3, 2), signals(ttft_ms=6000, itl_ms=40), OLD)
    assert d.counts["prefill"] == 3
    assert [(x.role, x.reason) for x in d.limits] == [("prefill", "TooManyInstances")]


def test_idle_goes_to_the_minimum_after_the_window() -> None:
    idle = replace(signals(requests=0, in_flight=0), ok=0, latency={})
    d = decide(autoscaling(), 1000.0, states(5, 5), idle, OLD)
    assert d.counts == {"prefill": 1, "decode": 1}
    assert "no traffic" in d.prefill.why


def test_out_of_bounds_counts_move_in_at_once() -> None:
    spec = autoscaling(prefill={"minInstances": 3, "maxInstances": 6})
    d = decide(spec, 0.0, states(1, 2), signals(ttft_ms=2000, itl_ms=50), Memory())
    assert d.counts["prefill"] == 3
    assert initial_count(spec, "prefill", 10) == 6


def test_the_decode_base_is_where_its_latency_line_meets_no_load() -> None:
    """ITL = step time + time per sequence: the line through (sequences, ratio) pairs gives the
    step's share; too few pairs, too alike or sloping down give none (and no shrinking)."""
    assert decode_base(KNOWN.samples) == pytest.approx(0.2)
    assert decode_base(KNOWN.samples[:3]) is None
    assert decode_base([(0.0, 10.0, 0.3), (1.0, 11.0, 0.31), (2.0, 10.5, 0.3), (3.0, 10.2, 0.3)]) is None
    assert decode_base([(0.0, 5.0, 0.5), (1.0, 10.0, 0.4), (2.0, 20.0, 0.3), (3.0, 40.0, 0.2)]) is None
    noisy = [(float(i), b, 0.3 + 0.01 * b) for i, b in enumerate((1, 2, 3, 4))]
    assert decode_base(noisy) == pytest.approx(0.9 * 0.31)  # never above 90 % of the lowest seen


def test_the_need_is_what_the_traffic_uses_at_the_objective() -> None:
    """Decode at ITL ratio 0.6 with a base near 0.2: the traffic uses about 1 - 0.2/0.6 = 2/3 of 6
    instances; at the objective a slot can give 0.8 to it: 6 x (2/3) / 0.8 = 5 instances. HPA's
    ready x ratio would say 4, and overload them (ratio 0.2 / (1 - 1.0) at 4)."""
    spec = autoscaling(behavior={"scaleDown": {"stabilizationWindowSeconds": 0}})
    d = decide(spec, 0.0, states(6, 6), signals(ttft_ms=1900, itl_ms=30), KNOWN)
    assert d.decode.after == 5
    assert re.search(r"its traffic needs 4\.\d of 6 at the objective", d.decode.why)


# --- properties over simulated time ------------------------------------------------------------------


@dataclass
class Model:
    """A deployment under load, as queues: a prefill slot shares its steps among its prompts
    (processor sharing: a prompt takes ``prefill_s`` alone, ``prefill_s / (1 - u)`` at utilisation
    ``u``); a decode step takes ``step_ms`` plus ``seq_ms`` per sequence, and a request holds its
    sequence for ``tokens`` steps. Pods start in ``startup`` seconds; the cluster fits ``capacity``
    instances in all (beyond that, pods stay Unschedulable)."""

    spec: AutoscalingSpec
    startup: float = 30.0
    capacity: int = 10_000
    prefill_s: float = 0.5
    step_ms: float = 10.0
    seq_ms: float = 0.4
    tokens: int = 100
    counts: dict[str, int] = field(default_factory=lambda: {"prefill": 2, "decode": 2})
    started: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    memory: Memory = field(default_factory=Memory)
    decisions: list[Decision] = field(default_factory=list)

    def ready(self, role: str, now: float) -> int:
        return sum(1 for t in self.started[role] if now - t >= self.startup)

    def placed(self, role: str) -> int:
        other = "decode" if role == "prefill" else "prefill"
        room = self.capacity - min(self.counts[other], self.capacity)
        return min(self.counts[role], max(room, 0))

    def observe(self, now: float, rate: float) -> Signals:
        """The latencies of ``rate`` requests a second on the Ready instances."""
        window = self.spec.objectives.window_seconds
        p_ready = max(self.ready("prefill", now), 1)
        d_ready = max(self.ready("decode", now), 1)
        u = min(rate * self.prefill_s / p_ready, 0.99)
        prefill_s = self.prefill_s / (1 - u)
        per_seq = rate * self.tokens * self.seq_ms / 1000 / d_ready  # share of a step's time
        itl = self.step_ms / (1 - min(per_seq, 0.99))
        sequences = rate * self.tokens * itl / 1000
        done = max(int(rate * window), 0)
        s = signals(
            ttft_ms=prefill_s * 1000 + itl,
            itl_ms=itl,
            requests=done,
            prefill_ms=prefill_s * 1000,
            decode_first_ms=itl,
            in_flight=0,
            window=window,
        )
        return replace(s, in_flight={"prefill": round(rate * prefill_s), "decode": round(sequences)})

    def step(self, now: float, rate: float) -> Decision:
        roles = {}
        for role in ("prefill", "decode"):
            ages = self.started[role]
            while len(ages) < self.placed(role):
                ages.append(now)
            del ages[self.placed(role) :]
            unplaced = self.counts[role] - self.placed(role)
            roles[role] = RoleState(
                self.counts[role],
                self.ready(role, now),
                starting=self.counts[role] - self.ready(role, now),
                unschedulable=unplaced,
                unschedulable_reason="Insufficient nvidia.com/gpu" if unplaced else "",
            )
        d = decide(self.spec, now, roles, self.observe(now, rate), self.memory)
        self.memory = d.memory
        self.counts = d.counts
        self.decisions.append(d)
        return d


def reversals(series: list[int]) -> int:
    """How often the direction of change flips (up then down, or down then up)."""
    moves = [b - a for a, b in itertools.pairwise(series) if b != a]
    return sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))


@pytest.mark.parametrize("seed", range(8))
def test_steady_load_with_20_percent_noise_does_not_flap(seed: int) -> None:
    rng = random.Random(seed)
    model = Model(autoscaling())
    period = model.spec.sync_period_seconds
    series: dict[str, list[int]] = {"prefill": [], "decode": []}
    for t in range(0, 30 * 60, period):
        model.step(float(t), rate=6.0 * (1 + rng.uniform(-0.2, 0.2)))
        for role in series:
            series[role].append(model.counts[role])
    for role, counts in series.items():
        settled = counts[len(counts) // 3 :]  # after the first ten minutes
        assert reversals(counts) <= 1, (role, counts)  # an overshoot from the start is no flapping
        assert reversals(settled) == 0, (role, settled)
        assert len(set(settled)) <= 2, (role, settled)


@pytest.mark.parametrize("seed", range(4))
def test_a_load_ramp_grows_both_roles_and_shrinks_them_back(seed: int) -> None:
    rng = random.Random(seed)
    model = Model(autoscaling(prefillPerDecode={"min": 0.5, "max": 2}))
    seen = []
    for t in range(0, 40 * 60, 15):
        level = 2.0 if t < 600 or t >= 1500 else 12.0
        model.step(float(t), rate=level * (1 + rng.uniform(-0.1, 0.1)))
        seen.append(dict(model.counts))
    low = seen[39]
    high = seen[99]
    back = seen[-1]
    assert high["prefill"] > low["prefill"] and high["decode"] > low["decode"]
    assert back["prefill"] < high["prefill"] and back["decode"] < high["decode"]
    assert back["prefill"] <= low["prefill"] + 1 and back["decode"] <= low["decode"] + 1


def test_limited_capacity_stops_at_the_limit() -> None:
    model = Model(autoscaling(), capacity=10)
    for t in range(0, 20 * 60, 15):
        model.step(float(t), rate=100.0)  # needs far more than 10 instances
    asked = [sum(d.counts.values()) for d in model.decisions]
    first_limit = next(i for i, d in enumerate(model.decisions) if d.limits)
    assert max(asked[first_limit:]) == asked[first_limit]  # once unschedulable, never more asked
    assert asked[first_limit] <= 10 + 8  # beyond the room by one step at most
    assert any(x.reason == "InsufficientResources" for x in model.decisions[-1].limits)


ratios_strategy = st.one_of(
    st.none(), st.tuples(st.sampled_from([0.25, 0.5, 1.0]), st.sampled_from([1.0, 2.0, 4.0]))
)


@settings(max_examples=60, deadline=None)
@given(
    ratio=ratios_strategy,
    bounds=st.tuples(st.integers(1, 4), st.integers(4, 12), st.integers(1, 4), st.integers(4, 12)),
    loads=st.lists(
        st.tuples(st.floats(0.05, 6.0), st.floats(0.05, 6.0), st.booleans()), min_size=5, max_size=60
    ),
    start=st.tuples(st.integers(0, 20), st.integers(0, 20)),
)
def test_bounds_and_ratio_are_never_violated(
    ratio: tuple[float, float] | None,
    bounds: tuple[int, int, int, int],
    loads: list[tuple[float, float, bool]],
    start: tuple[int, int],
) -> None:
    extra: dict[str, Any] = {
        "prefill": {"minInstances": bounds[0], "maxInstances": bounds[1]},
        "decode": {"minInstances": bounds[2], "maxInstances": bounds[3]},
    }
    if ratio is not None:
        extra["prefillPerDecode"] = {"min": ratio[0], "max": ratio[1]}
    spec = autoscaling(**extra)
    counts = {"prefill": start[0], "decode": start[1]}  # possibly out of bounds: the first decision fixes it
    memory = Memory()
    for i, (ttft_x, itl_x, starting) in enumerate(loads):
        roles: Mapping[str, RoleState] = {
            r: RoleState(counts[r], max(counts[r] - int(starting), 0), starting=int(starting)) for r in counts
        }
        d = decide(spec, i * 15.0, roles, signals(ttft_ms=2000 * ttft_x, itl_ms=50 * itl_x), memory)
        memory, counts = d.memory, d.counts
        assert spec.prefill.min_instances <= counts["prefill"] <= spec.prefill.max_instances
        assert spec.decode.min_instances <= counts["decode"] <= spec.decode.max_instances
        assert spec.prefill_per_decode.holds(counts["prefill"], counts["decode"]), (counts, d.reason)


def test_requests_arriving_faster_grow_a_role_before_the_window_shows_it() -> None:
    """The window's latencies lag; requests arriving in its last quarter faster than over it
    (beyond a Poisson count's noise) are traffic the window does not show yet: the role's need
    grows with the rate at once, and no window hold applies."""
    calm = decide(autoscaling(), 0.0, states(3, 3), signals(ttft_ms=2000, itl_ms=40), OLD)
    assert calm.counts["prefill"] == 3
    noise = decide(autoscaling(), 0.0, states(3, 3), signals(ttft_ms=2000, itl_ms=40, arriving=1.2), OLD)
    assert noise.counts["prefill"] == 3  # 60 in the last 15 s where 50 were expected: within the noise
    rising = signals(ttft_ms=2000, itl_ms=40, arriving=3.0)
    grown = decide(autoscaling(), 0.0, states(3, 3), rising, OLD)
    assert grown.counts["prefill"] > 3
    assert "requests arriving 3.0x as fast as before" in grown.prefill.why
    memory = replace(OLD, grown={"prefill": -5.0})  # grew 5 s ago: the latency-driven growth waits
    assert decide(autoscaling(), 0.0, states(3, 3), rising, memory).counts["prefill"] > 3


def test_decode_grows_with_the_rate_requests_arrive_at() -> None:
    """Decode at 4, ITL at 0.6 of its objective on the KNOWN line (base 0.2, 20 sequences a slot:
    utilisation 2/3, a need of 3.3). Requests arriving twice as fast bring twice the work: a need
    of 6.7, so 7."""

    def decode_window(arriving: float) -> Signals:
        base = signals(ttft_ms=1500, itl_ms=30, in_flight=80, arriving=arriving)
        return replace(base, latency={**base.latency, "decode": {bucket_of(24.0): 200}})  # 80 in flight

    steady = decide(autoscaling(), 0.0, states(4, 4), decode_window(1.0), KNOWN)
    assert steady.counts["decode"] == 4, steady.decode.why
    d = decide(autoscaling(), 0.0, states(4, 4), decode_window(2.0), KNOWN)  # the last quarter at 2x
    assert "requests arriving 2.0x as fast" in d.decode.why
    assert d.counts["decode"] == 7, d.decode.why


#: A prefill whose recent windows read a no-load TTFT ratio of 0.4 (prompts alone take 40 % of the
#: objective at its percentile): its queue model is known.
PREFILL_KNOWN = replace(
    OLD, prefill_bases=tuple((-100.0 + i, a) for i, a in enumerate((0.35, 0.4, 0.45, 0.4, 1.2)))
)


def test_the_prefill_base_is_the_median_of_recent_windows() -> None:
    assert prefill_base(PREFILL_KNOWN.prefill_bases) == pytest.approx(
        0.4
    )  # the 1.2 of one long prompt left out
    assert prefill_base(PREFILL_KNOWN.prefill_bases[:3]) is None
    assert prefill_base([(0.0, 0.2), (1.0, 0.4), (2.0, 0.6), (3.0, 0.8)]) == pytest.approx(0.5)


def test_one_long_prompt_missing_the_ttft_objective_does_not_grow_prefill_once_its_base_is_known() -> None:
    """A quiet window (prefill legs about 0.3 a slot) whose p99 one long prompt set at 1.4 of the
    objective: judged by the window alone, prefill grows; by its queue model (no-load ratio 0.4,
    load 0.3 a slot: ratio 0.57) it shrinks to what its traffic needs."""
    spec = autoscaling(behavior={"scaleDown": {"stabilizationWindowSeconds": 0}})
    long_prompt = signals(ttft_ms=2800, itl_ms=30, prefill_ms=400, requests=150)
    assert decide(spec, 0.0, states(6, 4), long_prompt, OLD).counts["prefill"] > 6
    d = decide(spec, 0.0, states(6, 4), long_prompt, PREFILL_KNOWN)
    assert d.counts["prefill"] < 6, d.prefill.why
    assert "queue model: no-load ratio" in d.prefill.why


def test_an_overloaded_prefill_is_sized_by_the_requests_arriving_not_the_legs_ended() -> None:
    """Ended legs show at most what the slots can do; requests arriving three times as fast in the
    window's last quarter show the overload's size: the need grows with them at once."""
    spec = autoscaling()
    busy = signals(ttft_ms=2600, itl_ms=30, prefill_ms=2000, requests=400)  # legs ended: 6.7 a second
    steady = decide(spec, 0.0, states(4, 4), busy, PREFILL_KNOWN)
    surge = decide(spec, 0.0, states(4, 4), replace(busy, started=arrivals(400 / 60, 60, 3.0)), PREFILL_KNOWN)
    assert surge.counts["prefill"] > steady.counts["prefill"] >= 4, (steady.prefill.why, surge.prefill.why)
    assert "as fast as before" in surge.prefill.why
