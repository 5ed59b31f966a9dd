"""How many CPUs this process may use: the default of ``pdserve proxy --workers``.

``os.cpu_count()`` is the node's count, not the container's. A container is bounded twice: by
its CPU affinity (cpusets, ``taskset``) and by its CFS quota (cgroup v2 ``cpu.max``, what a
Kubernetes CPU limit becomes). The smaller of the two, rounded up, at least 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(cpu_max: str) -> float | None:
    """CPUs of a cgroup v2 ``cpu.max`` line (``"200000 100000"`` is 2.0); None for ``max``."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


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


def available_cpus() -> int:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    cpu_max = cgroup_cpu_max()
    quota = quota_cpus(cpu_max) if cpu_max is not None else None
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.ceil(quota)))
