"""A client's pooled connections to its node server (:mod:`.client`): at most ``connections`` sockets, one
request in flight on each, the leases their gets hold given back with the next request or by an idle pass,
and every connection dropped at once when one finds the server gone (calls are then misses, and the next
connect is tried no sooner than :data:`RETRY_INTERVAL` later)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from .. import errors
from . import access, shm
from .link import Link, TierInfo
from .protocol import ProtocolError

log = logging.getLogger(__name__)

#: after a failed connect, calls are misses without trying again for this long
RETRY_INTERVAL = 0.5
#: seconds an idle connection keeps the leases of its last get before a background pass gives them back
RELEASE_AFTER = 0.02


class Unavailable(Exception):
    """The server cannot be reached now (the call becomes a miss)."""


class Links:
    """The connections of one client to the server at ``path`` (see the module docstring). ``check_open`` runs
    before a connection is taken (a closed or forked client raises there)."""

    def __init__(self, path: str, timeout: float, connections: int, trusted: frozenset[int],
                 check_open: Callable[[], None]):
        self.path, self.timeout, self._trusted, self._check_open = path, timeout, trusted, check_open
        #: the server's tiers and the bytes of a connection's staging area, as the last hello gave them
        self.tiers: tuple[TierInfo, ...] = ()
        self.staging_bytes = 0
        #: bytes one reservation holds: the staging area, or a quarter of the pool of a server that reserves puts in
        #: it (trusted writers, :mod:`.reserving`: a save larger than that goes in several, each evicting older ones)
        self.reserve_bytes = 0
        #: per server id, its pool mapped here (one mapping per process)
        self.pools: dict[str, torch.Tensor] = {}
        self.counts = {"unavailable": 0, "reconnects": 0, "untrusted": 0}
        self._lock = threading.Lock()
        self._idle: list[Link] = []
        self._slots = threading.BoundedSemaphore(connections)
        self._down_until = 0.0
        self._closed = False
        self._stopping, self._release_soon = threading.Event(), threading.Event()
        self._releaser = threading.Thread(target=self._release_idle, name="tierstore-client-leases", daemon=True)
        self._releaser.start()

    def connect(self) -> Link:
        if time.monotonic() < self._down_until:
            raise Unavailable
        try:
            conn = Link(self.path, self.timeout, self.pools, self._trusted)
        except (OSError, ProtocolError, KeyError, TypeError, ValueError) as exc:
            untrusted = isinstance(exc, (access.UntrustedServer, errors.InvalidInputError))
            with self._lock:
                self._down_until = time.monotonic() + RETRY_INTERVAL
                self.counts["untrusted" if untrusted else "unavailable"] += 1
            log.log(logging.WARNING if untrusted else logging.DEBUG, "tierstore server %s %s: %s", self.path,
                    "not trusted" if untrusted else "unreachable", exc)
            raise Unavailable from None
        with self._lock:
            self.tiers = conn.tiers
            self.staging_bytes = conn.staging.numel()
            self.reserve_bytes = conn.pool.numel() // 4 if conn.writable else conn.staging.numel()
            self.counts["reconnects"] += 1
            for gone in [sid for sid in self.pools if sid != conn.server]:
                # a restarted server's old pool: unmapped once the last view of it goes
                shm.unregister_for_dma(self.pools.pop(gone))
        return conn

    def take(self) -> Link:
        """A connection of this caller's own (one of the ``connections`` slots) until :meth:`put_back`."""
        self._check_open()
        self._slots.acquire()
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            return self.connect()
        except BaseException:
            self._slots.release()
            raise

    def put_back(self, conn: Link, broken: bool = False) -> None:
        """Give back a connection :meth:`take` handed out (a ``broken`` one was closed: only its slot)."""
        if not broken:
            self.give_back(conn)
        self._slots.release()

    def give_back(self, conn: Link) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._idle.append(conn)
            if conn.done or conn.touched:
                conn.idle_since = time.monotonic()
                self._release_soon.set()

    def owe(self, conn: Link, lease: int) -> None:
        """Give ``lease`` back with ``conn``'s next request, or its idle pass if it is idle now."""
        conn.owe(lease)
        with self._lock:
            if conn in self._idle:
                conn.idle_since = time.monotonic()
                self._release_soon.set()

    def _release_idle(self) -> None:
        """Give back the leases of connections left idle for :data:`RELEASE_AFTER` s (a busy connection
        gives them back with its next request, at no cost)."""
        while not self._stopping.is_set():
            self._release_soon.wait()
            if self._stopping.wait(RELEASE_AFTER):
                return
            self._release_soon.clear()
            with self._lock:
                due = [c for c in self._idle
                       if (c.done or c.touched) and time.monotonic() - c.idle_since >= RELEASE_AFTER]
                waiting = any(c.done or c.touched for c in self._idle if c not in due)
                for c in due:
                    self._idle.remove(c)
            if waiting:
                self._release_soon.set()
            for c in due:
                try:
                    settled = c.settled()
                    c.send({"op": "release", "leases": settled.get("release", []), "touch": settled.get("touch", "")})
                except OSError as exc:
                    self.broken(c, exc)
                    continue
                self.give_back(c)

    def broken(self, conn: Link, exc: BaseException) -> None:
        """``conn`` failed: it and every idle connection (to the same server, likely gone too) are dropped."""
        log.debug("tierstore server %s: %s: %s", self.path, type(exc).__name__, exc)
        conn.close()
        with self._lock:
            idle, self._idle = self._idle, []
            self.counts["unavailable"] += 1
        for c in idle:
            c.close()

    @contextmanager
    def connection(self) -> Iterator[Link]:
        """A pooled connection for the ``with`` body: given back after it (an error reply leaves its stream in
        step), closed if the body broke off otherwise; one whose exchange failed was dropped by :meth:`call`."""
        conn = self.take()
        try:
            yield conn
        except Unavailable:
            raise
        except errors.TierstoreError:
            self.give_back(conn)
            raise
        except BaseException:
            conn.close()
            raise
        else:
            self.give_back(conn)
        finally:
            self._slots.release()

    def call(self, conn: Link, msg: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request/reply on ``conn``; :class:`Unavailable` (``conn`` dropped) if the server cannot answer."""
        try:
            return conn.call(msg, timeout)
        except (OSError, ProtocolError, KeyError) as exc:
            self.broken(conn, exc)
            raise Unavailable from None

    def request(self, msg: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        with self.connection() as conn:
            return self.call(conn, msg, timeout)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "connections_idle": len(self._idle)}

    def close(self) -> None:
        """Close every idle connection (the server gives back what each held) and unmap the pools."""
        with self._lock:
            self._closed = True
        self._stopping.set()
        self._release_soon.set()
        self._releaser.join(5)
        with self._lock:
            idle, self._idle = self._idle, []
            pools, self.pools = self.pools, {}
        for c in idle:
            c.close()
        for pool in pools.values():
            shm.unregister_for_dma(pool)
