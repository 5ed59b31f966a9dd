"""A loopback TCP forwarder that a test can cut: the API server "goes away" for one client
(the shared API server itself keeps running) and comes back on the same port.

TLS passes through untouched (the API server's certificate names 127.0.0.1, whatever the port).
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Forwarder:
    def __init__(self, target_port: int, port: int = 0, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = port
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.accepted = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> Forwarder:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._stop.clear()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def close(self) -> None:
        """Stop listening and cut every forwarded connection at once (both directions)."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                if self._stop.is_set():
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
