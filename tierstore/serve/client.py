"""The store API against a node's ``tierstore serve`` (``tierstore.open({"server": "unix:///..."})``).

Same methods and results as :class:`~tierstore.TieredStore`, so the code above runs embedded or against
the server unchanged. A get copies each chunk once, straight out of the server's host pool (mapped
read-only) or the connection's staging area, into ``out`` or a fresh tensor; a chunk read into ``out`` before
is read again without a request while its stamp says it is still there (:mod:`.places`). A put copies into
the staging area and the server commits it. Connections are pooled (one request in flight on each).

The server going away is never an exception on the data path: while it cannot be reached, gets are misses,
puts are not acknowledged, ``contains``/``lookup`` say no — each call returns at once (a dead server's socket
fails immediately) — and the next call after it is back reconnects by itself. Only ``flush`` raises
(:class:`~tierstore.ServerUnavailableError`): it promises something an absent server cannot keep.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .. import errors
from ..errors import ClosedError, ConfigError, ServerUnavailableError, WriteBackError
from ..keys import DIGEST_SIZE, ChunkKey, check_key
from ..objformat import validate_chunk
from ..sizes import parse_seconds
from ..store import Item, Readiness, check_items, check_keys
from ..telemetry import Counters
from ..tensors import TensorDict, byte_alias, check_device, check_outs, copy_tensors, dtype_name, wait_for_copies
from . import shm
from .places import OutSpec, Places, copy_out
from .protocol import (
    MAX_KEYS,
    VERSION,
    ProtocolError,
    Reader,
    encode,
    hexes,
    parse_spec,
    place,
    set_timeouts,
    spec,
    views,
)
from .server import socket_path_of

log = logging.getLogger(__name__)

#: seconds a request may take before the server counts as unreachable (flush and prefetch take their own)
TIMEOUT = 5.0
#: after a failed connect, calls are misses without trying again for this long
RETRY_INTERVAL = 0.5
CONNECTIONS = 4
#: seconds an idle connection keeps the leases of its last get before a background pass gives them back
RELEASE_AFTER = 0.02

@dataclass(frozen=True)
class TierInfo:
    """A tier of the server's store, as clients see it."""

    index: int
    name: str
    kind: str
    shared: bool


@dataclass
class ServerPin:
    """What :meth:`ServerStore.pin` holds on the server (given back by :meth:`ServerStore.release`, or when
    the connection that made it closes)."""

    keys: tuple[ChunkKey, ...]
    ready: int
    id: int = 0


class _Unavailable(Exception):
    """The server cannot be reached now (the call becomes a miss)."""


_ERRORS: dict[str, type[errors.TierstoreError]] = {
    cls.__name__: cls for cls in (errors.InvalidInputError, errors.InvalidTypeError, errors.ConfigError,
                                  errors.TierTimeoutError, errors.MissingKeyError, errors.CapacityError)}


