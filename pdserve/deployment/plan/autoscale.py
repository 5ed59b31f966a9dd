"""The autoscaler's decision: one for both roles, every ``syncPeriodSeconds`` (pure).

Inputs: ``spec.autoscaling``, what each role runs now (:class:`RoleState`), the signals of the
last window (:class:`~pdserve.deployment.plan.signals.Signals`) and the memory of earlier decisions
(:class:`Memory`). Output: the new counts, why, what limited them, and the memory to pass next
time. The operator and ``pdserve up`` call it alike.

How a count is decided, per role, then for the pair:

1. **The role's objective ratio** ``q``: its percentile over its objective, of the requests that
   ended in the window. Prefill answers for TTFT, decode for ITL. A missed TTFT is the decode's
   when its leg's time to first byte (the KV pull and its queue) is the larger part; then decode
   takes that ratio and prefill holds. Fewer than :data:`MIN_SAMPLES` samples: no ratio (the
   count holds), unless the deployment is idle (nothing ended, in flight or queued), when the
   traffic needs the minimum.
2. **The recommendation**, once ``q`` leaves ``[1 - scaleDown.tolerance, 1 + scaleUp.tolerance]``:
   the instances the role's traffic needs to sit at its objective. Latency is not proportional to
   the count (HPA's ``ceil(ready x q)`` assumes it is): both roles behave like a queue, ``q = a /
   (1 - u)``, where ``a`` is the ratio at no load and ``u`` the share of the role's capacity the
   traffic uses. The traffic needs ``ready x u / (1 - a)`` instances: grown to at least one more
   when the objective is missed, shrunk when met.

   - **Prefill** shares its steps among the prompts it holds (processor sharing): a prompt takes
     its no-load time times ``1 + N``, ``N`` the prefill legs in flight per slot over the window
     (Little's law on the routers' counts), so each window gives ``a = q / (1 + N)``. A window's
     TTFT percentile is set by its longest prompts (the p99 of a hundred requests is their
     longest), which no count shortens: taken alone it would grow the role for one long prompt
     and hold it there for a scale-down window. So once :data:`MIN_FIT_SAMPLES` windows are
     known, ``a`` is the median of the last :data:`BASELINE_SECONDS`' windows
     (:func:`prefill_base`), and the role is judged by the queue model itself: ``u`` is the work
     arriving (requests a second times a prompt's mean no-load time, ``mean leg / (1 + N)``) per
     slot, and ``q = a / (1 - u)``. Arriving, not ended: an overload shows its size.
   - **Decode**: a step costs a fixed time plus a time per sequence, so ``a`` is where the line
     through the recent (sequences per slot, ``q``) pairs meets zero sequences
     (:func:`decode_base`), and ``u = 1 - a / q`` from the window's ITL. Without ``a`` (a fresh
     memory, a load that never varied) it does not shrink: the conservative side, where HPA's
     rule would shrink a queue into overload and flap. Judged by its window alone, a role that
     misses by :data:`SEVERE` or more grows by ``ready x q``, HPA's rule.

   The window lags: requests arriving in its last quarter (at least :data:`RECENT_SECONDS`)
   faster than in the rest of it, beyond a Poisson count's noise, are rising traffic; the need
   grows with the rate at once (:func:`_arrivals`), without the window's wait.
3. **Stabilisation**, HPA's (pdserve.deployment.plan.behavior): a count grows to the lowest
   recommendation of the scale-up window and shrinks to the highest of the scale-down window (so
   scale-down waits its window).
4. **Step limits**, HPA's policies (``Instances`` or ``Percent`` per ``periodSeconds``, counted
   from the count at the period's start; ``selectPolicy`` picks the largest or smallest step).
5. **Holds**: a role does not grow while pods of its last scale-up are still starting, nor, when
   judged by its window's latencies, for a window after (``windowSeconds``: until the latencies
   are those of requests the new instances served too; the prefill's queue model counts the
   slots it has now), nor while any of its pods is Unschedulable (the cluster has no room: condition
   ``ScalingLimited``, naming the resource).
6. **Bounds and ratio**: each count within ``[minInstances, maxInstances]``; then the pair
   nearest to both targets whose ratio holds: never below a target when avoidable (the ratio
   pulls the other role up, never a role below its need), then the fewest instances.

Every decision carries its reason: which objective, measured against target, and which rule
moved or held each count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdserve.deployment.plan.behavior import History, stabilised, step_limited
from pdserve.deployment.plan.signals import Signals
from pdserve.deployment.spec.autoscaling import AutoscalingSpec, prefill_range
from pdserve.wire.load import mean, percentile

ROLES = ("prefill", "decode")
#: Fewer samples in the window than this, and a percentile says too little to act on.
MIN_SAMPLES = 10
#: How far back the decode's (sequences per slot, ITL ratio) pairs and the prefill's no-load ratios
#: count for each role's base latency.
BASELINE_SECONDS = 600.0
#: Pairs needed, and how far apart their loads must be, to draw a line through them.
MIN_FIT_SAMPLES = 4
MIN_FIT_SPREAD = 1.25
#: The pairs within this factor of the lightest load anchor the line.
LIGHT_LOAD = 1.25
#: A ratio is capped here: a stuck queue must not ask for a hundred-fold count (the policies cap it too).
MAX_RATIO = 10.0
#: A missed objective by this factor or more grows by it (HPA's rule), not by the queue's estimate.
SEVERE = 2.0
#: The latency no instance count removes is taken as at most this share of the objective.
MAX_BASE = 0.8
#: The recent part of the window whose arrivals show a rise: its last quarter, at least this long.
RECENT_SECONDS = 5


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
    ttft = _ratio(signals, "ttft", p, objectives.ttft_milliseconds / 1000)
    itl = _ratio(signals, "itl", p, objectives.itl_milliseconds / 1000)
    measured = {
        "ttft_ms": _ms(signals, "ttft", p),
        "itl_ms": _ms(signals, "itl", p),
    }
    ratios, notes = _role_ratios(signals, p, ttft, itl)
    decode_load = _per_slot(_in_flight(signals, "decode"), roles["decode"])
    if itl is not None and signals.known:
        memory = replace(memory, samples=(*memory.samples, (now, decode_load, itl)))
    window_base = _prefill_base(signals, roles["prefill"], ratios["prefill"])
    if window_base is not None:
        memory = replace(memory, prefill_bases=(*memory.prefill_bases, (now, window_base)))
    prefill_known = prefill_base(memory.prefill_bases)
    base = {
        "prefill": window_base if prefill_known is None else prefill_known,
        "decode": decode_base(memory.samples),
    }
    rate, growth = _arrivals(signals)
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
                model = _prefill_model(signals, state, prefill_known, rate)
            if model is not None:
                q, need, shown = model
                modelled.add(role)
                why.append(shown)
            else:
                need = _need(running, q, base[role])
            rec, how = _recommend(spec, running, q, need, severe=model is None)
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


# --- step 1: the objective ratios ------------------------------------------------------------------


def _ms(signals: Signals, kind: str, p: float) -> float | None:
    counts = signals.latency.get(kind, {})
    if sum(counts.values()) < MIN_SAMPLES:
        return None
    value = percentile(counts, p)
    return None if value is None else value * 1000


def _ratio(signals: Signals, kind: str, p: float, objective_s: float) -> float | None:
    ms = _ms(signals, kind, p)
    return None if ms is None else min(MAX_RATIO, ms / 1000 / objective_s)


def _role_ratios(
    signals: Signals, p: float, ttft: float | None, itl: float | None
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Prefill answers for TTFT and decode for ITL; a missed TTFT goes to the leg that takes longer."""
    ratios: dict[str, float | None] = {"prefill": ttft, "decode": itl}
    notes = {"prefill": "", "decode": ""}
    if ttft is None or ttft <= 1:
        return ratios, notes
    prefill_leg = _ms(signals, "prefill", p)
    decode_first = _ms(signals, "decode_first", p)
    if prefill_leg is not None and decode_first is not None and decode_first > prefill_leg:
        ratios["prefill"] = 1.0
        ratios["decode"] = max(itl or 0.0, ttft)
        notes["prefill"] = (
            f"TTFT missed at the decode (its first byte p{p:g} {decode_first:.0f} ms > prefill leg "
            f"{prefill_leg:.0f} ms)"
        )
        notes["decode"] = notes["prefill"]
    return ratios, notes


