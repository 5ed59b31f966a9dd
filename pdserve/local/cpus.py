"""How `pdserve up --engine vllm` spreads this machine's CPU cores over engines on a CPU-only host.

Why: vLLM on CPU binds one OpenMP thread group per worker (``VLLM_CPU_OMP_THREADS_BIND``,
one ``|``-separated core list per DP x TP rank), and NIXL's progress thread busy-spins a core
of the prefill even at idle. Left alone, every engine binds from core 0: a decode rank that
shares a core with that thread starved for minutes at start-up on 2 cores. So:

* decode engines take the lowest cores, prefill engines the highest, split in proportion
  to their workers (at least one core each side when there are two or more), so a prefill's
  NIXL thread never shares a core with a decode rank;
* within a role, each worker gets its own block of cores when there are enough, else workers
  take the role's cores in turn;
* each engine's process affinity is the union of its workers' cores, so its other threads
  (API server, NIXL) stay there too.

Pure: the runner applies the affinity, the plan sets the environment variable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.routing import Role


@dataclass(frozen=True)
class Cores:
    """One engine's share: the cores of each worker (DP rank major, TP rank minor)."""

    workers: tuple[tuple[int, ...], ...]

    @property
    def affinity(self) -> tuple[int, ...]:
        return tuple(sorted({c for worker in self.workers for c in worker}))

    @property
    def omp_bind(self) -> str:
        """The value of ``VLLM_CPU_OMP_THREADS_BIND`` (``0|1``, ``0-3|4-7``, ...)."""
        return "|".join(_ranges(worker) for worker in self.workers)


def assign_cores(cores: Sequence[int], engines: Sequence[tuple[Role, int]]) -> list[Cores]:
    """One :class:`Cores` per engine of ``engines`` ((role, workers), in order) over ``cores``."""
    if not cores:
        raise ValueError("no CPU cores to assign")
    ordered = sorted(set(cores))
    prefill = sum(w for r, w in engines if r is Role.PREFILL)
    decode = sum(w for r, w in engines if r is Role.DECODE)
    decode_cores, prefill_cores = _split(ordered, decode, prefill)
    pools = {
        Role.DECODE: iter(_spread(decode_cores, decode)),
        Role.PREFILL: iter(_spread(prefill_cores, prefill)),
    }
    return [Cores(tuple(next(pools[role]) for _ in range(workers))) for role, workers in engines]


def _split(cores: list[int], decode: int, prefill: int) -> tuple[list[int], list[int]]:
    """(decode's cores, prefill's cores): low ones to the decode, disjoint whenever there are two."""
    if not prefill or not decode or len(cores) == 1:
        return cores, cores
    total = len(cores)
    share = round(total * prefill / (prefill + decode))
    if total >= prefill + decode:
        share = min(max(share, prefill), total - decode)
    share = min(max(share, 1), total - 1)
    return cores[: total - share], cores[total - share :]


def _spread(cores: list[int], workers: int) -> list[tuple[int, ...]]:
    """``workers`` core lists over ``cores``: contiguous blocks when enough, else one core each in turn."""
    if workers <= 0:
        return []
    if len(cores) < workers:
        return [(cores[i % len(cores)],) for i in range(workers)]
    size, extra = divmod(len(cores), workers)
    out, start = [], 0
    for i in range(workers):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(cores[start:end]))
        start = end
    return out


def _ranges(cores: Sequence[int]) -> str:
    """``0,1,2,5`` as ``0-2,5`` (vLLM parses both)."""
    parts: list[str] = []
    run: list[int] = []
    for core in sorted(cores):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [core]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)
