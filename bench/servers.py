"""Processes and I/O of the proxy benchmark (bench/proxy_bench.py): starting servers, running
the load client while sampling RSS, measuring CPU, and py-spy flame graphs."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cpulimit import CpuLimit

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    port: int
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        """CPU time of the server and its children: the cost per request on a shared machine."""
        import psutil

        try:
            proc = psutil.Process(self.popen.pid)
            total = 0.0
            for p in [proc, *proc.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
            return total
        except psutil.Error:
            return 0.0

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children (the workers)."""
        import psutil

        try:
            proc = psutil.Process(self.popen.pid)
            return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
        except psutil.Error:
            return 0

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start(
    name: str,
    argv: Sequence[str],
    port: int,
    ready_path: str,
    logs: Path,
    timeout: float = 60,
    limit: CpuLimit | None = None,
    tree: Path = REPO,
) -> Server:
    """Start a server and wait until ``ready_path`` answers 200; ``limit``: inside that CPU limit;
    ``tree``: the checkout whose ``pdserve`` a ``python -m`` command runs (its working directory
    and first on PYTHONPATH)."""
    log_path = logs / f"{name}.log"
    env = None
    if tree != REPO:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    with log_path.open("wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tree,
            env=env,
            preexec_fn=limit.enter if limit is not None else None,  # the bench runs no threads
        )
    server = Server(name, port, popen, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {popen.returncode}:\n{log_path.read_text(errors='replace')}"
            )
        try:
            with urllib.request.urlopen(server.url + ready_path, timeout=2) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(
        f"{name} not ready at {ready_path} within {timeout}s:\n{log_path.read_text(errors='replace')}"
    )


def http_json(url: str, method: str = "GET") -> Any:
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def run_load(
    url: str,
    mode: str,
    requests: int,
    concurrency: int,
    tokens: int,
    timeout_s: float,
    stream: bool = True,
    sample: Server | None = None,
) -> dict[str, Any]:
    """The load client's result; with ``sample``, also that server's peak RSS during the load."""
    spec = {
        "url": url,
        "mode": mode,
        "requests": requests,
        "concurrency": concurrency,
        "tokens": tokens,
        "timeout_s": timeout_s,
        "stream": stream,
    }
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "bench.load_client", json.dumps(spec)], cwd=REPO, stdout=out, stderr=err
        )
        peak = 0
        deadline = time.monotonic() + timeout_s + 60
        while popen.poll() is None:
            if time.monotonic() > deadline:
                popen.kill()
                popen.wait()
                raise subprocess.TimeoutExpired(popen.args, timeout_s + 60)
            if sample is not None:
                peak = max(peak, sample.rss_bytes())
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        if popen.returncode != 0:
            raise RuntimeError(f"load client failed ({popen.returncode}): {err.read()[-2000:]!r}")
        result: dict[str, Any] = json.loads(out.read())
    if sample is not None:
        result["rss_peak_bytes"] = peak
    return result


def http_post_json(url: str, body: object) -> None:
    request = urllib.request.Request(
        url, method="POST", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        resp.read()


def pyspy_path() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


def scrub_paths(svg: Path) -> None:
    """No path of the machine that ran the bench in a committed flame graph (py-spy writes the
    command lines, with the interpreter's and the temporary routing file's paths)."""
    text = svg.read_text()
    text = text.replace(str(REPO) + "/", "").replace(str(Path(sys.executable).parent) + "/", "")
    text = re.sub(r"/[^\s\"'<>()]*?/(pdserve-bench-[^/\s\"'<>()]+)/", r"\1/", text)
    text = re.sub(r"(/[\w.+-]+)+/(python[\d.]*|py-spy)\b", r"\2", text)
    svg.write_text(text)


def profile(proxy: Server, args: argparse.Namespace, out: Path) -> str:
    """A py-spy flame graph of the proxy and its workers under the stream-c64 load (not measured:
    sampling costs the proxy some CPU); a note saying what was written or why not."""
    pyspy = pyspy_path()
    if pyspy is None:
        return "py-spy not installed (pip install py-spy): no flame graph"
    argv = [pyspy, "record", "--pid", str(proxy.popen.pid), "--subprocesses", "--nonblocking"]
    argv += ["--rate", "250", "--duration", str(args.profile_seconds), "--format", "flamegraph"]
    with tempfile.TemporaryFile() as err:
        recorder = subprocess.Popen([*argv, "--output", str(out)], stdout=subprocess.DEVNULL, stderr=err)
        time.sleep(1.0)
        started = time.monotonic()
        while time.monotonic() - started < args.profile_seconds - 2 and recorder.poll() is None:
            run_load(proxy.url, "stream", 1000, 64, args.tokens, 60)
        recorder.wait(args.profile_seconds + 30)
        err.seek(0)
        if recorder.returncode != 0 or not out.exists():
            return f"py-spy failed ({recorder.returncode}): {err.read()[-300:]!r}"
    scrub_paths(out)
    return f"flame graph of {proxy.name} under stream-c64 load: bench/results/{out.name}"
