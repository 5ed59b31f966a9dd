"""The routing-file source: watch a file and offer each new content to the served table.

The file is usually a mounted ConfigMap: the kubelet writes a new ``..<timestamp>`` directory
and atomically repoints the ``..data`` symlink, so the watched path keeps its name while the
file behind it changes. We therefore poll the *resolved* target (real path, inode, mtime,
size) rather than waiting for events on the path itself; this also catches a plainly
rewritten file. Parsing, validation and the swap are :class:`pdserve.proxy.table.served.ServedTable`'s,
shared with the ConfigMap watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from pdserve.proxy.table.served import RoutingState, ServedTable, parse_state
from pdserve.routing import RoutingTableError

__all__ = ["RoutingState", "RoutingWatcher", "file_signature"]

log = logging.getLogger("pdserve.proxy.reload")

FileSignature = tuple[str, int, int, int, int]


def file_signature(path: Path) -> FileSignature:
    """What identifies the file's current content without reading it (all -1 when absent)."""
    try:
        st = os.stat(path)  # follows the ..data symlink chain
    except OSError:
        return (os.path.realpath(path), -1, -1, -1, -1)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class RoutingWatcher:
    def __init__(self, path: Path, served: ServedTable, interval: float = 0.2) -> None:
        self.path = path
        self.served = served
        self.interval = interval
        self._seen: FileSignature | None = None
        self._suspect: FileSignature | None = None

    def poll(self, confirm_errors: bool = True) -> bool:
        """Load the file if it changed; True when a new table is now served.

        With ``confirm_errors`` a bad file must look the same on two polls in a row before it
        counts as an error, so a writer caught half-way through a plain rewrite is not one.
        """
        signature = file_signature(self.path)
        if signature == self._seen:
            return False
        try:
            state = parse_state(self.path.read_bytes(), self.served.build)
        except (OSError, RoutingTableError, ValueError) as exc:
            if confirm_errors and self._suspect != signature:
                self._suspect = signature  # look again next poll before calling it an error
                return False
            self._seen = signature
            self.served.reject(f"routing file {self.path}", str(exc))
            return False
        self._seen = signature
        self._suspect = None
        return self.served.swap(state)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.poll()
            except Exception:  # the watcher must outlive any surprise; the last good table stays
                log.exception("routing file watcher failed; retrying")
