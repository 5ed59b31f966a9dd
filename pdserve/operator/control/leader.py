"""Leader election through a ``coordination.k8s.io/v1`` Lease, with the semantics of client-go.

Why not kopf's peering: it is not a Lease and does not fence a stale leader. Why a fence: a
leader that stalls (GC pause, SIGSTOP, a partition) keeps believing it leads until it runs again;
if it then writes, two replicas drive the same pods. So, as client-go's ``leaderelection``:

* The Lease records ``holderIdentity``, ``leaseDurationSeconds``, ``acquireTime``, ``renewTime``
  and ``leaseTransitions``. Expiry is judged by watching the record *change* on this replica's own
  monotonic clock (a record unchanged for its ``leaseDurationSeconds`` is expired), never by
  comparing remote wall-clock times, so skewed clocks cannot hand the lease over early.
* Every write carries the ``resourceVersion`` last read: two candidates never both win.
* The leader renews every ``retry_period``; a leader whose last successful renew was sent
  ``renew_deadline`` ago or more has lost (the deadline is shorter than the lease duration, so it
  stops before any other replica may take over). :meth:`LeaderElector.refusal` is that fence, and
  every mutating API call of the operator passes through it (:class:`pdserve.operator.cluster.kube.Kube`).
* Losing the lease is final: the process stops writing at once and exits non-zero
  (client-go's ``OnStoppedLeading``), so Kubernetes restarts it as a follower.
* A graceful stop releases the lease (empty ``holderIdentity``) so another replica takes over at
  its next retry rather than after a full lease duration.

The decisions are pure functions over :class:`LeaseRecord` and :class:`Observed`
(:func:`observe`, :func:`decide`, :func:`next_record`, :func:`released`); :class:`LeaderElector`
is the thread that performs them against the API server.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.operator import metrics
from pdserve.operator.cluster.kube import Kube, KubeError

log = logging.getLogger("pdserve.operator.leader")

DEFAULT_LEASE_NAME = "pdserve-operator"
LEASE_DURATION = 15
RENEW_DEADLINE = 10.0
RETRY_PERIOD = 2.0
#: client-go's ``JitterFactor``: a candidate retries after ``retry * (1 + rand * 1.2)``.
JITTER_FACTOR = 1.2
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


# --- the pure part ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElectionConfig:
    """Timings in seconds; :func:`validate` holds them to client-go's rules."""

    namespace: str
    name: str
    identity: str
    lease_duration: int = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD


def validate(lease_duration: float, renew_deadline: float, retry_period: float) -> list[str]:
    """client-go's checks: each step must fit inside the next, or a leader could lapse unnoticed."""
    problems = []
    if lease_duration <= 0 or renew_deadline <= 0 or retry_period <= 0:
        problems.append("--lease-duration, --renew-deadline and --retry-period must be positive")
    if lease_duration <= renew_deadline:
        problems.append(
            f"--lease-duration ({lease_duration:g}) must be greater than "
            f"--renew-deadline ({renew_deadline:g})"
        )
    if renew_deadline <= JITTER_FACTOR * retry_period:
        problems.append(
            f"--renew-deadline ({renew_deadline:g}) must be greater than {JITTER_FACTOR:g} x "
            f"--retry-period ({JITTER_FACTOR * retry_period:g})"
        )
    return problems


