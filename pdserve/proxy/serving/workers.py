"""``pdserve proxy --workers N``: N worker processes serve one router.

One event loop uses one core; the router's CPU per request is what bounds its throughput, so
the proxy runs one worker process per CPU available to it (pdserve.proxy.serving.cpus). What keeps N
processes one router:

* **One port.** Each worker accepts on a listening socket of its own, all bound to the same
  address with SO_REUSEPORT: the kernel spreads new connections over them (a shared socket
  would wake every worker per connection and favour whichever is fastest to accept). The
  supervisor binds them before forking, so a port in use fails the start once, with status 2.
* **One counter per role.** The policy's counters live in shared memory
  (pdserve.proxy.state.shared): flat-interleaved stays exact for the router as a whole. So do the
  cool-downs (a slot ejected, an instance unreachable: for every worker at once, counted once)
  and the client request ids in flight (engine ids stay unique router-wide).
* **One table.** Every worker watches the same source (the file, or the ConfigMap through the
  API server) and swaps on its own; the window between the first and the last worker's swap
  is one reload at most (file: one poll interval, 0.2 s by default; ConfigMap: the watch event
  reaches every worker at once). ``/routing/served`` lists each worker's generation and
  ``loaded_at`` under ``workers`` and reports the oldest generation, so nobody acts on a table
  before every worker serves it.
* **One prefix index.** With the prefix-affinity prefill policy every worker holds the whole
  index of what was sent where: each publishes its own sends in shared memory and reads the
  others' before choosing (pdserve.proxy.state.prefix_log).
* **One view.** Metrics use Prometheus's multiprocess mode (files in a private run directory);
  ``/routing/served`` and ``/debug/routing`` are merged from every worker's view (fanin.py).
* **Even shares.** The kernel's hash can give one worker most of a few long-lived connections
  (a gateway's pool); a worker holding more than its share of the open connections closes one
  after its response (uvicorn), and the client's reconnection is spread again
  (pdserve.proxy.state.shared.SharedConnections).
* **One life.** The supervisor forwards SIGTERM/SIGINT to the workers (each drains its own
  requests for the grace period) and exits when they have; a worker that dies otherwise is
  started again on the same socket, so its share of the connections is served again.

The per-slot limit of the back-pressure (``--max-per-slot``) is the router's: the legs in flight
per slot are counted in shared memory too (each worker in a region of its own, summed on read).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pdserve.proxy.policies import PrefixAffinity
from pdserve.proxy.serving.worker_views import WorkerInfo
from pdserve.proxy.settings import ProxySettings
from pdserve.proxy.state.shared import SharedState

log = logging.getLogger("pdserve.proxy.workers")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # pdserve.proxy.metrics reads it (not imported here)
RESTART_DELAY_S = 1.0
#: Each worker's ring of prefix-index records (8 MB): several seconds of prompts at thousands of
#: requests a second, far more than one worker runs ahead of another.
PREFIX_LOG_WORDS = 1 << 20

#: What each worker runs once forked (pdserve.proxy.cli.serve_process): its imports happen there,
#: after PROMETHEUS_MULTIPROC_DIR is set.
ServeProcess = Callable[[ProxySettings, Sequence[socket.socket], WorkerInfo | None], None]


def memory_dir() -> str | None:
    """Where the run directory goes: /dev/shm when writable (a tmpfs in every container and pod),
    so the metrics files the workers write on every request are memory, never written back to a
    disk; else the system's temporary directory."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _worker_main(
    serve: ServeProcess,
    settings: ProxySettings,
    sockets: list[list[socket.socket]],
    worker: WorkerInfo,
) -> None:
    index, shared = worker.index, worker.shared
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server installs its own on its loop
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    for i, own in enumerate(sockets):
        if i != index:
            for sock in own:
                sock.close()  # a sibling's socket: a dead sibling's must not stay open here
    shared.in_flight.bind(index)  # a restarted worker's region starts from 0
    shared.connections.bind(index)
    if shared.prefix_log is not None:
        shared.prefix_log.bind(index)
    # From here this process's id never changes: its metric values need not ask the kernel for
    # it on every update (prometheus_client's multiprocess values check for a fork each time).
    from prometheus_client import values

    pid = os.getpid()
    values.ValueClass = values.MultiProcessValue(lambda: pid)  # type: ignore[no-untyped-call]
    serve(settings, sockets[index], worker)


def run_workers(settings: ProxySettings, serve: ServeProcess) -> int:
    """Serve with ``settings.server.workers`` processes until SIGTERM/SIGINT; the exit status."""
    count = settings.server.workers
    rundir = Path(tempfile.mkdtemp(prefix="pdserve-proxy-", dir=memory_dir()))
    metrics_dir = rundir / "metrics"
    metrics_dir.mkdir()
    os.environ[MULTIPROC_ENV] = str(metrics_dir)  # before prometheus_client is imported
    from prometheus_client import multiprocess

    from pdserve.proxy.serving.server import binds, listen

    context = multiprocessing.get_context("fork")
    log_words = PREFIX_LOG_WORDS if settings.prefill_policy == PrefixAffinity.name else 0
    shared = SharedState(context.Lock(), count, prefix_log_words=log_words)
    try:
        sockets = [
            [listen(h, p, settings.listen.backlog, reuse_port=True) for h, p in binds(settings)]
            for _ in range(count)
        ]
    except OSError as exc:
        shutil.rmtree(rundir, ignore_errors=True)
        log.error("cannot listen: %s", exc)
        return 2
    procs: dict[int, Any] = {}
    stopping = {"signals": 0}

    def start(index: int) -> None:
        proc = context.Process(
            target=_worker_main,
            args=(serve, settings, sockets, WorkerInfo(index, count, rundir, shared)),
            name=f"pdserve-proxy-worker-{index}",
            daemon=False,
        )
        proc.start()
        procs[index] = proc

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping["signals"] += 1
        shared.set_stopping()
        if stopping["signals"] == 1:
            log.info("%s: stopping %d workers", signal.Signals(signum).name, count)
            # The workers stop accepting on their copies; these must not keep queueing connections.
            for own in sockets:
                for sock in own:
                    sock.close()
        for proc in procs.values():
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log.info(
        "pdserve proxy: %d workers on %s:%d (SO_REUSEPORT)", count, settings.listen.host, settings.listen.port
    )
    for index in range(count):
        start(index)
    status = 0
    try:
        while procs:
            sentinels = {proc.sentinel: index for index, proc in procs.items()}
            ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            for sentinel in ready:
                index = sentinels[sentinel]  # type: ignore[index]
                proc = procs.pop(index)
                proc.join()
                multiprocess.mark_process_dead(proc.pid, str(metrics_dir))  # type: ignore[no-untyped-call]
                if stopping["signals"]:
                    continue
                log.error(
                    "worker %d (pid %s) exited with %s; starting it again", index, proc.pid, proc.exitcode
                )
                status = 1
                time.sleep(RESTART_DELAY_S)
                if not stopping["signals"]:
                    start(index)
    finally:
        for own in sockets:
            for sock in own:
                sock.close()
        shutil.rmtree(rundir, ignore_errors=True)
    log.info("pdserve proxy stopped (%d workers)", count)
    return 0 if stopping["signals"] else status