# --- step 2: the recommendation ------------------------------------------------------------------


def _per_slot(count: float, state: RoleState) -> float:
    return count / max(state.slots or state.ready, 1)


def _in_flight(signals: Signals, role: str) -> float:
    """The role's legs in flight on average over the window: the rate its legs ended at times their
    mean time (Little's law on the routers' counts); the routers' count now when too few ended."""
    legs = signals.latency.get(role, {})
    average = mean(legs)
    if sum(legs.values()) < MIN_SAMPLES or average is None or signals.covered_seconds <= 0:
        return float(signals.in_flight.get(role, 0))
    return sum(legs.values()) / signals.covered_seconds * average


def _prefill_base(signals: Signals, state: RoleState, q: float | None) -> float | None:
    """This window's prefill ratio at no load, ``q / (1 + N)``, N its legs in flight per slot."""
    if q is None or sum(signals.latency.get("prefill", {}).values()) < MIN_SAMPLES:
        return None
    return q / (1 + _per_slot(_in_flight(signals, "prefill"), state))


def prefill_base(bases: Sequence[tuple[float, float]]) -> float | None:
    """The prefill's TTFT ratio at no load: the median of the recent windows' (a window's
    percentile is its longest prompts', high or low by chance; the median of many is the
    traffic's). None until :data:`MIN_FIT_SAMPLES` windows are known."""
    if len(bases) < MIN_FIT_SAMPLES:
        return None
    ordered = sorted(a for _, a in bases)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _prefill_model(
    signals: Signals, state: RoleState, base: float, rate: float
) -> tuple[float, float, str] | None:
    """The prefill's ratio and need in the queue model, and how they were reckoned: ``u`` the work
    arriving per slot (requests a second, or legs ended when more, times a prompt's mean no-load
    time), ``q = a / (1 - u)``, a need of ``ready x u / (1 - a)``. None without a measured leg."""
    legs = signals.latency.get("prefill", {})
    average = mean(legs)
    if average is None or signals.covered_seconds <= 0:
        return None
    alone = average / (1 + _per_slot(_in_flight(signals, "prefill"), state))  # a prompt's no-load time
    ended = sum(legs.values()) / signals.covered_seconds
    u = max(rate, ended) * alone / max(state.slots or state.ready, 1)
    a = min(base, MAX_BASE)
    q = MAX_RATIO if u >= 1 else min(MAX_RATIO, a / (1 - u))
    running = state.ready or state.desired
    shown = f"queue model: no-load ratio {a:.2f} (recent windows' median), load {u:.2f} a slot: ratio {q:.2f}"
    return q, running * u / (1 - a), shown


