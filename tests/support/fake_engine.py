"""A stand-in for `vllm serve` that serves from child processes, as vLLM does.

The main process forks an "API server" that binds ``--port`` and answers ``GET /health`` with
its own pid, and an "engine core" that leaves the session (setsid) and only sleeps. The main
process itself only sleeps: killed, it leaves both children running, exactly what a SIGKILLed
`vllm serve` does. Used by tests/integration/test_local.py; no vLLM needed.

    python -m tests.support.fake_engine --port 8000 [--marker TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"pid": os.getpid()}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def api_server(port: int) -> None:
    try:
        server = HTTPServer(("127.0.0.1", port), Health)
    except OSError as exc:
        print(f"fake engine api server {os.getpid()}: cannot bind port {port}: {exc}", flush=True)
        os._exit(1)
    print(f"fake engine api server {os.getpid()} listening on {port}", flush=True)
    server.serve_forever()


def engine_core() -> None:
    os.setsid()  # out of the engine's session, as a process may do
    print(f"fake engine core {os.getpid()} in its own session", flush=True)
    while True:
        time.sleep(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--marker", default="")
    args, _ = parser.parse_known_args()
    sys.stdout.flush()
    if os.fork() == 0:
        api_server(args.port)
    if os.fork() == 0:
        engine_core()
    print(f"fake engine main {os.getpid()} started its children", flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
