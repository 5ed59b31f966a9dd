"""A CPU limit for a process tree under benchmark, as a pod's ``resources.limits.cpu`` sets one: a
cgroup with a CFS quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``).

Both routers size themselves to it: ``pdserve proxy`` starts one worker per CPU of the quota
(pdserve/proxy/serving/cpus.py), vllm-router one tokio worker thread per CPU (Rust reads the quota too).
Creating a cgroup needs root and a writable cgroup filesystem; without them :func:`create` says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuLimitUnavailable(RuntimeError):
    """No cgroup with a CPU quota can be made here."""


@dataclass(frozen=True)
class CpuLimit:
    cpus: float
    directory: Path

    def enter(self) -> None:
        """Move the calling process into the cgroup: run in the child before exec (preexec_fn), so
        the process starts with its limit and sizes itself by it."""
        (self.directory / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Kill what is left in the cgroup (a process its parent's stop did not end), then remove it."""
        procs = self.directory / "cgroup.procs"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                left = [int(pid) for pid in procs.read_text().split()]
            except OSError:
                return
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            self.directory.rmdir()


def create(cpus: float, name: str, root: Path = CGROUP_ROOT) -> CpuLimit:
    """A new cgroup limited to ``cpus`` CPUs; v2 when the unified hierarchy has a cpu controller,
    else the v1 cpu controller."""
    quota = max(1000, round(cpus * PERIOD_US))
    controllers = root / "cgroup.controllers"  # the unified (v2) hierarchy's
    try:
        if controllers.exists() and "cpu" in controllers.read_text().split():
            (root / "cgroup.subtree_control").write_text("+cpu")
            directory = root / name
            directory.mkdir(exist_ok=True)
            (directory / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            return CpuLimit(cpus, directory)
        v1 = next((root / m for m in ("cpu", "cpu,cpuacct") if (root / m / "cgroup.procs").exists()), None)
        if v1 is None:
            raise CpuLimitUnavailable(f"no cgroup cpu controller under {root} (v2 or v1)")
        directory = v1 / name
        directory.mkdir(exist_ok=True)
        (directory / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (directory / "cpu.cfs_quota_us").write_text(str(quota))
        return CpuLimit(cpus, directory)
    except OSError as exc:
        raise CpuLimitUnavailable(
            f"cannot make a cgroup with a CPU quota under {root} ({exc}); run as root on a writable "
            "cgroup filesystem, or without --router-cpus"
        ) from exc
