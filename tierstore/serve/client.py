"""The store API against a node's ``tierstore serve`` (``tierstore.open({"server": "unix:///..."})``).

Same methods and results as :class:`~tierstore.TieredStore`, so the code above runs embedded or against
the server unchanged. A get copies each chunk once, straight out of the server's host pool (mapped
read-only) or the connection's staging area, into ``out`` or a fresh tensor; a chunk read into ``out`` before
is read again without a request while its stamp says it is still there (:mod:`.places`). A put copies into
the staging area and the server commits it. Connections are pooled (one request in flight on each).

The server going away is never an exception on the data path: while it cannot be reached, gets are misses,
puts are not acknowledged, ``contains``/``lookup`` say no — each call returns at once (a dead server's socket
fails immediately) — and the next call after it is back reconnects by itself. Only ``flush`` raises
(:class:`~tierstore.ServerUnavailableError`): it promises something an absent server cannot keep, and a
server that restarted (a new server id in its hello) cannot keep it for the puts its predecessor acknowledged.

Before it sends anything a client checks whom it talks to: the socket's directory must belong to a trusted
account and be writable by no other, the process listening must run as a trusted account (``SO_PEERCRED``:
the client's own user, root, or ``server_uid``), and both regions it is handed must be sealed memfds (the pool
sealed against writes, unless the server says it trusts its clients' writes: ``serve.trusted_writers``).
Anything else is a server that cannot be reached (calls are misses, with a warning).
A client used in a process forked after it opened raises :class:`~tierstore.ForkedError` on every call (the
child opens its own).
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .. import errors
from ..errors import ClosedError, ConfigError, ForkedError, ServerUnavailableError, WriteBackError
from ..keys import ChunkKey, check_key
from ..objformat import validate_chunk
from ..sizes import parse_seconds
from ..store import Item, Readiness, check_items, check_keys
from ..telemetry import Counters
from ..tensors import TensorDict, byte_alias, check_device, check_outs, copy_tensors, dtype_name, wait_for_copies
from . import access, lending
from .link import Link, TierInfo
from .links import Links, Unavailable
from .places import OutSpec, Places, copy_out, stamp_holds
from .protocol import (
    MAX_KEYS,
    ProtocolError,
    hexes,
    parse_spec,
    place,
    spec,
    views,
)
from .server import socket_path_of

log = logging.getLogger(__name__)
T = TypeVar("T")

#: seconds a request may take before the server counts as unreachable (flush and prefetch take their own)
TIMEOUT = 5.0
CONNECTIONS = 4
#: a flush's heartbeat: the server says it is still flushing this often (a fraction of the request timeout)
BEAT = 0.4

@dataclass
class ServerPin:
    """What :meth:`ServerStore.pin` holds on the server (given back by :meth:`ServerStore.release`, or when
    the connection that made it closes)."""

    keys: tuple[ChunkKey, ...]
    ready: int
    id: int = 0


class ServerStore:
    """A node server's store, used through its socket (see the module docstring).

    Args:
        url: ``unix:///run/tierstore/tierstore.sock`` (or the socket's absolute path).
        timeout: seconds one request may take before the server counts as gone.
        connections: sockets kept open (calls in flight at once from this process).
        server_uid: the account (uid or user name) the server runs as, when it is not this process's own
            user or root: a server run by any other account is never sent a byte.
    """

    def __init__(self, url: str, timeout: float = TIMEOUT, connections: int = CONNECTIONS,
                 server_uid: int | str | None = None):
        timeout = parse_seconds(timeout, key="timeout")
        if type(connections) is not int or connections < 1:
            raise ConfigError(f"connections: expected a positive int, got {connections!r}")
        if isinstance(server_uid, str):
            try:
                server_uid = pwd.getpwnam(server_uid).pw_uid
            except KeyError:
                raise ConfigError(f"server_uid: no user named {server_uid!r}") from None
        if server_uid is not None and (type(server_uid) is not int or server_uid < 0):
            raise ConfigError(f"server_uid: expected a user id or name, got {server_uid!r}")
        self._pid = os.getpid()
        self.path = socket_path_of(url)
        self.url = url
        self.timeout = float(timeout)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"lent_chunks": 0, "reserved_chunks": 0}
        #: per server id, puts it acknowledged that no flush has confirmed yet
        self._unflushed: dict[str, int] = {}
        self._places = Places()
        self._links = Links(self.path, self.timeout, connections, access.trusted_uids(server_uid), self._check_open)
        self._async = ThreadPoolExecutor(connections, thread_name_prefix="tierstore-client")
        try:
            self._links.give_back(self._links.connect())
        except Unavailable:
            log.warning("tierstore server at %s is not reachable yet: calls are misses until it is", self.path)

    @property
    def tiers(self) -> tuple[TierInfo, ...]:
        """The server's tiers, as its last hello named them."""
        return self._links.tiers

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ServerStore:
        unknown = set(raw) - {"server", "timeout", "connections", "server_uid"}
        if unknown:
            raise ConfigError(f"a server config takes server, timeout, connections and server_uid; not "
                              f"{', '.join(sorted(unknown))} (the server's own config names the tiers)")
        if not isinstance(raw["server"], str):
            raise ConfigError("server: expected unix:///path/to/socket")
        return cls(raw["server"], raw.get("timeout", TIMEOUT), raw.get("connections", CONNECTIONS),
                   raw.get("server_uid"))

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[ChunkKey], *, out: Sequence[Mapping[str, torch.Tensor]] | None = None,
                 device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """As :meth:`TieredStore.get_many`; misses while the server cannot be reached."""
        self._check_open()
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
                except Unavailable:
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
        with self._links.connection() as conn:
            asked, again = todo, []
            if out is not None:  # what this client read before: straight from the pool if it is still there
                direct = self._places.read(conn.server, conn.pool, conn.words, conn.sock, keys, outs, out, todo,
                                           results)
                if direct:
                    conn.touch([keys[i] for i in direct])
                    read = set(direct)
                    outs = [o for i, o in zip(todo, outs, strict=True) if i not in read]
                    todo = [i for i in todo if i not in read]
            leased: list[tuple[int, OutSpec, list[Any]]] = []
            if todo:
                again = self._ask_for(conn, keys, out, outs, device, todo, results, leased)
            if out is not None and any(o.device.type == "cuda" for i in asked for o in out[i].values()):
                wait_for_copies(*(o for i in asked for o in out[i].values()))
            for i, spec_, item in leased:  # copied out of the pool under a lease: was it still that chunk?
                if stamp_holds(conn.words, item[1], item[2]):
                    self._places.learn(conn.server, keys[i], spec_, item)
                else:  # the lease outlived lease_ttl and the memory went to another chunk meanwhile
                    log.warning("get %s: its pool memory was reused while being copied; a miss", keys[i].hex()[:16])
                    results[i] = None
            return again

    def _ask_for(self, conn: Link, keys: list[ChunkKey], out: list[Mapping[str, torch.Tensor]] | None,
                 outs: list[OutSpec], device: str | torch.device, todo: list[int],
                 results: list[TensorDict | None], leased: list[tuple[int, OutSpec, list[Any]]]) -> list[int]:
        """One get request on ``conn`` for ``todo`` (``outs``: their ``out`` shapes); copies what it lends (the
        chunks copied out of the pool listed in ``leased``, for their stamps to be checked once the copies are
        done)."""
        msg: dict[str, Any] = {"op": "get", "keys": hexes([keys[i] for i in todo])}
        if out is not None:  # what each out expects, each distinct list once (a KV batch has one)
            distinct: dict[OutSpec, int] = {}
            msg["outs"] = [distinct.setdefault(one, len(distinct)) for one in outs]
            msg["specs"] = [[[n, d, list(shape)] for n, d, shape in one] for one in distinct]
        reply = self._links.call(conn, msg)
        if "lease" in reply:
            conn.owe(reply["lease"])  # given back with the connection's next request
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
                    leased.append((i, outs[j], item))
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
        self._check_open()
        items, valid = check_items(items)
        acks = [False] * len(items)
        while valid:
            try:
                valid = self._put_some(items, valid, acks)
            except Unavailable:
                break
        return acks

    def _put_some(self, items: list[Item], todo: list[int], acks: list[bool]) -> list[int]:
        """Put as many of ``todo`` as fit the staging area in one request; the rest, to put next."""
        with self._links.connection() as conn:
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
            for i, ok in zip(sent, self._put_staged(conn, wire), strict=True):
                acks[i] = ok
        return later

    def _put_staged(self, conn: Link, wire: list[lending.Wire]) -> list[bool]:
        """One put request for the chunks ``wire`` names in ``conn``'s staging area; per chunk its ack."""
        acks = [bool(ok) for ok in self._links.call(conn, {"op": "put", "items": wire})["acks"]]
        if len(acks) != len(wire):
            raise errors.TierstoreError(f"server acknowledged {len(acks)} of {len(wire)} puts")
        with self._lock:
            self._unflushed[conn.server] = self._unflushed.get(conn.server, 0) + sum(acks)
        return acks

    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        check_key(key)
        validate_chunk(tensors)
        return self.put_many([(key, tensors)])[0]

    # ------------------------------------------------------------------ the one-copy KV path (.lending)
    def lend(self, keys: Sequence[ChunkKey]) -> lending.ServerLoan:
        """As :meth:`TieredStore.lend`: the chunks the server's pool holds, views of it (mapped here read-only)
        under a lease until :meth:`~.lending.ServerLoan.close`; ``None`` for the others, and for every key while
        the server cannot be reached or does not lend."""
        keys = check_keys(keys)
        nothing = lending.ServerLoan([None] * len(keys), [None] * len(keys))
        try:
            with self._links.connection() as conn:
                if "lend" not in conn.features:
                    return nothing
                reply = self._links.call(conn, {"op": "lend", "keys": hexes(keys[:MAX_KEYS])})
                lease = reply.get("lease")
                release = functools.partial(self._links.owe, conn, lease) if type(lease) is int else None
                loan = lending.lent(len(keys), reply.get("items"), conn.pool, conn.words, release)
        except Unavailable:
            return nothing
        except ProtocolError as exc:
            log.warning("tierstore server %s: a lend reply broke the protocol (%s): read the usual way", self.path, exc)
            return nothing
        with self._lock:
            self._counts["lent_chunks"] += sum(t is not None for t in loan.tensors)
        return loan

    def reserve(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]], *, wait: bool = True
                ) -> lending.PoolReservation | lending.StagedReservation:
        """As :meth:`TieredStore.reserve`: views to fill per ``(key, like)`` (``None`` for keys not reserved, and
        for every key while the server cannot be reached); holds a connection until it is committed or aborted.
        From a server with trusted writers, runs of its pool (one copy: :class:`~.lending.PoolReservation`, at
        most :data:`MAX_KEYS` keys); from any other, the connection's staging area (the pool takes no client's
        writes), as many as it holds, committed with one put request (``wait`` then does not apply)."""
        items = [(check_key(k), like) for k, like in items]
        keys = [k for k, _ in items]
        try:
            conn = self._links.take()
        except Unavailable:
            return lending.StagedReservation(keys, [None] * len(keys), [None] * len(keys))
        held = _Held(self._links, conn)
        if conn.writable:
            return self._reserve_in_pool(held, items, wait)

        def put(wire: list[lending.Wire]) -> list[bool]:
            acks = held.run(lambda: self._put_staged(conn, wire))
            if acks is None:
                return [False] * len(wire)
            with self._lock:
                self._counts["reserved_chunks"] += sum(acks)
            return acks

        try:
            tensors, offsets = lending.laid_out(conn.staging, items)
        except BaseException:
            held.put_back()
            raise
        return lending.StagedReservation(keys, tensors, offsets, put, held.put_back)

    def _reserve_in_pool(self, held: _Held, items: list[tuple[ChunkKey, Mapping[str, torch.Tensor]]], wait: bool
                         ) -> lending.PoolReservation:
        """One ``reserve`` request for ``items`` (the first :data:`MAX_KEYS`) on the connection ``held``, which the
        reservation holds until it ends."""
        conn = held.conn

        def call(msg: dict[str, Any]) -> dict[str, Any] | None:
            return held.run(lambda: self._links.call(conn, msg))

        def done(acks: list[bool]) -> None:
            if any(acks):
                with self._lock:
                    self._unflushed[conn.server] = self._unflushed.get(conn.server, 0) + sum(acks)
                    self._counts["reserved_chunks"] += sum(acks)
            held.put_back()

        first = items[:MAX_KEYS]
        distinct: dict[OutSpec, int] = {}
        outs = [distinct.setdefault(tuple((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in like.items()),
                                    len(distinct)) for _, like in first]
        nothing = lending.PoolReservation([None] * len(items), None)
        try:
            lending.check_likes(first)
            reply = call({"op": "reserve", "keys": hexes([k for k, _ in first]), "outs": outs, "wait": bool(wait),
                          "specs": [[[n, d, list(shape)] for n, d, shape in one] for one in distinct]})
            if reply is None:
                done([])
                return nothing
            rid = reply.get("id")
            tensors = lending.reserved(conn.pool, first, reply.get("items"))
        except ProtocolError as exc:  # a reply that breaks the protocol: closing the connection aborts it there
            log.warning("tierstore server %s: a reserve reply broke the protocol (%s): put the usual way", self.path,
                        exc)
            held.drop()
            done([])
            return nothing
        except BaseException:
            done([])
            raise
        tensors += [None] * (len(items) - len(first))
        return lending.PoolReservation(tensors, rid if type(rid) is int else None, len(first), call, done)

    @property
    def reserve_limit(self) -> int | None:
        """Bytes one :meth:`reserve` should hold: the server's staging area per connection, or a quarter of the pool
        of a server with trusted writers (a larger one could not take room from its own chunks); ``None`` before
        the server was first reached."""
        return self._links.reserve_bytes or None

    # ------------------------------------------------------------------ questions
    def _ask(self, msg: dict[str, Any], field: str, miss: Any, timeout: float | None = None) -> Any:
        if "keys" in msg:
            keys = msg["keys"]
            if len(keys) > MAX_KEYS:
                raise errors.InvalidInputError(f"at most {MAX_KEYS} keys per call through a server")
            msg = {**msg, "keys": hexes(keys)}
        try:
            return self._links.request(msg, timeout)[field]
        except Unavailable:
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
            reply = self._links.request({"op": "readiness", "keys": hexes(keys), "promote": bool(promote)})
        except Unavailable:
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
            reply = self._links.request({"op": "pin", "keys": hexes(keys)})
        except Unavailable:
            return ServerPin(tuple(keys), 0)
        return ServerPin(tuple(keys), int(reply["ready"]), int(reply["pin"]))

    def release(self, pin: ServerPin) -> None:
        pid, pin.id = pin.id, 0
        if pid:
            try:
                self._links.request({"op": "unpin", "pin": pid})
            except Unavailable:
                pass  # the server is gone, and the pin with it

    def delete(self, keys: ChunkKey | Sequence[ChunkKey]) -> int:
        keys = check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        return int(self._ask({"op": "delete", "keys": keys}, "n", 0))

    def evict(self, keys: ChunkKey | Sequence[ChunkKey], tier: str) -> int:
        keys = check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        return int(self._ask({"op": "evict", "keys": keys, "tier": str(tier)}, "n", 0))

    def flush(self, timeout: float | None = None) -> Any:
        """As :meth:`TieredStore.flush` on the server's store: waits (``timeout=None``: as long as the server
        is alive and says it is still flushing) until what was put reached every tier.

        Raises:
            ServerUnavailableError: the server cannot be reached, or puts this client made were acknowledged
                by a server that has since gone (a restart): nothing can confirm them (they are then forgotten:
                put them again). The message says how many.
        """
        from ..writeback import FlushReport

        wait = None if timeout is None else float(timeout)
        with self._lock:
            before = dict(self._unflushed)
        try:
            with self._links.connection() as conn:
                reply = self._links.call(conn, {"op": "flush", "timeout": wait, "beat": min(BEAT * self.timeout, 5.0)})
                server = conn.server
        except Unavailable:
            raise ServerUnavailableError(f"tierstore server at {self.path} cannot be reached") from None
        with self._lock:  # puts acknowledged before the flush began are settled now, one way or the other
            for sid, n in before.items():
                left = self._unflushed.get(sid, 0) - n
                if left > 0:
                    self._unflushed[sid] = left
                else:
                    self._unflushed.pop(sid, None)
        lost = sum(n for sid, n in before.items() if sid != server)
        if lost:
            raise ServerUnavailableError(f"{lost} puts were acknowledged by a tierstore server at {self.path} that "
                                         f"has since restarted (now server {server}): this flush cannot confirm "
                                         "them; put them again")
        failed, dropped = _keyed(reply["failed"]), _keyed(reply["dropped"])
        if failed:
            raise WriteBackError(failed, dropped)
        return FlushReport(dropped)

    def stats(self) -> dict[str, Any]:
        """The server store's ``stats()`` with a ``server`` section, and this client's own ``client`` section."""
        try:
            out = dict(self._links.request({"op": "stats"})["stats"])
        except Unavailable:
            out = {"tiers": {}, "server": None}
        with self._lock:
            out["client"] = {**self._links.snapshot(), **self._counts, **self._places.snapshot()}
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
        if os.getpid() != self._pid:  # its sockets are the parent's too: a reply could reach the wrong process
            raise ForkedError(f"this client was opened in process {self._pid} before it forked: open one in the "
                              "child (tierstore.open) after the fork")
        if self._closed:
            raise ClosedError("store is closed")

    def close(self, timeout: float | None = None) -> None:
        """Wait for this client's calls in flight, then close its connections (the server keeps the data). In a
        child forked after open, returns at once (the parent's connections and threads are the parent's)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._async.shutdown(wait=True)
        self._links.close()

    def __enter__(self) -> ServerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ServerStore {self.url}>"


class _Held:
    """A connection a reservation holds until it ends (:meth:`put_back`); broken once an exchange on it failed."""

    def __init__(self, links: Links, conn: Link):
        self.links, self.conn, self.broken = links, conn, False

    def run(self, exchange: Callable[[], T]) -> T | None:
        """``exchange()`` on the connection; ``None`` if the server cannot be reached (or could not before)."""
        if self.broken:
            return None
        try:
            return exchange()
        except Unavailable:  # dropped by Links.call: the server gives back what the connection held
            self.broken = True
            return None
        except errors.TierstoreError:  # an error reply: the stream is in step
            raise
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        self.broken = True
        self.conn.close()

    def put_back(self) -> None:
        self.links.put_back(self.conn, self.broken)


def _keyed(named: Mapping[str, Sequence[str]]) -> dict[ChunkKey, tuple[str, ...]]:
    return {ChunkKey.from_hex(k): tuple(v) for k, v in named.items()}
