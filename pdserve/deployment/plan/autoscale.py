"""The autoscaler's decision: one for both roles, every ``syncPeriodSeconds`` (pure).

Inputs: ``spec.autoscaling``, what each role runs now (:class:`RoleState`), the signals of the
last window (:class:`~pdserve.deployment.plan.signals.Signals`) and the memory of earlier decisions
(:class:`Memory`). Output: the new counts, why, what limited them, and the memory to pass next
time. The operator and ``pdserve up`` call it alike.

How a count is decided, per role, then for the pair:

1. **The role's objective ratio** ``q`` and **the instances its traffic needs** at its objective
   (pdserve.deployment.plan.need): a queue model per role, sized by the requests arriving, and the
   recommendation once ``q`` leaves ``[1 - scaleDown.tolerance, 1 + scaleUp.tolerance]``.
2. **Stabilisation**, HPA's (pdserve.deployment.plan.behavior): a count grows to the lowest
   recommendation of the scale-up window and shrinks to the highest of the scale-down window (so
   scale-down waits its window).
3. **Step limits**, HPA's policies (``Instances`` or ``Percent`` per ``periodSeconds``, counted
   from the count at the period's start; ``selectPolicy`` picks the largest or smallest step).
4. **Holds**: a role does not grow while pods of its last scale-up are still starting, nor, when
   judged by its window's latencies, for a window after (``windowSeconds``: until the latencies
   are those of requests the new instances served too; the prefill's queue model counts the
   slots it has now), nor while any of its pods is Unschedulable (the cluster has no room: condition
   ``ScalingLimited``, naming the resource).
5. **Bounds and ratio**: each count within ``[minInstances, maxInstances]``; then the pair
   nearest to both targets whose ratio holds: never below a target when avoidable (the ratio
   pulls the other role up, never a role below its need), then the fewest instances.

Every decision carries its reason: which objective, measured against target, and which rule
moved or held each count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pdserve.deployment.plan.behavior import History, stabilised, step_limited
from pdserve.deployment.plan.need import (
    BASELINE_SECONDS,
    MIN_SAMPLES,
    arrivals,
    decode_base,
    in_flight,
    objective_ratio,
    per_slot,
    percentile_ms,
    prefill_base,
    prefill_model,
    recommend,
    role_ratios,
    traffic_need,
    window_prefill_base,
)
from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.spec.autoscaling import AutoscalingSpec, prefill_range

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleState:
    """One role as it runs now."""

    desired: int  # the count the last decision wanted (or the spec's start)
    ready: int  # routable instances
    starting: int = 0  # instances created and not Ready yet (within their startup timeout)
    unschedulable: int = 0  # of those, pods the scheduler reports it cannot place
    slots: int = 0  # routable slots (ready instances x their DP ranks); 0: the ready count
    #: What the scheduler says is missing ("nvidia.com/gpu" from "Insufficient nvidia.com/gpu"),
    #: or its message when it names no resource.
    unschedulable_reason: str = ""


@dataclass(frozen=True)
class Memory:
    """What a decision leaves for the next: HPA's history (stabilisation windows, step policies:
    pdserve.deployment.plan.behavior) and the decode's (sequences per slot, ITL ratio) pairs (its
    base latency). An empty memory (a restarted operator) makes the first scale-down wait a whole
    window, the safe side."""

    history: History = field(default_factory=History)
    samples: tuple[tuple[float, float, float], ...] = ()  # (time, decode sequences per slot, ITL ratio)
    prefill_bases: tuple[tuple[float, float], ...] = ()  # (time, a window's prefill no-load TTFT ratio)
    #: Per role, the last time it grew or had instances starting: the window's figures show its new
    #: instances only ``windowSeconds`` later.
    grown: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Limit:
    """A condition ScalingLimited=True: which role, the reason (CamelCase) and the message."""

    role: str
    reason: str  # TooManyInstances, TooFewInstances, InsufficientResources
    message: str


@dataclass(frozen=True)
class RoleDecision:
    role: str
    before: int
    after: int
    ratio: float | None  # q: measured percentile / objective; None: too few samples
    recommendation: int
    why: str


@dataclass(frozen=True)
class Decision:
    prefill: RoleDecision
    decode: RoleDecision
    measured: Mapping[str, float | None]  # ttft_ms, itl_ms (the objectives' percentile)
    limits: tuple[Limit, ...]
    memory: Memory

    @property
    def counts(self) -> dict[str, int]:
        return {"prefill": self.prefill.after, "decode": self.decode.after}

    @property
    def changed(self) -> bool:
        return any(d.after != d.before for d in (self.prefill, self.decode))

    def role(self, role: str) -> RoleDecision:
        return self.prefill if role == "prefill" else self.decode

    @property
    def reason(self) -> str:
        """One line: each role's move (or hold) and why."""
        return "; ".join(_describe(d) for d in (self.prefill, self.decode))


