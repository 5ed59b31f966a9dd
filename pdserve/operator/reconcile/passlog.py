"""What one reconcile pass did and when, kept only when the operator traces (tracing.py).

Pure bookkeeping: the reconciler times its steps into a :class:`PassRecord` and notes the
deployment's rollout state; the tracer turns the record into spans once the pass is over, with
the times recorded here, so no span or context is open while the pass runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    name: str
    start_ns: int
    end_ns: int


@dataclass
class PassRecord:
    """One pass of one PDDeployment: its steps, and what its status said at the end."""

    namespace: str
    name: str
    full: bool
    started_ns: int = field(default_factory=time.time_ns)
    steps: list[Step] = field(default_factory=list)
    uid: str = ""
    generation: int = 0
    #: The Progressing condition the pass left: True while a rollout runs, with its reason and
    #: since when (lastTransitionTime); None when the pass wrote no status (gone, error).
    progressing: bool | None = None
    progress_reason: str = ""
    progressing_since: str = ""

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.time_ns()
        try:
            yield
        finally:
            self.steps.append(Step(name, started, time.time_ns()))

    def add(self, name: str, started_ns: int) -> None:
        """A step that started at ``started_ns`` and ends now (its calls went out in parts)."""
        self.steps.append(Step(name, started_ns, time.time_ns()))
