"""Multi-node instances as one unit: when a group of pods is forming, whole, or lost.

An instance that spans ``size`` nodes is a *group*: the leader pod (node 0, the instance's
name) and ``size - 1`` worker pods labelled with the leader's name. vLLM cannot lose a DP, TP
or PP member and go on, and a member started later does not rejoin a running group, so a group
is judged whole and replaced whole. Pure and level-based like the rollout planner: the verdict
depends only on what the pods show and the clock.

* **Forming**: the leader exists and workers are missing, and the workers were never created
  (the leader is not marked ``formed``). The workers need the leader's address, so they are
  created once the leader has a pod IP; the leader is then marked formed.
* **Broken**: a member failed or restarted (a restarted vLLM rank does not rejoin), was
  deleted, or is missing from a formed group; or the leader is gone while workers remain. The
  whole group is deleted at once without a drain (it cannot serve) and a new one replaces it.
* **Gang timeout**: a member that has not been Ready (or scheduled) for ``gang_timeout``
  seconds: pods of a group that cannot all be placed must not hold GPUs forever. The group is
  deleted and replaced; the status says which member waited for what.

For the rollout planner a group is one unit (pdserve.operator.cluster.views): Ready only when every
member is. Single-pod instances (``size`` 1) are never judged here, and a LeaderWorkerSet's
group (backend ``lws``) only by the gang timeout: its controller creates and restarts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

_LOST = "vLLM cannot lose a member of a group and go on"


@dataclass(frozen=True)
class Member:
    """One pod of a group, as the cluster shows it."""

    name: str
    node_rank: int  # 0: the leader
    ready: bool
    terminating: bool = False
    #: The pod failed or a container restarted: the vLLM rank it ran is gone from the group.
    failed: bool = False
    #: Since when (epoch seconds) the pod is not Ready (creation when it never was); None: Ready.
    unready_since: float | None = None
    unschedulable: bool = False
    ip: str | None = None


@dataclass(frozen=True)
class Group:
    leader: str  # the leader pod's name, the group's identity
    size: int  # pods the instance needs
    members: tuple[Member, ...]
    formed: bool = False  # the workers were created once (the leader's mark)
    #: A LeaderWorkerSet's group: its controller creates the members and restarts the group
    #: when one fails; only the gang timeout is the operator's to judge.
    managed: bool = False

    def member(self, node_rank: int) -> Member | None:
        return next((m for m in self.members if m.node_rank == node_rank), None)

    @property
    def missing(self) -> tuple[int, ...]:
        present = {m.node_rank for m in self.members}
        return tuple(r for r in range(self.size) if r not in present)

    @property
    def ready(self) -> bool:
        return not self.missing and all(m.ready and not m.terminating for m in self.members)


class Verdict(StrEnum):
    WHOLE = "whole"  # every member present (Ready or on its way)
    FORMING = "forming"  # workers to create
    BROKEN = "broken"  # delete the whole group now


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str = ""
    create: tuple[int, ...] = ()  # node ranks to create now (FORMING, leader has an IP)
    recheck_after: float | None = None  # when the gang timeout of a waiting member ends


def judge(group: Group, now: float, gang_timeout: float) -> Judgement:
    """What to do with one group now; see the module docstring."""
    if group.members and all(m.terminating for m in group.members):
        return Judgement(Verdict.WHOLE)  # going away as a whole already
    leader = group.member(0)
    if not group.managed and (leader is None or leader.terminating):
        return Judgement(Verdict.BROKEN, "leader gone")
    for m in () if group.managed else group.members:
        if m.failed:
            return Judgement(Verdict.BROKEN, f"pod {m.name} failed or restarted: {_LOST}")
        if m.terminating:
            return Judgement(Verdict.BROKEN, f"pod {m.name} is being deleted: {_LOST}")
    waits = [(now - m.unready_since, m) for m in group.members if m.unready_since is not None]
    late = [(waited, m) for waited, m in waits if waited >= gang_timeout]
    if late:
        waited, m = max(late, key=lambda w: w[0])
        what = "scheduled" if m.unschedulable else "Ready"
        return Judgement(
            Verdict.BROKEN,
            f"gang timeout: pod {m.name} not {what} after {waited:.0f}s "
            f"(multiNode.gangTimeoutSeconds {gang_timeout:g})",
        )
    recheck = min((gang_timeout - waited for waited, _ in waits), default=None)
    missing = group.missing
    if not missing or group.managed:
        return Judgement(Verdict.WHOLE, recheck_after=recheck)
    if group.formed:
        names = ", ".join(str(r) for r in missing)
        return Judgement(Verdict.BROKEN, f"node {names} of the group is gone: {_LOST}")
    create = missing if leader is not None and leader.ip else ()
    return Judgement(Verdict.FORMING, "workers wait for the leader's address", create, recheck)
