"""Scheduler-to-worker lookups: each worker rank answers "how much of this prefix can you load now"
over a Unix socket. One JSON object per line each way (no pickle); see ``README.md`` for why the
workers, not the scheduler, own the answer."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("tierstore_vllm")

#: Longest request line a worker accepts (a 128k-token prompt as JSON is about 1 MB).
MAX_LINE = 16 << 20

Answer = Callable[[dict[str, Any]], dict[str, Any]]


class LookupServer:
    """Serves ``answer(request) -> reply`` on the Unix socket ``path`` from a daemon thread per client."""

    def __init__(self, path: str, answer: Answer):
        self.path = path
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a dead worker with the same engine id
        handler = _handler(answer)
        self._server = socketserver.ThreadingUnixStreamServer(path, handler)
        self._server.daemon_threads = True
        os.chmod(path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierstore-vllm-lookup",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _handler(answer: Answer) -> type[socketserver.StreamRequestHandler]:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while True:
                line = self.rfile.readline(MAX_LINE + 1)
                if not line:
                    return
                try:
                    if len(line) > MAX_LINE:
                        raise ValueError(f"request line over {MAX_LINE} bytes")
                    reply = answer(json.loads(line))
                except Exception as exc:  # the scheduler gets the error as data, the worker keeps serving
                    log.warning("tierstore lookup failed: %r", exc)
                    reply = {"error": repr(exc)}
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()

    return Handler


class LookupClient:
    """The scheduler's connections to every worker rank; :meth:`ask` sends one request to all ranks at
    once and returns their replies in rank order. Thread-safe (callers take turns)."""

    def __init__(self, paths: Sequence[str], timeout: float = 30.0):
        self.paths = list(paths)
        self.timeout = timeout
        self._socks: list[socket.socket | None] = [None] * len(self.paths)
        self._files: list[Any] = [None] * len(self.paths)
        self._lock = threading.Lock()

    def _connect(self, i: int) -> None:
        if self._socks[i] is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect(self.paths[i])
            except OSError:
                s.close()
                raise
            self._socks[i], self._files[i] = s, s.makefile("rb")

    def ask(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Replies of every rank; raises ``OSError``/``ValueError`` if a rank cannot be reached or answers
        garbage (the connection is dropped and reopened on the next call)."""
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            return self._ask(line)

    def _ask(self, line: bytes) -> list[dict[str, Any]]:
        try:
            for i in range(len(self.paths)):
                self._connect(i)
                self._socks[i].sendall(line)  # type: ignore[union-attr]
            replies = []
            for i in range(len(self.paths)):
                raw = self._files[i].readline(MAX_LINE + 1)
                if not raw:
                    raise ConnectionError(f"worker lookup socket {self.paths[i]} closed")
                replies.append(json.loads(raw))
            return replies
        except (OSError, ValueError):
            self._close()
            raise

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for i, s in enumerate(self._socks):
            if s is not None:
                self._files[i].close()
                s.close()
            self._socks[i] = self._files[i] = None
