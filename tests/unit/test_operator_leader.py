"""Leader election's decisions (pdserve/operator/control/leader.py), without an API server.

Every transition of :func:`decide`, expiry judged on the local clock only (skewed remote times
change nothing), the records written, release, the flag checks, and a model of several
candidates sharing one Lease through resourceVersion-checked writes: at no instant do two of
them pass the fence, whatever the interleaving and whatever their clocks' origins.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.operator.cli import configure, election_config
from pdserve.operator.cluster.kube import Kube, KubeError, NotLeader
from pdserve.operator.control.leader import (
    DEFAULT_LEASE_NAME,
    LeaseRecord,
    Observed,
    Step,
    decide,
    default_identity,
    default_namespace,
    expired,
    next_record,
    observe,
    released,
    renewed_within,
    transition_seen,
    validate,
)

ME, OTHER = "operator-a_1", "operator-b_2"
DEADLINE = 10.0
T0 = "2030-01-01T00:00:00.000000Z"


def held(holder: str, renew: str = T0, duration: int = 15, transitions: int = 3) -> LeaseRecord:
    return LeaseRecord(holder, duration, T0, renew, transitions)


def seen(record: LeaseRecord | None, at: float, version: str = "1") -> Observed:
    return observe(None, record, version, at)


# --- validation ------------------------------------------------------------------------------------


def test_defaults_are_valid_and_client_go_rules_are_enforced() -> None:
    assert validate(15, 10, 2) == []
    assert "greater than --renew-deadline" in validate(10, 10, 2)[0]
    assert "1.2 x --retry-period" in validate(15, 10, 9)[0]
    assert validate(15, 2.4, 2)  # the jittered retry must fit inside the deadline
    assert validate(15, 2.5, 2) == []
    assert "must be positive" in validate(0, 10, 2)[0]


# --- observing -------------------------------------------------------------------------------------


def test_first_sight_starts_the_clock_and_only_a_changed_record_restarts_it() -> None:
    first = seen(held(OTHER), at=100.0)
    assert first.changed_at == 100.0
    same = observe(first, held(OTHER), "2", 105.0)  # a label edit: new resourceVersion, same record
    assert (same.changed_at, same.resource_version) == (100.0, "2")
    renewed = observe(same, held(OTHER, renew="2030-01-01T00:00:05.000000Z"), "3", 107.0)
    assert renewed.changed_at == 107.0


def test_expiry_counts_from_the_last_change_on_the_local_clock() -> None:
    obs = seen(held(OTHER, duration=15), at=100.0)
    assert not expired(obs, 114.999)
    assert expired(obs, 115.0)
    assert expired(seen(None, at=100.0), 100.0)


@pytest.mark.parametrize(
    "renew_time",
    ["2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z", None],
    ids=["remote-clock-far-behind", "remote-clock-far-ahead", "no-renew-time"],
)
def test_remote_clock_skew_changes_no_decision(renew_time: str | None) -> None:
    """A holder whose wall clock is decades off is still waited for exactly its duration."""
    obs = seen(LeaseRecord(OTHER, 15, renew_time, renew_time, 1), at=50.0)
    assert decide(obs, ME, None, 64.0, DEADLINE).step is Step.WAIT
    assert decide(obs, ME, None, 65.0, DEADLINE).step is Step.ACQUIRE


def test_a_renewal_seen_just_before_expiry_keeps_the_holder() -> None:
    obs = seen(held(OTHER), at=0.0)
    obs = observe(obs, held(OTHER, renew="2030-01-01T00:00:14.000000Z"), "2", 14.5)
    assert decide(obs, ME, None, 20.0, DEADLINE).step is Step.WAIT
    assert decide(obs, ME, None, 29.5, DEADLINE).step is Step.ACQUIRE


def test_transitions_seen_are_holder_changes_to_someone() -> None:
    a = seen(held(OTHER), 0.0)
    assert not transition_seen(None, a)  # first sight is not a transition
    assert not transition_seen(a, observe(a, held(OTHER, renew="x"), "2", 1.0))
    free = observe(a, released(held(OTHER), T0), "3", 2.0)
    assert not transition_seen(a, free)  # a release is not a new leader yet
    assert transition_seen(free, observe(free, held(ME), "4", 3.0))
    assert transition_seen(a, observe(a, held(ME), "4", 3.0))


# --- decisions -------------------------------------------------------------------------------------


def test_follower_decisions() -> None:
    assert decide(seen(None, 0.0), ME, None, 0.0, DEADLINE).step is Step.CREATE
    assert decide(seen(held(""), 0.0), ME, None, 0.0, DEADLINE).step is Step.ACQUIRE
    waiting = decide(seen(held(OTHER), 0.0), ME, None, 1.0, DEADLINE)
    assert (waiting.step, waiting.why) == (Step.WAIT, f"held by {OTHER}")
    taking = decide(seen(held(OTHER), 0.0), ME, None, 15.0, DEADLINE)
    assert taking.step is Step.ACQUIRE and "did not renew for 15 s" in taking.why
    # Our own write whose answer was lost: it is ours, renew it (no new transition).
    assert decide(seen(held(ME), 0.0), ME, None, 1.0, DEADLINE).step is Step.RENEW


def test_leader_decisions() -> None:
    assert decide(seen(held(ME), 5.0), ME, 4.0, 6.0, DEADLINE).step is Step.RENEW
    late = decide(seen(held(ME), 5.0), ME, 4.0, 14.0, DEADLINE)
    assert late.step is Step.LOST and "renew deadline (10 s)" in late.why
    taken = decide(seen(held(OTHER), 5.0), ME, 4.0, 6.0, DEADLINE)
    assert taken.step is Step.LOST and OTHER in taken.why
    assert decide(seen(None, 5.0), ME, 4.0, 6.0, DEADLINE).why == "the Lease was deleted"
    assert "nobody" in decide(seen(held(""), 5.0), ME, 4.0, 6.0, DEADLINE).why


def test_the_fence_holds_strictly_inside_the_renew_deadline() -> None:
    assert not renewed_within(None, 0.0, DEADLINE)
    assert renewed_within(100.0, 109.999, DEADLINE)
    assert not renewed_within(100.0, 110.0, DEADLINE)


# --- records written -------------------------------------------------------------------------------


def test_records_written_for_each_step() -> None:
    now = "2030-01-01T00:01:00.000000Z"
    assert next_record(Step.CREATE, None, ME, 15, now) == LeaseRecord(ME, 15, now, now, 0)
    mine = held(ME, transitions=4)
    renewed = next_record(Step.RENEW, mine, ME, 20, now)
    assert renewed == LeaseRecord(ME, 20, T0, now, 4)  # acquireTime and transitions kept
    assert next_record(Step.ACQUIRE, held(OTHER, transitions=4), ME, 15, now) == LeaseRecord(
        ME, 15, now, now, 5
    )
    assert next_record(Step.ACQUIRE, released(mine, now), ME, 15, now).transitions == 5


def test_release_frees_the_lease_and_keeps_the_count() -> None:
    now = "2030-01-01T00:02:00.000000Z"
    free = released(held(ME, transitions=7), now)
    assert free == LeaseRecord("", 1, now, now, 7)
    # Another candidate takes a released lease at its next read, without waiting for expiry.
    assert decide(seen(free, 0.0), OTHER, None, 0.0, DEADLINE).step is Step.ACQUIRE


def test_lease_spec_round_trip() -> None:
    record = LeaseRecord(ME, 15, T0, T0, 2)
    spec = record.to_spec()
    assert spec == {
        "holderIdentity": ME,
        "leaseDurationSeconds": 15,
        "acquireTime": T0,
        "renewTime": T0,
        "leaseTransitions": 2,
    }
    assert LeaseRecord.from_spec(spec) == record
    assert LeaseRecord.from_spec(None) == LeaseRecord("", 0)
    assert LeaseRecord.from_spec({"holderIdentity": None, "leaseDurationSeconds": 1}).holder == ""


# --- a model: candidates, one Lease, resourceVersion-checked writes ----------------------------------


@dataclass
class Store:
    """One Lease as the API server keeps it: a write must name the current resourceVersion."""

    record: LeaseRecord | None = None
    version: int = 0
    decisions: int = 0

    def micro_time(self, now: float) -> str:
        """The wall time a decision writes: a MicroTime, never the same for two decisions (each
        follows an API round trip), so a renewal always changes the record, as on a real cluster.
        Two equal records would read as no renewal to the followers (client-go compares records)."""
        self.decisions += 1
        return f"t={now}#{self.decisions}"

    def write(self, expected: str | None, record: LeaseRecord) -> str | None:
        current = str(self.version) if self.record is not None else None
        if expected != current:
            return None  # 409 Conflict (or AlreadyExists for a create)
        self.record, self.version = record, self.version + 1
        return str(self.version)


@dataclass
class Candidate:
    identity: str
    offset: float  # its monotonic clock's origin: clocks of different processes are unrelated
    observed: Observed | None = None
    last_renewed: float | None = None
    pending: tuple[Step, LeaseRecord, str | None] | None = None
    lost: bool = False
    stalled_until: float = 0.0


def read(c: Candidate, store: Store, now: float) -> None:
    clock = now + c.offset
    version = str(store.version) if store.record is not None else None
    c.observed = observe(c.observed, store.record, version, clock)
    decision = decide(c.observed, c.identity, c.last_renewed, clock, DEADLINE)
    c.pending = None
    if decision.step is Step.LOST:
        c.lost, c.last_renewed = True, None
    elif decision.step is not Step.WAIT:
        wanted = next_record(decision.step, store.record, c.identity, 15, store.micro_time(now))
        c.pending = (decision.step, wanted, version)


def write(c: Candidate, store: Store, now: float) -> None:
    """Sent now (the elector takes ``sent`` just before the call); lands at once."""
    assert c.pending is not None
    _, wanted, version = c.pending
    c.pending = None
    sent = now + c.offset
    if store.write(version, wanted) is not None:
        c.observed = Observed(wanted, str(store.version), sent)
        c.last_renewed = sent


actions = st.lists(
    st.tuples(
        st.sampled_from(["attempt", "attempt", "read", "write", "tick", "tick", "stall"]),
        st.integers(0, 2),
        st.sampled_from([0.1, 0.5, 1.0, 2.0, 4.0, 9.5]),
    ),
    min_size=1,
    max_size=150,
)


@settings(max_examples=1000, deadline=None)
@given(actions, st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=3))
@example(  # an acquire, then a renewal decided at once and sent 19 s late (equal records fooled c2)
    [
        ("attempt", 0, 0.1),
        ("attempt", 2, 0.1),
        ("read", 0, 0.1),
        ("tick", 0, 9.5),
        ("tick", 0, 9.5),
        ("write", 0, 0.1),
        ("attempt", 2, 0.1),
    ],
    [0.0, 0.0, 0.0],
)
def test_no_two_candidates_ever_pass_the_fence_at_once(
    steps: list[tuple[str, int, float]], offsets: list[float]
) -> None:
    store = Store()
    candidates = [Candidate(f"c{i}", offsets[i]) for i in range(3)]
    now = 0.0
    for action, who, amount in steps:
        c = candidates[who]
        if action == "tick":
            now += amount
        elif action == "stall":  # a GC pause or SIGSTOP: the candidate does nothing for a while
            c.stalled_until = now + amount * 3
        elif c.lost or now < c.stalled_until:
            pass
        elif action in ("read", "attempt"):
            read(c, store, now)
        if action in ("write", "attempt") and c.pending is not None and not c.lost and now >= c.stalled_until:
            # A write decided before a stall goes out late: the store's resourceVersion check or
            # the fence keeps it from mattering (a stale leader's renew only lengthens its own lease).
            write(c, store, now)
        passing = [x.identity for x in candidates if renewed_within(x.last_renewed, now + x.offset, DEADLINE)]
        assert len(passing) <= 1, (now, passing, store)


def test_a_conflicting_write_loses_and_the_loser_follows() -> None:
    store = Store()
    a, b = Candidate("a", 0.0), Candidate("b", 500.0)
    read(a, store, 0.0)
    read(b, store, 0.0)  # both saw no Lease and both try to create it
    write(a, store, 0.1)
    write(b, store, 0.1)
    assert (a.last_renewed, b.last_renewed) == (0.1, None)
    read(b, store, 1.0)
    assert b.pending is None and store.record is not None and store.record.holder == "a"
    # a keeps renewing; b never takes over while the record keeps changing.
    for t in range(2, 40, 2):
        read(a, store, float(t))
        write(a, store, float(t))
        read(b, store, float(t) + 1)
        assert b.pending is None
    # a stops (killed): b takes over one lease duration after it last saw a change, not sooner.
    read(b, store, 53.0)
    assert b.pending is None
    read(b, store, 54.0)
    assert b.pending is not None and b.pending[0] is Step.ACQUIRE
    write(b, store, 54.0)
    assert store.record is not None and (store.record.holder, store.record.transitions) == ("b", 1)


# --- identity, namespace and flags ---------------------------------------------------------------


def test_identity_is_the_pod_name_with_a_fresh_suffix() -> None:
    one, two = (
        default_identity({"POD_NAME": "pdserve-7d9f-abcde"}),
        default_identity({"POD_NAME": "pdserve-7d9f-abcde"}),
    )
    assert one.startswith("pdserve-7d9f-abcde_") and one != two
    assert default_identity({}).rsplit("_", 1)[0]


def test_namespace_from_env_then_service_account(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    assert default_namespace({"POD_NAMESPACE": "ops"}, sa) == "ops"
    assert default_namespace({}, sa) is None
    sa.write_text("pdserve-system\n")
    assert default_namespace({}, sa) == "pdserve-system"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["--all-namespaces", *argv])


def test_flags_default_to_an_election_on_a_pdserve_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "pdserve-system")
    monkeypatch.setenv("POD_NAME", "pdserve-0")
    config = election_config(parse())
    assert config is not None
    assert (config.namespace, config.name) == ("pdserve-system", DEFAULT_LEASE_NAME)
    assert "pdserve" in config.name and config.identity.startswith("pdserve-0_")
    assert (config.lease_duration, config.renew_deadline, config.retry_period) == (15, 10.0, 2.0)
    assert election_config(parse("--no-leader-elect")) is None
    custom = election_config(parse("--leader-election-namespace", "ops", "--leader-election-id", "pdserve-b"))
    assert custom is not None and (custom.namespace, custom.name) == ("ops", "pdserve-b")


def test_flags_refuse_bad_timings_and_a_missing_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr("pdserve.operator.cli.default_namespace", lambda: None)
    with pytest.raises(SystemExit, match=r"--leader-election-namespace NS .* or --no-leader-elect"):
        election_config(parse("--leader-elect"))  # asked for: required
    with pytest.raises(SystemExit, match="must be greater than --renew-deadline"):
        election_config(parse("--leader-election-namespace", "x", "--lease-duration", "5"))


def test_outside_a_cluster_without_a_lease_namespace_one_replica_runs_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As controller-runtime's operators (leader election off by default) on a laptop."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr("pdserve.operator.cli.default_namespace", lambda: None)
    assert election_config(parse()) is None
    warning = capsys.readouterr().err
    assert "warning: no namespace for the leader-election Lease" in warning
    assert "running as a single replica without leader election" in warning
    assert "--leader-election-namespace NS" in warning


# --- the fence in front of every write -----------------------------------------------------------


def closed_port_kubeconfig(tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return str(path)


def test_writes_are_refused_before_sending_and_reads_are_not(tmp_path: Path) -> None:
    kube = Kube(closed_port_kubeconfig(tmp_path), fence=lambda: "not the leader (test)")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}}
    for call in (
        lambda: kube.create(pod),
        lambda: kube.apply(pod),
        lambda: kube.replace(pod),
        lambda: kube.merge_patch("Pod", "ns", "p", {}),
        lambda: kube.delete("Pod", "ns", "p"),
        lambda: kube.post_event({**pod, "metadata": {**pod["metadata"], "uid": "u"}}, "Normal", "R", "m"),
    ):
        with pytest.raises(NotLeader, match="refused, not the leader: not the leader \\(test\\)") as info:
            call()
        assert isinstance(info.value, KubeError) and info.value.status == 0
    # A read, or an access review (a POST that stores nothing), goes out (and fails to connect:
    # port 9 is closed); the fence does not stop it.
    with pytest.raises(KubeError) as review_error:
        kube.allowed("list", "nodes")
    assert not isinstance(review_error.value, NotLeader)
    with pytest.raises(KubeError) as read_error:
        kube.get("Pod", "ns", "p", timeout=2)
    assert not isinstance(read_error.value, NotLeader)
    kube.close()
