"""The progress bar on stderr: requests sent, done and failed, in flight, elapsed time.

Redrawn in place twice a second on a terminal; elsewhere (a log, CI) one line every 10 s, so a
long replay shows it is alive without flooding the log.
"""

from __future__ import annotations

import asyncio
import time
from typing import TextIO

from pdserve.loadgen.client import Counts

BAR_WIDTH = 24


def progress_line(counts: Counts, elapsed_s: float, expected_s: float | None) -> str:
    finished = counts.done + counts.failed
    share = finished / counts.total if counts.total else 1.0
    filled = round(BAR_WIDTH * share)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    minutes, seconds = divmod(int(elapsed_s), 60)
    schedule = ""
    if expected_s is not None:
        m, s = divmod(int(expected_s), 60)
        schedule = f" of {m}:{s:02d} scheduled"
    return (
        f"[{bar}] {finished}/{counts.total} | sent {counts.sent} done {counts.done} failed {counts.failed} "
        f"| in flight {counts.in_flight} | {minutes}:{seconds:02d}{schedule}"
    )


async def show_progress(
    counts: Counts, stream: TextIO, start: float, expected_s: float | None, tty: bool | None = None
) -> None:
    """Until cancelled; the caller prints the final line with :func:`finish`."""
    tty = stream.isatty() if tty is None else tty
    every = 0.5 if tty else 10.0
    while True:
        await asyncio.sleep(every)
        line = progress_line(counts, time.perf_counter() - start, expected_s)
        stream.write(f"\r\x1b[K{line}" if tty else line + "\n")
        stream.flush()


def finish(counts: Counts, stream: TextIO, start: float, expected_s: float | None) -> None:
    line = progress_line(counts, time.perf_counter() - start, expected_s)
    stream.write(f"\r\x1b[K{line}\n" if stream.isatty() else line + "\n")
    stream.flush()