class _Connection:
    """One socket to the server with its mappings of the pool (read-only) and of its staging area."""

    def __init__(self, path: str, timeout: float, pools: dict[str, torch.Tensor]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.timeout = timeout
        fds: list[int] = []
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
            self.sock.sendall(encode({"op": "hello", "version": VERSION, "pid": os.getpid()}))
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 2)
            if not data:
                raise ConnectionError("server closed the connection")
            #: leases whose chunks were copied out, to give back with the next request (or by the idle pass)
            self.done: list[int] = []
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
            self.tiers = tuple(TierInfo(i, t["name"], t["kind"], bool(t["shared"]))
                               for i, t in enumerate(hello["tiers"]))
            pool = pools.get(self.server)  # one mapping of a server's pool per process
            if pool is None:
                pool = pools[self.server] = shm.map_bytes(fds[0], int(hello["pool"]), writable=False)
                shm.register_for_dma(pool, read_only=True)  # copies to a GPU are then DMA
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
        if timeout is not None:  # a call of its own length (flush, prefetch): back to the usual after it
            set_timeouts(self.sock, send=self.timeout, receive=timeout)
        try:
            self.sock.sendall(encode(msg))
            reply = self.reader.frame()
        finally:
            if timeout is not None:
                set_timeouts(self.sock, send=self.timeout, receive=self.timeout)
        if not reply.get("ok"):
            name, text = reply.get("error"), str(reply.get("message"))
            if name == "ClosedError":
                raise ConnectionError(f"server is closing: {text}")
            raise _ERRORS.get(str(name), errors.TierstoreError)(text)
        return reply

    def settled(self) -> dict[str, Any]:
        """What to tell the server with the next message: leases done with, chunks read straight from the pool."""
        msg: dict[str, Any] = {}
        if self.done:
            msg["release"], self.done = self.done, []
        if self.touched:
            msg["touch"], self.touched = self.touched, ""
        return msg

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Note ``keys`` as read straight from the pool; only the last :data:`MAX_KEYS` are kept (what one
        message may carry), so a client that never pauses does not grow the note without end."""
        self.touched = (self.touched + hexes(keys))[-MAX_KEYS * 2 * DIGEST_SIZE:]

    def send(self, msg: Mapping[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def close(self) -> None:
        self.sock.close()


class ServerStore:
    """A node server's store, used through its socket (see the module docstring).

    Args:
        url: ``unix:///run/tierstore/tierstore.sock`` (or the socket's absolute path).
        timeout: seconds one request may take before the server counts as gone.
        connections: sockets kept open (calls in flight at once from this process).
    """

    def __init__(self, url: str, timeout: float = TIMEOUT, connections: int = CONNECTIONS):
        timeout = parse_seconds(timeout, key="timeout")
        if type(connections) is not int or connections < 1:
            raise ConfigError(f"connections: expected a positive int, got {connections!r}")
        self.path = socket_path_of(url)
        self.url = url
        self.timeout = float(timeout)
        self.counters = Counters()
        self.tiers: tuple[TierInfo, ...] = ()
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._pools: dict[str, torch.Tensor] = {}
        self._slots = threading.BoundedSemaphore(connections)
        self._down_until = 0.0
        self._closed = False
        self._counts = {"unavailable": 0, "reconnects": 0}
        self._places = Places()
        self._async = ThreadPoolExecutor(connections, thread_name_prefix="tierstore-client")
        self._stopping, self._release_soon = threading.Event(), threading.Event()
        self._releaser = threading.Thread(target=self._release_idle, name="tierstore-client-leases", daemon=True)
        self._releaser.start()
        try:
            self._give_back(self._connect())
        except _Unavailable:
            log.warning("tierstore server at %s is not reachable yet: calls are misses until it is", self.path)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ServerStore:
        unknown = set(raw) - {"server", "timeout", "connections"}
        if unknown:
            raise ConfigError(f"a server config takes server, timeout and connections; not {', '.join(sorted(unknown))}"
                              " (the server's own config names the tiers)")
        if not isinstance(raw["server"], str):
            raise ConfigError("server: expected unix:///path/to/socket")
        return cls(raw["server"], raw.get("timeout", TIMEOUT), raw.get("connections", CONNECTIONS))

    # ------------------------------------------------------------------ connections
    def _connect(self) -> _Connection:
        if time.monotonic() < self._down_until:
            raise _Unavailable
        try:
            conn = _Connection(self.path, self.timeout, self._pools)
        except (OSError, ProtocolError, KeyError, TypeError, ValueError) as exc:
            with self._lock:
                self._down_until = time.monotonic() + RETRY_INTERVAL
                self._counts["unavailable"] += 1
            log.debug("tierstore server %s unreachable: %s", self.path, exc)
            raise _Unavailable from None
        with self._lock:
            self.tiers = conn.tiers
            self._counts["reconnects"] += 1
            for gone in [sid for sid in self._pools if sid != conn.server]:
                # a restarted server's old pool: unmapped once the last view of it goes
                shm.unregister_for_dma(self._pools.pop(gone))
        return conn

    def _take(self) -> _Connection:
        if self._closed:
            raise ClosedError("store is closed")
        self._slots.acquire()
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            return self._connect()
        except BaseException:
            self._slots.release()
            raise

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._idle.append(conn)
            if conn.done or conn.touched:
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
                    self._broken(c, exc)
                    continue
                self._give_back(c)

    def _broken(self, conn: _Connection, exc: BaseException) -> None:
        """``conn`` failed: it and every idle connection (to the same server, likely gone too) are dropped."""
        log.debug("tierstore server %s: %s: %s", self.path, type(exc).__name__, exc)
        conn.close()
        with self._lock:
            idle, self._idle = self._idle, []
            self._counts["unavailable"] += 1
        for c in idle:
            c.close()

    @contextmanager
    def _connection(self) -> Iterator[_Connection]:
        """A pooled connection for the ``with`` body: given back after it (an error reply leaves its stream in
        step), closed if the body broke off otherwise; one whose exchange failed was dropped by :meth:`_call`."""
        conn = self._take()
        try:
            yield conn
        except _Unavailable:
            raise
        except errors.TierstoreError:
            self._give_back(conn)
            raise
        except BaseException:
            conn.close()
            raise
        else:
            self._give_back(conn)
        finally:
            self._slots.release()

    def _call(self, conn: _Connection, msg: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request/reply on ``conn``; :class:`_Unavailable` (``conn`` dropped) if the server cannot answer."""
        try:
            return conn.call(msg, timeout)
        except (OSError, ProtocolError, KeyError) as exc:
            self._broken(conn, exc)
            raise _Unavailable from None

    def _request(self, msg: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        with self._connection() as conn:
            return self._call(conn, msg, timeout)

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[ChunkKey], *, out: Sequence[Mapping[str, torch.Tensor]] | None = None,
                 device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """As :meth:`TieredStore.get_many`; misses while the server cannot be reached."""
        keys = check_keys(keys)
        device = check_device(device)
        if out is not None:
            out = list(out)
            if len(out) != len(keys):
                raise errors.InvalidInputError(f"out has {len(out)} entries for {len(keys)} keys")
            check_outs(out)
        results: list[TensorDict | None] = [None] * len(keys)
        for start in range(0, len(keys), MAX_KEYS):
            todo = list(range(start, min(start + MAX_KEYS, len(keys))))
            while todo:
                try:
                    again = self._get_some(keys, out, device, todo, results)
                except _Unavailable:
                    break
                if len(again) == len(todo):
                    log.warning("%d chunks are larger than the server's staging area: misses", len(again))
                    break
                todo = again
        return results

    def _get_some(self, keys: list[ChunkKey], out: list[Mapping[str, torch.Tensor]] | None,
                  device: str | torch.device, todo: list[int], results: list[TensorDict | None]) -> list[int]:
        """Get ``todo`` (at most :data:`MAX_KEYS`) into ``results``; returns those to ask for again."""
        outs: list[OutSpec] = []
        if out is not None:
            outs = [tuple((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in out[i].items()) for i in todo]
        with self._connection() as conn:
            asked, again = todo, []
            if out is not None:  # what this client read before: straight from the pool if it is still there
                direct = self._places.read(conn.server, conn.pool, conn.words, conn.sock, keys, outs, out, todo,
                                           results)
                if direct:
                    conn.touch([keys[i] for i in direct])
                    read = set(direct)
                    outs = [o for i, o in zip(todo, outs, strict=True) if i not in read]
                    todo = [i for i in todo if i not in read]
            if todo:
                again = self._ask_for(conn, keys, out, outs, device, todo, results)
            if out is not None and any(o.device.type == "cuda" for i in asked for o in out[i].values()):
                wait_for_copies(*(o for i in asked for o in out[i].values()))
            return again

    def _ask_for(self, conn: _Connection, keys: list[ChunkKey], out: list[Mapping[str, torch.Tensor]] | None,
                 outs: list[OutSpec], device: str | torch.device, todo: list[int],
                 results: list[TensorDict | None]) -> list[int]:
        """One get request on ``conn`` for ``todo`` (``outs``: their ``out`` shapes); copies what it lends."""
        msg: dict[str, Any] = {"op": "get", "keys": hexes([keys[i] for i in todo])}
        if out is not None:  # what each out expects, each distinct list once (a KV batch has one)
            distinct: dict[OutSpec, int] = {}
            msg["outs"] = [distinct.setdefault(one, len(distinct)) for one in outs]
            msg["specs"] = [[[n, d, list(shape)] for n, d, shape in one] for one in distinct]
        reply = self._call(conn, msg)
        if "lease" in reply:
            conn.done.append(reply["lease"])  # given back with the connection's next request
        again = []
        for j, (i, item) in enumerate(zip(todo, reply["items"], strict=True)):
            if item is None:
                continue
            if item == 0:
                again.append(i)
            elif item == 1:
                log.warning("get %s: out does not match the chunk; treating as a miss", keys[i].hex()[:16])
            elif isinstance(item, list):
                assert out is not None
                results[i] = copy_out(conn.pool if item[0] == 0 else conn.staging, item[3:], out[i])
                if item[0] == 0:
                    self._places.learn(conn.server, keys[i], outs[j], item)
            else:
                region = conn.pool if "p" in item else conn.staging
                src = views(region, parse_spec(item["p"] if "p" in item else item["s"], region.numel()))
                results[i] = copy_tensors(src, device)
        return again

    def get(self, key: ChunkKey, *, out: Mapping[str, torch.Tensor] | None = None,
            device: str | torch.device = "cpu") -> TensorDict | None:
        return self.get_many([key], out=None if out is None else [out], device=device)[0]

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Iterable[Item]) -> list[bool]:
        """As :meth:`TieredStore.put_many`; not acknowledged (``False``) while the server cannot be reached or
        for a chunk larger than the connection's staging area."""
        items, valid = check_items(items)
        acks = [False] * len(items)
        while valid:
            try:
                valid = self._put_some(items, valid, acks)
            except _Unavailable:
                break
        return acks

    def _put_some(self, items: list[Item], todo: list[int], acks: list[bool]) -> list[int]:
        """Put as many of ``todo`` as fit the staging area in one request; the rest, to put next."""
        with self._connection() as conn:
            size, pos = conn.staging.numel(), 0
            sent: list[int] = []
            wire: list[dict[str, Any]] = []
            later: list[int] = []
            for n, i in enumerate(todo):
                key, tensors = items[i]
                offsets, end = place([t.nbytes for t in tensors.values()], pos)
                if end > size or len(sent) == MAX_KEYS:
                    if sent:  # the rest go next, in order (a later put of a key must stay later)
                        later = todo[n:]
                        break
                    log.warning("put %s: %d bytes is more than the server's staging area", key.hex()[:16], end)
                    continue
                for t, off in zip(tensors.values(), offsets, strict=True):
                    conn.staging[off:off + t.nbytes].copy_(byte_alias(t.detach().resolve_conj().resolve_neg()
                                                                      .contiguous().cpu()))
                sent.append(i)
                wire.append({"k": key.hex(), "t": spec(tensors, offsets)})
                pos = end
            if not sent:
                return []
            reply = self._call(conn, {"op": "put", "items": wire})
        for i, ok in zip(sent, reply["acks"], strict=True):
            acks[i] = bool(ok)
        return later

    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        check_key(key)
        validate_chunk(tensors)
        return self.put_many([(key, tensors)])[0]

    # ------------------------------------------------------------------ questions
    def _ask(self, msg: dict[str, Any], field: str, miss: Any, timeout: float | None = None) -> Any:
        if "keys" in msg:
            keys = msg["keys"]
            if len(keys) > MAX_KEYS:
                raise errors.InvalidInputError(f"at most {MAX_KEYS} keys per call through a server")
            msg = {**msg, "keys": hexes(keys)}
        try:
            return self._request(msg, timeout)[field]
        except _Unavailable:
            return miss

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        keys = check_keys(keys)
        return list(self._ask({"op": "contains", "keys": keys}, "found", [False] * len(keys)))

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([check_key(key)])[0]

    def lookup(self, keys: Sequence[ChunkKey], *, probe: bool = True) -> int:
        return int(self._ask({"op": "lookup", "keys": check_keys(keys), "probe": bool(probe)}, "n", 0))

    def locate(self, keys: Sequence[ChunkKey], *, probe: bool = True, local: bool = False) -> list[str]:
        return list(self._ask({"op": "locate", "keys": check_keys(keys), "probe": bool(probe),
                               "local": bool(local)}, "tiers", []))

    def readiness(self, keys: Sequence[ChunkKey], *, promote: bool = True) -> Any:
        keys = check_keys(keys)
        try:
            reply = self._request({"op": "readiness", "keys": hexes(keys), "promote": bool(promote)})
        except _Unavailable:
            return Readiness(0, 0)
        return Readiness(int(reply["ready"]), int(reply["pending"]))

    def where(self, key: ChunkKey) -> str | None:
        return self._ask({"op": "where", "keys": [check_key(key)]}, "tier", None)  # type: ignore[no-any-return]

    def holders(self, key: ChunkKey) -> list[str]:
        return list(self._ask({"op": "holders", "keys": [check_key(key)]}, "tiers", []))

    def prefetch(self, keys: Iterable[ChunkKey]) -> Future[int]:
        """Promote ``keys`` toward the server's top tier; the future resolves to how many it then holds
        (0 while the server cannot be reached)."""
        keys = [check_key(k) for k in keys]
        self._check_open()
        return self._async.submit(self._ask, {"op": "prefetch", "keys": keys, "wait": True, "timeout": 60.0},
                                  "n", 0, 65.0)

    # ------------------------------------------------------------------ pins, deletes, flush
    def pin(self, keys: Sequence[ChunkKey]) -> ServerPin:
        keys = check_keys(keys)
        try:
            reply = self._request({"op": "pin", "keys": hexes(keys)})
        except _Unavailable:
            return ServerPin(tuple(keys), 0)
        return ServerPin(tuple(keys), int(reply["ready"]), int(reply["pin"]))

    def release(self, pin: ServerPin) -> None:
        pid, pin.id = pin.id, 0
        if pid:
            try:
                self._request({"op": "unpin", "pin": pid})
            except _Unavailable:
                pass  # the server is gone, and the pin with it

    def delete(self, keys: ChunkKey | Sequence[ChunkKey]) -> int:
        keys = check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        return int(self._ask({"op": "delete", "keys": keys}, "n", 0))

    def evict(self, keys: ChunkKey | Sequence[ChunkKey], tier: str) -> int:
        keys = check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        return int(self._ask({"op": "evict", "keys": keys, "tier": str(tier)}, "n", 0))

    def flush(self, timeout: float | None = None) -> Any:
        """As :meth:`TieredStore.flush` on the server's store. Raises :class:`ServerUnavailableError` if the
        server cannot be reached (what was put may not be written)."""
        from ..writeback import FlushReport

        wait = None if timeout is None else float(timeout)
        try:
            reply = self._request({"op": "flush", "timeout": wait}, None if wait is None else wait + self.timeout)
        except _Unavailable:
            raise ServerUnavailableError(f"tierstore server at {self.path} cannot be reached") from None
        failed, dropped = _keyed(reply["failed"]), _keyed(reply["dropped"])
        if failed:
            raise WriteBackError(failed, dropped)
        return FlushReport(dropped)

    def stats(self) -> dict[str, Any]:
        """The server store's ``stats()`` with a ``server`` section, and this client's own ``client`` section."""
        try:
            out = dict(self._request({"op": "stats"})["stats"])
        except _Unavailable:
            out = {"tiers": {}, "server": None}
        with self._lock:
            out["client"] = {**self._counts, **self._places.snapshot(), "connections_idle": len(self._idle)}
        out["counters"] = self.counters.snapshot()
        return out

    # ------------------------------------------------------------------ async forms
    def get_many_async(self, keys: Sequence[ChunkKey], *, out: Sequence[Mapping[str, torch.Tensor]] | None = None,
                       device: str | torch.device = "cpu") -> Future[list[TensorDict | None]]:
        self._check_open()
        return self._async.submit(lambda: self.get_many(keys, out=out, device=device))

    def put_many_async(self, items: Iterable[Item]) -> Future[list[bool]]:
        items = list(items)
        self._check_open()
        return self._async.submit(self.put_many, items)

    def contains_many_async(self, keys: Sequence[ChunkKey]) -> Future[list[bool]]:
        self._check_open()
        return self._async.submit(self.contains_many, list(keys))

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store is closed")

    def close(self, timeout: float | None = None) -> None:
        """Wait for this client's calls in flight, then close its connections (the server keeps the data)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._async.shutdown(wait=True)
        self._stopping.set()
        self._release_soon.set()
        self._releaser.join(5)
        with self._lock:
            idle, self._idle = self._idle, []
            pools, self._pools = self._pools, {}
        for c in idle:
            c.close()  # the server gives back what a closed connection held
        for pool in pools.values():
            shm.unregister_for_dma(pool)

    def __enter__(self) -> ServerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ServerStore {self.url}>"


def _keyed(named: Mapping[str, Sequence[str]]) -> dict[ChunkKey, tuple[str, ...]]:
    return {ChunkKey.from_hex(k): tuple(v) for k, v in named.items()}