#: Each field of :class:`LeaseRecord`: its key in the Lease's spec, and how a value read there
#: becomes the field's (a missing or null holder, duration or count reads as "" or 0).
LEASE_SPEC: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("holder", "holderIdentity", lambda value: str(value or "")),
    ("duration", "leaseDurationSeconds", lambda value: int(value or 0)),
    ("acquire_time", "acquireTime", lambda value: value),
    ("renew_time", "renewTime", lambda value: value),
    ("transitions", "leaseTransitions", lambda value: int(value or 0)),
)


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as far as election is concerned (an empty ``holder`` is a free lease)."""

    holder: str
    duration: int
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> LeaseRecord:
        spec = spec or {}
        return cls(**{name: read(spec.get(key)) for name, key, read in LEASE_SPEC})

    def to_spec(self) -> dict[str, Any]:
        return {key: getattr(self, name) for name, key, _ in LEASE_SPEC}


@dataclass(frozen=True)
class Observed:
    """The last Lease read: its record, its resourceVersion, and when (local monotonic) it last changed.

    ``record`` is None when no Lease exists.
    """

    record: LeaseRecord | None
    resource_version: str | None
    changed_at: float


def observe(
    previous: Observed | None, record: LeaseRecord | None, resource_version: str | None, now: float
) -> Observed:
    """The new observation; the change time moves only when the record itself changed.

    A resourceVersion change alone (a label edit) is not a renewal, as in client-go, which compares
    the record, not the object.
    """
    if previous is not None and previous.record == record:
        return replace(previous, resource_version=resource_version)
    return Observed(record, resource_version, now)


def expired(observed: Observed, now: float) -> bool:
    """Unchanged for its own ``leaseDurationSeconds`` on this replica's clock (client-go's rule)."""
    record = observed.record
    return record is None or now - observed.changed_at >= record.duration


def transition_seen(previous: Observed | None, current: Observed) -> bool:
    """The holder changed to another non-empty identity since the last read (a release is not one)."""
    if previous is None or current.record is None or not current.record.holder:
        return False
    before = previous.record.holder if previous.record is not None else ""
    return current.record.holder != before


def renewed_within(last_renewed: float | None, now: float, renew_deadline: float) -> bool:
    """The fence: this replica leads only while its last successful renew is younger than the deadline."""
    return last_renewed is not None and now - last_renewed < renew_deadline


class Step(enum.Enum):
    CREATE = "create"  # no Lease: create it, holding it
    ACQUIRE = "acquire"  # free or expired: take it over (leaseTransitions + 1)
    RENEW = "renew"  # ours: write a new renewTime
    WAIT = "wait"  # another replica holds a valid lease
    LOST = "lost"  # we led and no longer may: stop writing, exit


@dataclass(frozen=True)
class Decision:
    step: Step
    why: str = ""


def decide(
    observed: Observed, identity: str, last_renewed: float | None, now: float, renew_deadline: float
) -> Decision:
    """What to do after reading the Lease. ``last_renewed`` is None while this replica follows.

    A leader that missed its renew deadline, finds another holder, or finds the Lease deleted has
    lost, even if it could still write: another replica may already act on the lease (a deleted
    Lease lets any candidate create it at once, so the old leader stops at once too).
    """
    record = observed.record
    if last_renewed is not None:
        if not renewed_within(last_renewed, now, renew_deadline):
            return Decision(Step.LOST, f"no renew within the renew deadline ({renew_deadline:g} s)")
        if record is None:
            return Decision(Step.LOST, "the Lease was deleted")
        if record.holder != identity:
            return Decision(Step.LOST, f"the Lease is now held by {record.holder or 'nobody'}")
        return Decision(Step.RENEW)
    if record is None:
        return Decision(Step.CREATE)
    if record.holder == identity:
        return Decision(Step.RENEW, "our own earlier write, whose answer never came")
    if not record.holder:
        return Decision(Step.ACQUIRE, "released")
    if expired(observed, now):
        return Decision(Step.ACQUIRE, f"{record.holder} did not renew for {record.duration} s")
    return Decision(Step.WAIT, f"held by {record.holder}")


def next_record(
    step: Step, current: LeaseRecord | None, identity: str, duration: int, wall_now: str
) -> LeaseRecord:
    """The record to write for CREATE, ACQUIRE or RENEW.

    A renewal keeps ``acquireTime`` and ``leaseTransitions``; a takeover counts one more transition.
    """
    if step is Step.RENEW and current is not None and current.holder == identity:
        return replace(current, duration=duration, renew_time=wall_now)
    if step is Step.CREATE or current is None:
        return LeaseRecord(identity, duration, wall_now, wall_now, 0)
    return LeaseRecord(identity, duration, wall_now, wall_now, current.transitions + 1)


def released(current: LeaseRecord, wall_now: str) -> LeaseRecord:
    """What a leader writes when it stops gracefully: no holder, so a candidate acquires at once.

    Same shape as client-go's release (duration 1 s, transitions kept).
    """
    return LeaseRecord("", 1, wall_now, wall_now, current.transitions)


def micro_time(now: datetime | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC): for people and kubectl, not for expiry."""
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity(environ: Mapping[str, str] | None = None) -> str:
    """The pod's name (downward API) or the hostname, plus a random suffix.

    The suffix makes a restarted container a new candidate: it never mistakes its predecessor's
    lease (which that process may still be acting on) for its own.
    """
    env = os.environ if environ is None else environ
    base = env.get("POD_NAME") or socket.gethostname()
    return f"{base}_{secrets.token_hex(4)}"


