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
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tierstore.errors import ConfigError

log = logging.getLogger("tierstore_vllm")

#: Longest request line a worker accepts (a 128k-token prompt as JSON is about 1 MB).
MAX_LINE = 16 << 20

Answer = Callable[[dict[str, Any]], dict[str, Any]]


class LookupServer:
    """Serves ``answer(request) -> reply`` on the Unix socket ``path`` from a daemon thread per client.

    Only processes of this user are answered (``SO_PEERCRED``); a live server already on ``path`` (another
    engine with the same ``engine_id``) is an error, a stale socket of a dead one is replaced; a request
    line over :data:`MAX_LINE` is answered with an error and skipped (the connection stays in step); after
    :meth:`close` nothing is answered, on open connections either.
    """

    def __init__(self, path: str, answer: Answer):
        self.path = path
        self.closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        if os.path.exists(path):
            if _answers(path):
                raise ConfigError(f"another live process serves the lookup socket {path}: two vLLM engines with "
                                  "one kv_transfer_config.engine_id would answer each other's schedulers; give "
                                  "each engine its own engine_id")
            os.unlink(path)  # a stale socket of a dead worker with the same engine id
        self._server = socketserver.ThreadingUnixStreamServer(path, _handler(answer, self))
        self._server.daemon_threads = True
        os.chmod(path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierstore-vllm-lookup",
                                        daemon=True)
        self._thread.start()

    def _admit(self, conn: socket.socket) -> bool:
        """Register an accepted connection (``False``: closed meanwhile, do not serve it)."""
        with self._lock:
            if not self.closed:
                self._conns.add(conn)
            return not self.closed

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns = list(self._conns)
        self._server.shutdown()
        self._server.server_close()
        for conn in conns:  # their handlers see the end of the stream and stop
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _answers(path: str) -> bool:
    """Whether a live process accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _handler(answer: Answer, server: LookupServer) -> type[socketserver.StreamRequestHandler]:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            uid = peer_uid(self.connection)
            if uid != os.getuid():
                log.warning("tierstore lookup: refused a connection from uid %d (serving uid %d only)", uid,
                            os.getuid())
                return
            if not server._admit(self.connection):
                return
            try:
                self._serve()
            finally:
                server._forget(self.connection)

        def _serve(self) -> None:
            while True:
                line = self.rfile.readline(MAX_LINE + 1)
                if not line or server.closed:
                    return
                try:
                    if len(line) > MAX_LINE:
                        while line and not line.endswith(b"\n"):  # skip the rest: stay in step
                            line = self.rfile.readline(1 << 20)
                        raise ValueError(f"request line over {MAX_LINE} bytes")
                    reply = answer(json.loads(line))
                except Exception as exc:  # the scheduler gets the error as data, the worker keeps serving
                    log.warning("tierstore lookup failed: %r", exc)
                    reply = {"error": repr(exc)}
                if server.closed:
                    return
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()

    return Handler


def private_dir(base: Path, tries: int = 8) -> Path:
    """``base`` if it is (or can be made) a directory of this user that no one else may enter, else the
    first such of ``base.1`` … (logged): a directory another account created, widened or swapped for a
    symlink is never used, and the engine still starts. Every process of the engine resolves the same way
    (the first of them creates the directory), so they agree. Raises ``ConfigError`` when none is safe."""
    for i in range(tries):
        path = base if i == 0 else base.with_name(f"{base.name}.{i}")
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=True)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return path
        why = ("a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(st.st_mode)
               else f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else f"mode {st.st_mode & 0o777:o}")
        log.warning("tierstore: not using %s for lookup sockets: %s", path, why)
    raise ConfigError(f"no private directory for lookup sockets under {base.parent} ({base.name}.*): set "
                      "socket_dir in kv_connector_extra_config")


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
                uid = peer_uid(s)
                if uid != os.getuid():  # a socket swapped in by another account: never ask it
                    raise ConnectionRefusedError(f"lookup socket {self.paths[i]} is served by uid {uid}, not by "
                                                 f"this user ({os.getuid()}): refusing it")
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
