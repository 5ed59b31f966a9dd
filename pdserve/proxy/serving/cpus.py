"""How many CPUs this process may use: the default of ``pdserve proxy --workers``.

``os.cpu_count()`` is the node's count, not the container's. A container is bounded twice: by
its CPU affinity (cpusets, ``taskset``) and by its CFS quota (what a Kubernetes CPU limit
becomes: ``cpu.max`` on cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` on nodes still
on cgroup v1). The smaller of the two, rounded up, at least 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(cpu_max: str) -> float | None:
    """CPUs of a cgroup v2 ``cpu.max`` line (``"200000 100000"`` is 2.0); None for ``max``."""
    parts = cpu_max.split()
    return v1_quota_cpus(parts[0], parts[1]) if len(parts) == 2 else None


def cgroup_cpu_max(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> str | None:
    """This process's cgroup v2 ``cpu.max`` (its own cgroup's, else the root's); None if absent."""
    candidates = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                candidates.append(root / line[3:].lstrip("/") / "cpu.max")
    except OSError:
        pass
    candidates.append(root / "cpu.max")
    for path in candidates:
        try:
            return path.read_text()
        except OSError:
            continue
    return None


def v1_quota_cpus(quota_us: str, period_us: str) -> float | None:
    """CPUs of a CFS quota and period (``200000`` per ``100000`` is 2.0), as cgroup v1 keeps them
    in two files and v2 in one line; None when there is no quota (``-1``, ``max``)."""
    try:
        quota, period = int(quota_us), int(period_us)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_v1_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """This process's cgroup v1 CFS quota in CPUs (its own cgroup's, else the mount's); None if
    there is no quota or no v1 ``cpu`` controller."""
    path = None
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, cgroup = line.split(":", 2)
            if "cpu" in controllers.split(","):
                path = cgroup.lstrip("/")
    except (OSError, ValueError):
        return None
    if path is None:
        return None
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for directory in (root / mount / path, root / mount):
            try:
                quota = (directory / "cpu.cfs_quota_us").read_text()
                period = (directory / "cpu.cfs_period_us").read_text()
            except OSError:
                continue
            return v1_quota_cpus(quota, period)
    return None


def available_cpus() -> int:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    cpu_max = cgroup_cpu_max()
    quota = quota_cpus(cpu_max) if cpu_max is not None else cgroup_v1_quota()
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.ceil(quota)))