def initial_count(spec: AutoscalingSpec, role: str, instances: int) -> int:
    """Where a role starts: the spec's instances, within the bounds."""
    return spec.bounds(role).clamp(instances)


def decide(
    spec: AutoscalingSpec,
    now: float,
    roles: Mapping[str, RoleState],
    signals: Signals,
    memory: Memory,
) -> Decision:
    memory = replace(
        memory,
        history=memory.history.pruned(spec.behavior, now),
        samples=tuple(x for x in memory.samples if x[0] > now - BASELINE_SECONDS),
        prefill_bases=tuple(x for x in memory.prefill_bases if x[0] > now - BASELINE_SECONDS),
    )
    objectives = spec.objectives
    p = objectives.percentile
    ttft = objective_ratio(signals, "ttft", p, objectives.ttft_milliseconds / 1000)
    itl = objective_ratio(signals, "itl", p, objectives.itl_milliseconds / 1000)
    measured = {
        "ttft_ms": percentile_ms(signals, "ttft", p),
        "itl_ms": percentile_ms(signals, "itl", p),
    }
    ratios, notes = role_ratios(signals, p, ttft, itl)
    slots = {role: roles[role].slots or roles[role].ready for role in ROLES}
    decode_load = per_slot(in_flight(signals, "decode"), slots["decode"])
    if itl is not None and signals.known:
        memory = replace(memory, samples=(*memory.samples, (now, decode_load, itl)))
    window_base = window_prefill_base(signals, slots["prefill"], ratios["prefill"])
    if window_base is not None:
        memory = replace(memory, prefill_bases=(*memory.prefill_bases, (now, window_base)))
    prefill_known = prefill_base(memory.prefill_bases)
    base = {
        "prefill": window_base if prefill_known is None else prefill_known,
        "decode": decode_base(memory.samples),
    }
    rate, growth = arrivals(signals)
    raw: dict[str, int] = {}
    wanted: dict[str, int | None] = {}
    modelled: set[str] = set()  # roles judged by the queue model, not by the window's latencies
    rising: set[str] = set()  # roles growing for the traffic arriving now, not the window's
    whys: dict[str, list[str]] = {}
    for role in ROLES:
        state = roles[role]
        bounds = spec.bounds(role)
        current = state.desired
        q = ratios[role]
        why = [notes[role]] if notes[role] else []
        if not signals.known:
            rec = current
            why.append("no router answered: holding")
        elif signals.idle and signals.covered_seconds >= signals.window_seconds / 2:
            rec = bounds.min_instances
            why.append(f"no traffic in the last {signals.window_seconds:g} s")
        elif q is None:
            rec = current
            why.append(f"fewer than {MIN_SAMPLES} requests measured: holding")
        else:
            running = state.ready or current
            model = None
            need: float | None
            if role == "prefill" and prefill_known is not None and not notes[role]:
                model = prefill_model(signals, slots[role], running, prefill_known, rate)
            if model is not None:
                q, need, shown = model
                modelled.add(role)
                why.append(shown)
            else:
                need = traffic_need(running, q, base[role])
            rec, how = recommend(spec, running, q, need, severe=model is None)
            if how:
                why.append(how)
            if growth > 1 and need is not None:
                surge = need if model is not None else need * growth
                if surge > running * (1 + spec.behavior.scale_up.tolerance) and math.ceil(surge - 1e-9) > rec:
                    rec = math.ceil(surge - 1e-9)
                if rec > running:
                    rising.add(role)
                    why.append(f"requests arriving {growth:.1f}x as fast as before: needs {surge:.1f}")
            wanted[role] = rec
        raw[role] = bounds.clamp(rec)
        whys[role] = why

    targets: dict[str, int] = {}
    limits: list[Limit] = []
    held_up: dict[str, bool] = {}
    for role in ROLES:
        state = roles[role]
        bounds = spec.bounds(role)
        current = bounds.clamp(state.desired)
        if current != state.desired:
            whys[role].append(
                f"moved within minInstances-maxInstances {bounds.min_instances}-{bounds.max_instances}"
            )
        stable, note = stabilised(spec.behavior, memory.history, role, current, raw[role], now)
        if note:
            whys[role].append(note)
        target, note = step_limited(spec.behavior, memory.history, role, current, stable, now)
        if note:
            whys[role].append(note)
        held = False
        if target > current and state.unschedulable:
            what = state.unschedulable_reason or "no node fits"
            limits.append(
                Limit(
                    role,
                    "InsufficientResources",
                    f"{role}: {state.unschedulable} pod(s) cannot be placed ({what}); not asking for more "
                    f"than {current} instance(s)",
                )
            )
            whys[role].append(f"held at {current}: pods cannot be placed ({what})")
            target, held = current, True
        elif target > current and state.starting:
            whys[role].append(f"held at {current}: {state.starting} instance(s) still starting")
            target, held = current, True
        elif (
            target > current
            and role not in rising | modelled
            and now - memory.grown.get(role, -math.inf) < objectives.window_seconds
        ):
            since = now - memory.grown[role]
            whys[role].append(
                f"held at {current}: its last new instances are in {since:.0f} s of the "
                f"{objectives.window_seconds} s window only"
            )
            target, held = current, True
        asked = wanted.get(role)
        if asked is not None and asked > bounds.max_instances and target >= bounds.max_instances:
            limits.append(
                Limit(
                    role,
                    "TooManyInstances",
                    f"{role}: its objective needs about {asked} instances, maxInstances is "
                    f"{bounds.max_instances}",
                )
            )
        elif asked is not None and asked < bounds.min_instances and target <= bounds.min_instances:
            limits.append(
                Limit(
                    role,
                    "TooFewInstances",
                    f"{role}: its traffic needs about {asked} instances, minInstances is "
                    f"{bounds.min_instances}",
                )
            )
        targets[role] = target
        held_up[role] = held

    counts, pulled = _with_ratio(spec, targets, {r: roles[r].desired for r in ROLES}, held_up)
    for role, note in pulled.items():
        whys[role].append(note)
    decisions = {
        role: RoleDecision(
            role,
            roles[role].desired,
            counts[role],
            ratios[role],
            raw[role],
            "; ".join([_measured(spec, role, measured), *whys[role]]).strip("; "),
        )
        for role in ROLES
    }
    moves = {role: counts[role] - roles[role].desired for role in ROLES}
    grown = {**memory.grown, **{r: now for r in ROLES if moves[r] > 0 or roles[r].starting}}
    memory = replace(memory, history=memory.history.recorded(now, raw, moves), grown=grown)
    return Decision(decisions["prefill"], decisions["decode"], measured, tuple(limits), memory)


