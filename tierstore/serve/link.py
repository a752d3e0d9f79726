"""One socket from a client to its node server (:mod:`.client`), with its mappings of the server's pool
(read-only; read-write from a server with trusted writers) and of the connection's staging area, and the checks
made before a byte is sent (see :mod:`.client`'s docstring): the socket's directory and listener belong to a
trusted account, and both regions are sealed memfds."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import errors
from ..keys import DIGEST_SIZE, ChunkKey
from . import access, shm
from .protocol import MAX_KEYS, VERSION, ProtocolError, Reader, encode, hexes, set_timeouts


@dataclass(frozen=True)
class TierInfo:
    """A tier of the server's store, as clients see it."""

    index: int
    name: str
    kind: str
    shared: bool


ERRORS: dict[str, type[errors.TierstoreError]] = {
    cls.__name__: cls for cls in (errors.InvalidInputError, errors.InvalidTypeError, errors.ConfigError,
                                  errors.TierTimeoutError, errors.MissingKeyError, errors.CapacityError)}

class Link:
    """One socket to the server with its mappings of the pool (read-only) and of its staging area."""

    def __init__(self, path: str, timeout: float, pools: dict[str, torch.Tensor], trusted: frozenset[int]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.timeout = timeout
        fds: list[int] = []
        try:
            self.sock.settimeout(timeout)
            access.check_directory(path, trusted)
            self.sock.connect(path)
            access.check_server(self.sock, trusted)  # before a byte of ours reaches it
            self.sock.sendall(encode({"op": "hello", "version": VERSION, "pid": os.getpid()}))
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 2)
            if not data:
                raise ConnectionError("server closed the connection")
            #: leases whose chunks were copied out, to give back with the next request (or by the idle pass);
            #: a load's loan (:mod:`.lending`) adds to it from another thread while the link serves others
            self.done: list[int] = []
            self._notes = threading.Lock()
            #: chunks read straight from the pool (their hex digests back to back), reported with the next
            #: request (or by the idle pass)
            self.touched = ""
            self.idle_since = 0.0
            self.reader = Reader(self.sock, data)
            hello = self.reader.frame()
            if not hello.get("ok"):
                raise ProtocolError(f"server refused the connection: {hello.get('message')}")
            if len(fds) != 2:
                raise ProtocolError("server sent no shared memory")
            self.server: str = hello["server"]
            #: what this server does beyond protocol :data:`VERSION`'s first form (see :mod:`.protocol`)
            self.features = frozenset(f for f in hello.get("features", ()) if isinstance(f, str))
            #: the server has trusted writers: its pool is writable, by this client too (:mod:`.reserving`)
            self.writable = "reserve" in self.features
            # no SIGBUS; and unless the server said it trusts its clients' writes, nobody writes the pool
            shm.check_sealed(fds[0], int(hello["pool"]), shm.SEALS if self.writable else shm.POOL_SEALS)
            shm.check_sealed(fds[1], int(hello["staging"]))
            self.tiers = tuple(TierInfo(i, t["name"], t["kind"], bool(t["shared"]))
                               for i, t in enumerate(hello["tiers"]))
            pool = pools.get(self.server)  # one mapping of a server's pool per process
            if pool is None:
                pool = pools[self.server] = shm.map_bytes(fds[0], int(hello["pool"]), writable=self.writable)
                shm.register_for_dma(pool, read_only=not self.writable)  # copies to and from a GPU are then DMA
            self.pool: torch.Tensor = pool
            self.words = pool.view(torch.int64)  # the chunks' stamp words (tierstore.serve.places)
            self.staging = shm.map_bytes(fds[1], int(hello["staging"]))
            set_timeouts(self.sock, send=timeout, receive=timeout)
        except BaseException:
            self.sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def call(self, msg: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if self.done or self.touched:  # ride along (one message fewer per get)
            msg = {**msg, **self.settled()}
        if timeout is not None:  # a call of its own length (prefetch): back to the usual after it
            set_timeouts(self.sock, send=self.timeout, receive=timeout)
        try:
            self.sock.sendall(encode(msg))
            reply = self.reader.frame()
            while reply.get("beat") is True:  # a long call (flush) the server is still working on
                reply = self.reader.frame()
        finally:
            if timeout is not None:
                set_timeouts(self.sock, send=self.timeout, receive=self.timeout)
        if not reply.get("ok"):
            name, text = reply.get("error"), str(reply.get("message"))
            if name == "ClosedError":
                raise ConnectionError(f"server is closing: {text}")
            raise ERRORS.get(str(name), errors.TierstoreError)(text)
        return reply

    def settled(self) -> dict[str, Any]:
        """What to tell the server with the next message: leases done with, chunks read straight from the pool."""
        msg: dict[str, Any] = {}
        with self._notes:
            if self.done:
                msg["release"], self.done = self.done, []
            if self.touched:
                msg["touch"], self.touched = self.touched, ""
        return msg

    def owe(self, lease: int) -> None:
        """Note ``lease`` as done with: given back with the next request (or by the idle pass)."""
        with self._notes:
            self.done.append(lease)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Note ``keys`` as read straight from the pool; only the last :data:`MAX_KEYS` are kept (what one
        message may carry), so a client that never pauses does not grow the note without end."""
        with self._notes:
            self.touched = (self.touched + hexes(keys))[-MAX_KEYS * 2 * DIGEST_SIZE:]

    def send(self, msg: Mapping[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def close(self) -> None:
        self.sock.close()
