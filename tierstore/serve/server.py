"""``tierstore serve``: one store per node, shared by every engine process on it.

The server owns the node's tiers (one residency index) and answers clients over a Unix socket
(:mod:`.protocol`); tensor bytes move through shared memory (:mod:`.shm`). A get lends a client the
chunks its host pool holds — the client copies them once, straight out of the pool — and stages the
rest (read from disk or the shared tier) in the connection's staging area; a put is written by the client
into its staging area and committed by the server. Everything a connection holds — leases on pool
memory, pins — is given back when its socket closes (a client SIGKILLed mid-transfer included), and
leases older than ``lease_ttl`` are reclaimed in case a client stops answering but keeps its socket.

One thread per connection (:mod:`.connection`): a client that sends garbage, never reads, or stalls costs only
its own thread (and is dropped after ``send_timeout``; one that never says hello, after ``hello_timeout``),
never another client's calls. Running out of descriptors (``EMFILE``/``ENFILE``) pauses accepting, with a
warning and a count, until some are free again; it never ends the service.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import read_config
from ..errors import ConfigError
from ..sizes import parse_seconds, parse_size
from ..store import Pin, TieredStore
from ..store import open_tiered as open_store
from . import access, shm
from .connection import Connection
from .protocol import encode, error_reply

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/tierstore/tierstore.sock"
#: accept errors that pass once descriptors or memory free up (the first pause and the longest, in seconds)
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EINTR})
_PAUSE, _MAX_PAUSE = 0.05, 1.0


@dataclass(frozen=True)
class ServeConfig:
    """The ``serve:`` section of a node config (the rest is a store config whose first tier is ``host``)."""

    socket: str = DEFAULT_SOCKET
    #: users and (primary) groups allowed to connect; the server's own user by default
    allow_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid()}))
    allow_gids: frozenset[int] = frozenset()
    #: seconds a lease on pool memory may live before the server takes it back
    lease_ttl: float = 60.0
    #: bytes of staging memory per connection (puts, and gets of chunks not in the host pool)
    staging: int = 64 << 20
    max_clients: int = 64
    #: seconds a reply may wait for a client that does not read before the client is dropped
    send_timeout: float = 5.0
    #: seconds a new connection has to say hello before its slot is given back
    hello_timeout: float = 5.0
    #: clients map the pool writable and fill puts reserved in it (one copy); any client can then write any
    #: chunk in the pool (docs/serve.md, "Trusted writers")
    trusted_writers: bool = False
    #: torch intra-op threads of a ``tierstore serve`` process (its copies are memory-bound: more threads only
    #: spin against the engines on a busy machine); ``None``: torch's default
    threads: int | None = 1


def parse_serve(value: Any) -> ServeConfig:
    if value is None:
        return ServeConfig()
    if not isinstance(value, Mapping):
        raise ConfigError("serve: expected a mapping")
    known = ServeConfig.__dataclass_fields__
    unknown = set(value) - set(known)
    if unknown:
        raise ConfigError(f"serve: unknown key(s): {', '.join(sorted(unknown))}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "socket":
            if not isinstance(v, str) or not v:
                raise ConfigError("serve.socket: expected a path")
            out[key] = v
        elif key in ("allow_uids", "allow_gids"):
            if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
                raise ConfigError(f"serve.{key}: expected a list of ids")
            out[key] = frozenset(v)
        elif key == "staging":
            out[key] = parse_size(v, key="serve.staging")
        elif key == "trusted_writers":
            if not isinstance(v, bool):
                raise ConfigError("serve.trusted_writers: expected true or false")
            out[key] = v
        elif key == "threads" and v is None:
            out[key] = None
        elif key in ("max_clients", "threads"):
            if type(v) is not int or v < 1:
                raise ConfigError(f"serve.{key}: expected a positive int")
            out[key] = v
        else:
            out[key] = parse_seconds(v, key=f"serve.{key}")
    return ServeConfig(**out)


def socket_path_of(url: str) -> str:
    """``unix:///run/x.sock`` (or a plain path) -> ``/run/x.sock``."""
    path = url[len("unix://"):] if url.startswith("unix://") else url
    if not path.startswith("/"):
        raise ConfigError(f"server: expected unix:///absolute/path.sock, got {url!r}")
    return path