# --- step 5: the pair ------------------------------------------------------------------------------


def _with_ratio(
    spec: AutoscalingSpec,
    targets: Mapping[str, int],
    current: Mapping[str, int],
    held_up: Mapping[str, bool],
) -> tuple[dict[str, int], dict[str, str]]:
    """The feasible pair nearest the targets: least shortfall, then fewest instances, then least
    movement; a role held at its count grows only when nothing else meets the ratio."""
    ratio = spec.prefill_per_decode
    p_target, d_target = targets["prefill"], targets["decode"]
    if ratio.holds(p_target, d_target):
        return dict(targets), {}

    def best(hold: bool) -> tuple[int, int] | None:
        choice: tuple[tuple[int, int, int], tuple[int, int]] | None = None
        d_high = spec.decode.max_instances
        if hold and held_up["decode"]:
            d_high = max(d_target, min(current["decode"], d_high))
        for d in range(spec.decode.min_instances, d_high + 1):
            low, high = prefill_range(spec, d)
            if hold and held_up["prefill"]:
                high = min(high, max(p_target, current["prefill"]))
            if low > high:
                continue
            p = min(max(p_target, low), high)
            key = (max(0, p_target - p) + max(0, d_target - d), p + d, abs(p - p_target) + abs(d - d_target))
            if choice is None or key < choice[0]:
                choice = (key, (p, d))
        return None if choice is None else choice[1]

    pair = best(hold=True) or best(hold=False)
    assert pair is not None  # the parser refused ratio bounds no counts within the bounds meet
    counts = {"prefill": pair[0], "decode": pair[1]}
    notes = {}
    shown = _ratio_text(spec)
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        if counts[role] > targets[role]:
            notes[role] = f"pulled up to {counts[role]} by prefillPerDecode {shown} ({other} {counts[other]})"
        elif counts[role] < targets[role]:
            notes[role] = f"kept at {counts[role]} by prefillPerDecode {shown} ({other} {counts[other]})"
    return counts, notes


def _ratio_text(spec: AutoscalingSpec) -> str:
    r = spec.prefill_per_decode
    low = "-" if r.min is None else f"{r.min:g}"
    high = "-" if r.max is None else f"{r.max:g}"
    return f"[{low}, {high}]"


# --- memory and words --------------------------------------------------------------------------------


def _measured(spec: AutoscalingSpec, role: str, measured: Mapping[str, float | None]) -> str:
    """``TTFT p90 3200 ms > objective 2000 ms`` (prefill) or the ITL's (decode)."""
    o = spec.objectives
    name, value, target = (
        ("TTFT", measured["ttft_ms"], o.ttft_milliseconds)
        if role == "prefill"
        else ("ITL", measured["itl_ms"], o.itl_milliseconds)
    )
    if value is None:
        return ""
    sign = ">" if value > target else "<="
    return f"{name} p{o.percentile:g} {_ms_text(value)} {sign} objective {_ms_text(target)}"


def _ms_text(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def _describe(d: RoleDecision) -> str:
    move = f"{d.before} -> {d.after}" if d.after != d.before else f"stays {d.after}"
    return f"{d.role} {move}" + (f" ({d.why})" if d.why else "")
