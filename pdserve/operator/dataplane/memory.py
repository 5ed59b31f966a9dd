"""A part of the reconcile pass that calls the API server and remembers something of each
PDDeployment between passes (the autoscaler's decisions, the routers' answers): made on first
use, dropped when the deployment is gone.

The memory is the process's own: a new leader, or a restarted operator, starts empty, so each
part must be safe to start from nothing (it asks again, or waits a whole window).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from pdserve.operator.cluster.kube import Kube

Key = tuple[str, str]  # (namespace, PDDeployment name)
S = TypeVar("S")


class PerDeployment(Generic[S]):
    """Calls through ``kube``; one ``S`` per PDDeployment."""

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._states: dict[Key, S] = {}

    def forget(self, key: Key) -> None:
        """The deployment is gone (or no longer needs this part): drop what is kept of it."""
        if self._states.pop(key, None) is not None:
            self._forgotten(key)

    def _forgotten(self, key: Key) -> None:
        """After ``key``'s memory was dropped: what else goes with it (metrics' series)."""

    def _state(self, key: Key, new: Callable[[], S]) -> S:
        """The deployment's memory, made by ``new`` on first use."""
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = new()
        return state

    def _known(self, key: Key) -> S | None:
        """The deployment's memory, None before its first use."""
        return self._states.get(key)