def decode_base(samples: Sequence[tuple[float, float, float]]) -> float | None:
    """The decode's ITL ratio at no load, from the recent (sequences per slot, ratio) pairs: the
    least-squares slope, through the pairs of the lightest load seen (the end the answer is
    about: a busy machine bends the line up at the heavy end). None while the loads are too
    alike to draw it, or it slopes the wrong way; never above 90 % of the lowest ratio seen."""
    samples = [x for x in samples if x[1] > 0]  # a moment with no sequence in flight says nothing
    if len(samples) < MIN_FIT_SAMPLES:
        return None
    loads = [b for _, b, _ in samples]
    ratios = [q for _, _, q in samples]
    if max(loads) / min(loads) < MIN_FIT_SPREAD:
        return None
    n = len(samples)
    mean_b, mean_q = sum(loads) / n, sum(ratios) / n
    spread = sum((b - mean_b) ** 2 for b in loads)
    slope = sum((b - mean_b) * (q - mean_q) for b, q in zip(loads, ratios, strict=True)) / spread
    if slope <= 0:
        return None
    light = [q - slope * b for _, b, q in samples if b <= LIGHT_LOAD * min(loads)]
    return min(max(sum(light) / len(light), 0.0), 0.9 * min(ratios))


def _need(running: int, q: float, base: float | None) -> float | None:
    """The instances the window's traffic needs at the objective (None without a base): the
    larger of two models. In the queue model ``q = a / (1 - u)``, steady at the window's load;
    past its objective a role is not steady (its backlog grows, and its latency with it), and the
    part of the latency over the no-load share shrinks at most in proportion to the count,
    ``running x (q - a) / (1 - a)`` (HPA's ``running x q`` when ``a`` is 0). The queue model is
    the larger below the objective (a role never shrinks into overload), the other above it."""
    if base is None:
        return None
    a = min(base, 0.95 * q, MAX_BASE)
    return running * max(1 - a / q, q - a) / (1 - a)


def _recommend(
    spec: AutoscalingSpec, running: int, q: float, need: float | None, severe: bool = True
) -> tuple[int, str]:
    """The count to recommend from the objective ratio and the need, and how that was reckoned
    (``severe``: a ratio missed twice over grows by ``running x q``, HPA's rule)."""
    up, down = spec.behavior.scale_up, spec.behavior.scale_down
    if 1 - down.tolerance <= q <= 1 + up.tolerance:
        return running, ""
    shown = "" if need is None else f"its traffic needs {need:.1f} of {running} at the objective"
    if q > 1:
        rec = max(math.ceil((need or 0.0) - 1e-9), running + 1)
        if severe and q >= SEVERE:
            rec = max(rec, math.ceil(running * q - 1e-9))
        return rec, shown
    if need is None:
        return running, "no base latency known yet: not shrinking"
    return max(1, min(math.ceil(need - 1e-9), running)), shown


def _arrivals(signals: Signals) -> tuple[float, float]:
    """Requests arriving a second now, and how many times as fast as in the window before its
    recent part (the window's latencies are mostly of that part): the rate of its last quarter
    (at least :data:`RECENT_SECONDS`) when beyond a Poisson count's two standard deviations over
    the rest of it; else the window's, at 1. The current second is still counting: left out."""
    seconds = list(signals.started[:-1])
    covered = min(len(seconds), int(signals.covered_seconds))
    if covered <= 0:
        return 0.0, 1.0
    seconds = seconds[-covered:]
    rate = sum(seconds) / covered
    recent = max(RECENT_SECONDS, covered // 4)
    if recent >= covered:
        return rate, 1.0
    before = sum(seconds[:-recent]) / (covered - recent)
    expected = before * recent
    arrived = sum(seconds[-recent:])
    if before <= 0 or arrived <= expected + 2 * math.sqrt(expected):
        return rate, 1.0
    return arrived / recent, arrived / expected


# --- step 6: the pair ------------------------------------------------------------------------------


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