def default_namespace(
    environ: Mapping[str, str] | None = None, sa_file: Path = SERVICE_ACCOUNT_NAMESPACE
) -> str | None:
    """$POD_NAMESPACE, else the in-cluster service account's namespace, else None."""
    env = os.environ if environ is None else environ
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return sa_file.read_text().strip() or None
    except OSError:
        return None


# --- the shell -------------------------------------------------------------------------------------


class LeaderElector:
    """Runs the election on its own thread; :meth:`refusal` is the fence for every write.

    ``kube`` should be its own :class:`~pdserve.operator.cluster.kube.Kube` (own connection pool, no
    fence), so a busy reconciler never delays a renewal. ``on_started`` runs on the election
    thread when this replica starts leading; ``on_stopped`` when it has lost the lease (never
    after a graceful :meth:`release`).
    """

    def __init__(
        self,
        config: ElectionConfig,
        kube: Kube,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], str] = micro_time,
    ) -> None:
        self.config = config
        self._kube = kube
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._last_renewed: float | None = None  # monotonic time the last successful write was *sent*
        self._observed: Observed | None = None
        self._stepped_down = False
        self._lost_reason: str | None = None
        self._last_failure: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_started: Callable[[], None] = lambda: None
        self._on_stopped: Callable[[str], None] = lambda reason: None
        metrics.LEADER.labels(config.identity).set(0)

    @property
    def lease(self) -> str:
        return f"{self.config.namespace}/{self.config.name}"

    @property
    def lost(self) -> str | None:
        """Why leadership was lost, or None."""
        return self._lost_reason

    def refusal(self) -> str | None:
        """The fence: why this process may not write now, or None while its lease is fresh.

        Read with the monotonic clock at the moment of the call, so a process that was paused
        (SIGSTOP, a long GC, a frozen VM) refuses its first write after it resumes.
        """
        cfg = self.config
        with self._lock:
            if self._stepped_down:
                return f"{cfg.identity} is stopping and no longer leads (lease {self.lease})"
            if self._last_renewed is None:
                return f"{cfg.identity} does not hold the leader lease {self.lease}"
            age = self._clock() - self._last_renewed
        if age >= cfg.renew_deadline:
            return (
                f"{cfg.identity} last renewed the leader lease {self.lease} {age:.1f} s ago "
                f"(renew deadline {cfg.renew_deadline:g} s)"
            )
        return None

    def start(self, on_started: Callable[[], None], on_stopped: Callable[[str], None]) -> None:
        self._on_started, self._on_stopped = on_started, on_stopped
        self._thread = threading.Thread(target=self._loop, name="leader-election", daemon=True)
        self._thread.start()

    def step_down(self) -> None:
        """From now on the fence refuses every write; the lease itself is kept until :meth:`release`."""
        with self._lock:
            self._stepped_down = True
        self._stop.set()
        metrics.LEADER.labels(self.config.identity).set(0)

    def release(self) -> None:
        """Step down, stop the loop and, if the lease is still ours, free it for the next leader.

        Call it once this process's writes are over: the next leader starts at its next retry.
        """
        with self._lock:
            was_leading = renewed_within(self._last_renewed, self._clock(), self.config.renew_deadline)
        self.step_down()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.renew_deadline)
        observed = self._observed
        if not was_leading or observed is None or observed.record is None:
            return
        if observed.record.holder != self.config.identity:
            return
        body = self._lease_object(released(observed.record, self._wall()), observed.resource_version)
        try:
            self._kube.replace(body, timeout=self.config.retry_period)
            log.info("released the leader lease %s", self.lease)
        except KubeError as exc:  # 409: it changed meanwhile; else the next leader waits for expiry
            log.warning("did not release the leader lease %s: %s", self.lease, exc)

    # --- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        cfg = self.config
        while not self._stop.is_set():
            was_leading = self._last_renewed is not None
            try:
                self._attempt()
            except _Lost as lost:
                self._lose(str(lost))
                return
            except Exception:  # keep trying: only the renew deadline decides that leadership is lost
                log.exception("leader election attempt on %s failed", self.lease)
            if self._stop.is_set():
                return
            if self._last_renewed is not None:
                if not was_leading:
                    self._started()
                # Never sleep past the deadline: the loss is then noticed (and the process ends) at once.
                left = self._last_renewed + cfg.renew_deadline - self._clock()
                delay = max(0.0, min(cfg.retry_period, left))
            else:
                delay = cfg.retry_period * (1 + random.random() * JITTER_FACTOR)
            self._stop.wait(delay)

    def _attempt(self) -> None:
        cfg = self.config
        timeout = cfg.renew_deadline
        if self._last_renewed is not None:
            timeout = self._last_renewed + cfg.renew_deadline - self._clock()
            if timeout <= 0:
                raise _Lost(f"no renew of {self.lease} within the renew deadline ({cfg.renew_deadline:g} s)")
        try:
            obj = self._kube.get("Lease", cfg.namespace, cfg.name, timeout=timeout)
        except KubeError as exc:
            self._failed(f"cannot read {self.lease}: {exc}")
            return
        now = self._clock()
        record = LeaseRecord.from_spec(obj.get("spec")) if obj is not None else None
        version = _resource_version(obj)
        previous = self._observed
        observed = self._observed = observe(previous, record, version, now)
        if transition_seen(previous, observed):
            metrics.LEADER_TRANSITIONS.inc()
        decision = decide(observed, cfg.identity, self._last_renewed, now, cfg.renew_deadline)
        if decision.step is Step.LOST:
            raise _Lost(f"{decision.why} (lease {self.lease})")
        if decision.step is Step.WAIT:
            holder = record.holder if record is not None else ""
            if previous is None or previous.record is None or previous.record.holder != holder:
                log.info("following: the leader lease %s is held by %s", self.lease, holder)
            return
        wanted = next_record(decision.step, record, cfg.identity, cfg.lease_duration, self._wall())
        body = self._lease_object(wanted, version)
        sent = self._clock()
        try:
            if decision.step is Step.CREATE:
                answer = self._kube.create(body, timeout=timeout)
            else:
                answer = self._kube.replace(body, timeout=timeout)
        except KubeError as exc:  # 409: another replica created or wrote first; read again next time
            self._failed(f"cannot {decision.step.value} {self.lease}: {exc}")
            return
        self._last_failure = None
        self._observed = Observed(LeaseRecord.from_spec(answer.get("spec")), _resource_version(answer), sent)
        with self._lock:
            if self._stepped_down:
                return
            self._last_renewed = sent
        if decision.step is Step.ACQUIRE:
            metrics.LEADER_TRANSITIONS.inc()
            log.info("acquired the leader lease %s: %s", self.lease, decision.why)

    def _failed(self, why: str) -> None:
        """A leader warns at every failed renewal; a candidate once per distinct failure (a 403
        must not stay silent, a conflict lost to another candidate is routine)."""
        if self._last_renewed is not None:
            log.warning("leader lease renewal failed: %s", why)
        elif why != self._last_failure and "409" not in why:
            log.warning("cannot take part in leader election: %s", why)
        else:
            log.debug("leader election: %s", why)
        self._last_failure = why

    def _started(self) -> None:
        record = self._observed.record if self._observed is not None else None
        log.info(
            "became leader: %s holds the lease %s (leaseTransitions %s)",
            self.config.identity,
            self.lease,
            record.transitions if record is not None else 0,
        )
        metrics.LEADER.labels(self.config.identity).set(1)
        self._on_started()

    def _lose(self, reason: str) -> None:
        with self._lock:
            self._last_renewed = None
            self._lost_reason = reason
        metrics.LEADER.labels(self.config.identity).set(0)
        log.error("lost leadership: %s; refusing every write and exiting", reason)
        self._on_stopped(reason)

    def _lease_object(self, record: LeaseRecord, resource_version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version  # optimistic concurrency: 409 if it moved
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": record.to_spec(),
        }


class _Lost(Exception):
    pass


def _resource_version(obj: Mapping[str, Any] | None) -> str | None:
    version = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    return str(version) if version is not None else None