class NodeServer:
    """The node's store behind a Unix socket. ``start()`` serves on a thread, :meth:`serve_forever` on this
    one; :meth:`close` drops every client and closes the store."""

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike[str], socket_path: str | None = None):
        raw = read_config(config)
        self.config = parse_serve(raw.pop("serve", None))
        if socket_path is not None:
            self.config = ServeConfig(**{**self.config.__dict__, "socket": socket_path_of(socket_path)})
        tiers = raw.get("tiers")
        if not isinstance(tiers, list) or not tiers or not isinstance(tiers[0], Mapping) \
                or tiers[0].get("kind") != "host":
            raise ConfigError("tiers[0]: a node server's first tier is its host tier (kind: host, capacity: ...)")
        shared = "writable" if self.config.trusted_writers else True
        raw["tiers"] = [{**tiers[0], "shared_memory": shared, "pool": True}, *tiers[1:]]
        self.store: TieredStore = open_store(raw)
        try:
            pool = self.store.tiers[0].backend.pool  # type: ignore[attr-defined]
            if pool is None or pool.memfd is None:
                raise ConfigError("tiers[0]: the host tier needs a capacity (its pool is what clients read)")
            self.pool = pool
            #: what clients get: the pool read-only, or read-write for trusted writers
            self._pool_fd = os.dup(pool.memfd) if self.config.trusted_writers else shm.read_only(pool.memfd)
            self.listener = access.bind(self.config.socket, self.config.allow_uids, self.config.allow_gids)
        except BaseException:
            self.store.close()
            raise
        self.id = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._clients: set[Connection] = set()
        self._pins: dict[int, tuple[Connection, Pin]] = {}
        self.counts = {"connections": 0, "refused": 0, "protocol_errors": 0, "expired_leases": 0, "dropped": 0,
                       "accept_errors": 0, "expired_reservations": 0}
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NodeServer:
        for target, name in ((self.serve_forever, "accept"), (self._reap, "leases")):
            t = threading.Thread(target=target, name=f"tierstore-serve-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        pause = _PAUSE
        while not self._closing.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                if self._closing.is_set():
                    return
                if exc.errno not in _TRANSIENT:
                    raise
                with self._lock:
                    self.counts["accept_errors"] += 1
                log.warning("accept failed (%s): waiting %.2f s before accepting again", exc, pause)
                self._closing.wait(pause)  # the connection stays queued; descriptors free up as clients leave
                pause = min(2 * pause, _MAX_PAUSE)
                continue
            pause = _PAUSE
            try:
                self._admit(conn)
            except OSError as exc:  # a client gone before it was admitted: never the end of accepting
                log.warning("could not admit a client: %s", exc)
                conn.close()

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            clients = list(self._clients)
        for c in clients:
            c.hang_up()
        for c in clients:
            c.thread.join(10)
        try:
            os.unlink(self.config.socket)
        except OSError:
            pass
        os.close(self._pool_fd)
        self.store.close()

    def __enter__(self) -> NodeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ clients
    def _admit(self, sock: socket.socket) -> None:
        peer = access.peer_of(sock)
        refusal = None
        if not access.allowed(peer, self.config.allow_uids, self.config.allow_gids):
            refusal = f"uid {peer.uid} / gid {peer.gid} may not use this server"
        with self._lock:
            if refusal is None and self._closing.is_set():
                refusal = "server is closing"
            if refusal is None and len(self._clients) >= self.config.max_clients:
                refusal = f"server has its {self.config.max_clients} clients"
            if refusal is None:
                conn = Connection(self, sock, peer)
                self._clients.add(conn)
                self.counts["connections"] += 1
                conn.thread.start()  # under the lock: close() never sees a client whose thread has not started
            else:
                self.counts["refused"] += 1
        if refusal is not None:
            log.warning("refused pid %d: %s", peer.pid, refusal)
            try:
                sock.settimeout(1.0)
                sock.sendall(encode(error_reply(PermissionError(refusal))))
            except OSError:
                pass
            sock.close()

    def _gone(self, conn: Connection) -> None:
        with self._lock:
            self._clients.discard(conn)
            pins = [pid for pid, (owner, _) in self._pins.items() if owner is conn]
            held = [self._pins.pop(pid)[1] for pid in pins]
        for pin in held:
            self.store.release(pin)

    def _reap(self) -> None:
        while not self._closing.wait(min(1.0, self.config.lease_ttl / 4)):
            with self._lock:
                clients = list(self._clients)
            before = time.monotonic() - self.config.lease_ttl
            expired = [c.expire(before) for c in clients]
            for what, n in (("leases", sum(e[0] for e in expired)), ("reservations", sum(e[1] for e in expired))):
                if n:
                    log.warning("took back %d %s older than %.0f s", n, what, self.config.lease_ttl)
                    with self._lock:
                        self.counts[f"expired_{what}"] += n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            clients = list(self._clients)
            pins = len(self._pins)
            counts = dict(self.counts)
        held = [c.held_stats() for c in clients]
        return {"id": self.id, "clients": len(clients), "pins": pins, "leases": sum(h[0] for h in held),
                "leased_bytes": sum(h[1] for h in held), "trusted_writers": self.config.trusted_writers,
                "threads": torch.get_num_threads(),
                "reservations": sum(h[2] for h in held), "reserved_bytes": sum(h[3] for h in held), **counts}

    def pin(self, conn: Connection, pin: Pin) -> int:
        """Hold ``pin`` for ``conn``; its id (random: another client cannot guess it)."""
        with self._lock:
            while (pid := secrets.randbits(53) + 1) in self._pins:
                pass
            self._pins[pid] = (conn, pin)
        return pid

    def unpin(self, conn: Connection, pid: int) -> None:
        """Give back pin ``pid`` if a connection of ``conn``'s client process made it (else a no-op)."""
        with self._lock:
            held = self._pins.get(pid)
            if held is None or held[0].peer != conn.peer:
                return
            del self._pins[pid]
        self.store.release(held[1])
