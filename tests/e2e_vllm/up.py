"""`pdserve up --engine vllm` as a user runs it, watched from outside: its output, its processes.

Every process of its tree is sampled while it runs (psutil, once a second), so the final check
can tell whether any of them outlived the stop, orphans included.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.e2e_vllm.common import MANIFEST, REPO, check, engine_env, request, say
from tests.support.procs import free_port


@dataclass
class Up:
    log_dir: Path
    manifest: Path = MANIFEST
    #: More `pdserve up` flags (the collector's --otlp-traces-endpoint) and environment.
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "pdserve.cli", "up", str(self.manifest), "--engine", "vllm"]
        argv += ["--port", str(self.port), "--no-view", "--log-dir", str(self.log_dir), *self.extra_args]
        shown = " ".join(["--engine", "vllm", *self.extra_args])
        say(f"starting: pdserve up {self.manifest.relative_to(REPO)} {shown} (logs in {self.log_dir})")
        env = {**engine_env(), **self.extra_env}
        self.popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._relay, daemon=True).start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _relay(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            print(f"    | {line.rstrip()}", flush=True)

    def _sample(self) -> None:
        assert self.popen is not None
        root = psutil.Process(self.popen.pid)
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                for proc in root.children(recursive=True):
                    self.seen.setdefault(proc.pid, proc)
            time.sleep(1.0)

    def table(self) -> dict[str, Any]:
        return dict(json.loads((self.log_dir / "routing.json").read_text()))

    def engine(self, role: str, index: int = 0) -> dict[str, Any]:
        return dict(self.table()[role][index])

    def wait_serving(self, timeout: float = 900.0) -> float:
        """Seconds until the router is ready with every instance routable (progress every 15 s)."""
        assert self.popen is not None
        start = time.monotonic()
        last = start
        while True:
            check(self.popen.poll() is None, f"pdserve up exited with {self.popen.returncode}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                ready = request("GET", self.url + "/ready", timeout=5).status == 200
                instances = [*self.table()["prefill"], *self.table()["decode"]]
                if ready and all(i["ready"] and not i.get("draining") for i in instances):
                    return time.monotonic() - start
            now = time.monotonic()
            check(now - start < timeout, f"not serving after {timeout:.0f} s")
            if now - last >= 15:
                last = now
                with contextlib.suppress(OSError, ValueError, KeyError):
                    states = ", ".join(
                        f"{i['name']} {'ready' if i['ready'] else 'starting'}"
                        for i in [*self.table()["prefill"], *self.table()["decode"]]
                    )
                    say(f"waiting for the engines ({now - start:.0f} s): {states}")
            time.sleep(0.5)

    def processes(self) -> list[psutil.Process]:
        """Every process of the run seen so far that still lives (zombies are dead)."""
        alive = []
        for proc in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        return alive

    def engine_processes(self, port: int) -> list[psutil.Process]:
        """The main process of the engine serving ``port`` and all its descendants."""
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                cmdline = proc.cmdline()
                if (
                    "serve" in cmdline
                    and "--port" in cmdline
                    and cmdline[cmdline.index("--port") + 1] == str(port)
                ) and proc.ppid() == (self.popen.pid if self.popen else -1):
                    return [proc, *proc.children(recursive=True)]
        raise AssertionError(f"no engine process serves port {port}")

    def memory_gb(self, procs: list[psutil.Process]) -> float:
        """Proportional set size of ``procs`` (shared pages split between them), in GB."""
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_full_info().pss
        return total / 1e9

    def stop(self) -> float:
        """Ctrl-C, as a user would; seconds until it exited. Checks the exit code and that no
        process of the run is left."""
        assert self.popen is not None
        start = time.monotonic()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(90)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                raise AssertionError("pdserve up did not exit within 90 s of SIGINT") from None
        seconds = time.monotonic() - start
        self._stop.set()
        _, alive = psutil.wait_procs(self.processes(), timeout=15)
        check(self.popen.returncode == 0, f"pdserve up exited with {self.popen.returncode}")
        check(not alive, f"left running after the stop: {[(p.pid, _name(p)) for p in alive]}")
        return seconds

    def kill(self) -> None:
        """Last resort (a failed run): SIGKILL everything seen."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(60)
        self._stop.set()
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()


def _name(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(proc.cmdline())[:120]
    return "?"
