"""One client of a node server (:mod:`.server`): its socket, staging area, leases and pins, and the thread
that answers its requests in order. Everything it holds goes back when its socket closes."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import errors
from ..store import Loan
from ..tensors import byte_alias
from . import access, shm
from .protocol import (
    FEATURES,
    VERSION,
    FrameTooLarge,
    ProtocolError,
    Reader,
    Spec,
    encode,
    error_reply,
    keys_field,
    nbytes_of,
    parse_spec,
    place,
    set_timeouts,
    spec,
    views,
)
from .protocol import (
    field as get_field,
)
from .reserving import Reservations

if TYPE_CHECKING:
    from .server import NodeServer

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    loan: Loan
    nbytes: int
    since: float


class Connection:
    """One client's socket, staging area, leases and pins; its thread answers its requests in order."""

    def __init__(self, server: NodeServer, sock: socket.socket, peer: access.Peer):
        self.server, self.sock, self.peer = server, sock, peer
        set_timeouts(sock, send=server.config.send_timeout, receive=server.config.hello_timeout)
        self.reader = Reader(sock)
        self.store = server.store
        self.thread = threading.Thread(target=self._run, name=f"tierstore-serve-{peer.pid}", daemon=True)
        self._lock = threading.Lock()
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = 0
        self._staging_fd = -1
        self.staging = shm.map_bytes(-1, 0)
        self._handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "get": self._get, "lend": self._lend, "put": self._put, "contains": self._contains, "lookup": self._lookup,
            "locate": self._locate, "readiness": self._readiness, "where": self._where, "holders": self._holders,
            "prefetch": self._prefetch, "pin": self._pin, "unpin": self._unpin, "delete": self._delete,
            "evict": self._evict, "flush": self._flush, "stats": self._stats, "ping": lambda msg: {},
        }
        self.reservations = Reservations(self.store.reserve, server.pool.offset_of)
        #: what this connection offers beyond protocol 2's first form (:mod:`.protocol`)
        self.features = FEATURES + (("reserve",) if server.config.trusted_writers else ())
        if server.config.trusted_writers:  # puts filled straight into the pool (.reserving)
            self._handlers.update(reserve=self._reserve, commit=self._commit, abort=self._abort)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            if self._hello():
                while True:
                    try:
                        msg = self.reader.request()
                    except FrameTooLarge:
                        raise
                    except ProtocolError as exc:  # a bad frame: answered, and the stream goes on
                        self._count("protocol_errors")
                        self._answer_with(error_reply(exc))
                        continue
                    if msg["op"] == "release":
                        self._settle(msg.get("leases"), msg.get("touch"))
                    else:
                        self._answer(msg)
        except ProtocolError as exc:
            self._count("protocol_errors")
            self._send(error_reply(exc))
        except (ConnectionError, OSError):
            pass  # the client went away (or was dropped): what it held goes back below
        except Exception:  # noqa: BLE001 - never take the server down for one client
            log.exception("client pid %d: unexpected error", self.peer.pid)
        finally:
            self._drop()

    def _hello(self) -> bool:
        msg = self.reader.request()  # within hello_timeout, then no receive timeout: a client may idle
        set_timeouts(self.sock, send=self.server.config.send_timeout, receive=0)
        version = msg.get("version")
        if msg["op"] != "hello" or version != VERSION:
            self._count("protocol_errors")
            self._send(error_reply(ProtocolError(
                f"this server speaks protocol {VERSION}; say hello with it first (got {msg['op']!r}, {version!r})")))
            return False
        size = self.server.config.staging
        self._staging_fd = shm.create(f"tierstore-staging-{self.peer.pid}", size)
        self.staging = shm.map_bytes(self._staging_fd, size)
        store = self.store
        reply = {"ok": True, "version": VERSION, "features": self.features, "server": self.server.id,
                 "pool": self.server.pool.capacity,
                 "staging": size, "tiers": [{"name": lv.name, "kind": lv.kind, "shared": lv.shared}
                                            for lv in store.tiers]}
        return self._send(reply, (self.server._pool_fd, self._staging_fd))

    def _answer(self, msg: dict[str, Any]) -> None:
        handler = self._handlers.get(msg["op"])
        # Leases the client is done with and chunks it read straight from the pool, carried by this request.
        # A get settles them after its reply (while the client copies): a get needs no room, and the reply is
        # on the client's critical path.
        carried = "release" in msg or "touch" in msg
        later = carried and msg["op"] == "get"
        if carried and not later:
            self._settle(msg.get("release"), msg.get("touch"))
        try:
            if handler is None:
                raise ProtocolError(f"unknown message type {msg['op']!r}")
            reply = {"ok": True, **handler(msg)}
        except ProtocolError as exc:
            self._count("protocol_errors")
            reply = error_reply(exc)
        except (errors.TierstoreError, ValueError, TypeError, KeyError, MemoryError) as exc:
            reply = error_reply(exc)
        self._answer_with(reply)
        if later:
            self._settle(msg.get("release"), msg.get("touch"))

    def _answer_with(self, reply: dict[str, Any]) -> None:
        if not self._send(reply):
            raise ConnectionError("reply not taken")

    def _send(self, reply: Mapping[str, Any], fds: tuple[int, ...] = ()) -> bool:
        """Send one reply within ``send_timeout``; a client that does not take it is dropped."""
        try:
            frame = encode(reply)
        except ProtocolError as exc:
            frame = encode(error_reply(exc))
        try:
            if fds:
                sent = socket.send_fds(self.sock, [frame], list(fds))
                self.sock.sendall(frame[sent:])
            else:
                self.sock.sendall(frame)
            return True
        except OSError:
            self._count("dropped")
            log.warning("client pid %d does not take its replies: dropped", self.peer.pid)
            self.hang_up()
            return False

    def hang_up(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _drop(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            lease.loan.close()
        self.reservations.expire()  # a client gone mid-fill: nothing of it is published
        self.server._gone(self)
        self.sock.close()
        if self._staging_fd >= 0:
            os.close(self._staging_fd)
            self._staging_fd = -1

    def _count(self, what: str) -> None:
        with self.server._lock:
            self.server.counts[what] += 1

    # ------------------------------------------------------------------ leases
    def expire(self, before: float) -> tuple[int, int]:
        """Take back leases and reservations made before ``before``; how many of each."""
        with self._lock:
            old = [lid for lid, lease in self._leases.items() if lease.since < before]
            gone = [self._leases.pop(lid) for lid in old]
        for lease in gone:
            lease.loan.close()
        return len(gone), self.reservations.expire(before)

    def held_stats(self) -> tuple[int, int, int, int]:
        """Leases and their bytes, reservations and theirs."""
        with self._lock:
            leases = len(self._leases), sum(lease.nbytes for lease in self._leases.values())
        return (*leases, *self.reservations.stats())

    def _settle(self, leases: Any, touched: Any) -> None:
        """Give back ``leases`` (ids) and count ``touched`` (keys as on the wire: chunks the client read straight
        from the pool) as top-tier hits, their recency in the pool's LRU order. Malformed fields are ignored."""
        if isinstance(touched, str) and touched:
            try:
                keys = keys_field({"op": "touch", "keys": touched})
            except ProtocolError:
                self._count("protocol_errors")
            else:
                self.store.lend(keys).close()
        if isinstance(leases, list) and leases:
            self._release(leases)

    def _release(self, ids: list[Any]) -> None:
        with self._lock:
            gone = [lease for lid in ids if type(lid) is int and (lease := self._leases.pop(lid, None))]
        for lease in gone:
            lease.loan.close()

    # ------------------------------------------------------------------ data
    def _get(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Per key: ``None`` (a miss), ``0`` (did not fit the staging area: ask again), ``1`` (the chunk does
        not match the client's ``out``: a miss), ``[region, stamp, word, offset, ...]`` (region 0 the pool, 1
        the staging area; in the pool the chunk's stamp and its word's byte offset, else 0, 0; one offset per
        tensor of the client's ``out``, in its order) or, for a client without ``out``, ``{"p" | "s": tensor
        specs}``."""
        keys = keys_field(msg)
        wants = _wanted(msg, len(keys))
        loan = self.store.lend(keys)
        items: list[Any] = [None] * len(keys)
        offset_of = self.server.pool.offset_of
        lent = 0
        for i, tensors in enumerate(loan.tensors):
            if tensors is None:
                continue
            if wants is None:
                items[i] = {"p": spec(tensors, [offset_of(t) for t in tensors.values()])}
            elif _matches(tensors, wants[i]):
                items[i] = [0, *(loan.marks[i] or (0, 0)), *[offset_of(tensors[name]) for name, _, _, _ in wants[i]]]
            else:
                items[i] = 1
                continue
            lent += sum(t.nbytes for t in tensors.values())
        rest = [i for i, t in enumerate(loan.tensors) if t is None]
        if rest:
            self._stage(keys, wants, rest, items)
        return self._leased(loan, lent, {"items": items})

    def _lend(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Per key: ``None`` (the pool does not hold it: nothing else is tried) or ``[stamp, word, specs]`` (the
        chunk's stamp and its word's byte offset, 0, 0 if unstamped; its tensors where they lie in the pool)."""
        loan = self.store.lend(keys_field(msg))
        offset_of = self.server.pool.offset_of
        items: list[Any] = []
        lent = 0
        for tensors, mark in zip(loan.tensors, loan.marks or [None] * len(loan.tensors), strict=True):
            if tensors is None:
                items.append(None)
                continue
            items.append([*(mark or (0, 0)), spec(tensors, [offset_of(t) for t in tensors.values()])])
            lent += sum(t.nbytes for t in tensors.values())
        return self._leased(loan, lent, {"items": items})

    def _leased(self, loan: Loan, lent: int, reply: dict[str, Any]) -> dict[str, Any]:
        """``reply`` with the id of the lease that now holds ``loan`` (closed at once if it lent nothing)."""
        if lent:
            with self._lock:
                self._lease_ids += 1
                lid = self._lease_ids
                self._leases[lid] = _Lease(loan, lent, time.monotonic())
            reply["lease"] = lid
        else:
            loan.close()
        return reply

    def _stage(self, keys: list[Any], wants: list[list[Spec]] | None, rest: list[int], items: list[Any]) -> None:
        """Read the chunks the pool does not hold into the staging area: straight into place when the client
        said what it expects, else read and copied in; what does not fit is marked to be asked again."""
        size, pos = self.staging.numel(), 0
        if wants is not None:
            placed, targets = [], []
            for i in rest:
                offsets, end = place([nbytes_of(d, s) for _, d, s, _ in wants[i]], pos)
                if end > size:
                    items[i] = 0
                    continue
                placed.append((i, offsets))
                targets.append(views(self.staging, [(n, d, s, off) for (n, d, s, _), off
                                                    in zip(wants[i], offsets, strict=True)]))
                pos = end
            got = self.store.get_many([keys[i] for i, _ in placed], out=targets) if placed else []
            for (i, offsets), value in zip(placed, got, strict=True):
                if value is not None:
                    items[i] = [1, 0, 0, *offsets]
            return
        got = self.store.get_many([keys[i] for i in rest])
        for i, value in zip(rest, got, strict=True):
            if value is None:
                continue
            offsets, end = place([t.nbytes for t in value.values()], pos)
            if end > size:
                items[i] = 0
                continue
            for t, off in zip(value.values(), offsets, strict=True):
                self.staging[off:off + t.nbytes].copy_(byte_alias(t.contiguous()))
            items[i] = {"s": spec(value, offsets)}
            pos = end

    def _offset(self, t: Any) -> int:
        return int(t.data_ptr() - self.staging.data_ptr())

    def _put(self, msg: dict[str, Any]) -> dict[str, Any]:
        raw = get_field(msg, "items", list)
        if len(raw) > 4096:
            raise ProtocolError("put: too many items")
        size = self.staging.numel()
        items = []
        for entry in raw:
            if not isinstance(entry, dict):
                raise ProtocolError("put: an item is {'k': key, 't': tensors}")
            (key,) = keys_field({"op": "put", "keys": entry.get("k")})
            items.append((key, views(self.staging, parse_spec(entry.get("t"), size))))
        return {"acks": self.store.put_many(items)}

    def _reserve(self, msg: dict[str, Any]) -> dict[str, Any]:
        keys = keys_field(msg)
        wants = _wanted(msg, len(keys))
        if wants is None:
            raise ProtocolError("reserve: specs and outs name each key's tensors")
        return self.reservations.open(keys, wants, bool(get_field(msg, "wait", bool, True)))

    def _commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        which = get_field(msg, "which", list, None)
        if which is not None and not all(isinstance(w, bool) for w in which):
            raise ProtocolError("commit: which is a list of booleans")
        return {"acks": self.reservations.commit(get_field(msg, "id", int), which)}

    def _abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.reservations.abort(get_field(msg, "id", int))
        return {}

    # ------------------------------------------------------------------ control
    def _contains(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"found": self.store.contains_many(keys_field(msg))}

    def _lookup(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"n": self.store.lookup(keys_field(msg), probe=bool(get_field(msg, "probe", bool, True)))}

    def _locate(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"tiers": self.store.locate(keys_field(msg), probe=bool(get_field(msg, "probe", bool, True)),
                                           local=bool(get_field(msg, "local", bool, False)))}

    def _readiness(self, msg: dict[str, Any]) -> dict[str, Any]:
        r = self.store.readiness(keys_field(msg), promote=bool(get_field(msg, "promote", bool, True)))
        return {"ready": r.ready, "pending": r.pending}

    def _where(self, msg: dict[str, Any]) -> dict[str, Any]:
        (key,) = keys_field(msg)
        return {"tier": self.store.where(key)}

    def _holders(self, msg: dict[str, Any]) -> dict[str, Any]:
        (key,) = keys_field(msg)
        return {"tiers": self.store.holders(key)}

    def _prefetch(self, msg: dict[str, Any]) -> dict[str, Any]:
        future = self.store.prefetch(keys_field(msg))
        if not get_field(msg, "wait", bool, False):
            return {}
        return {"n": future.result(timeout=get_field(msg, "timeout", (int, float), 60.0))}

    def _pin(self, msg: dict[str, Any]) -> dict[str, Any]:
        pin = self.store.pin(keys_field(msg))
        return {"pin": self.server.pin(self, pin), "ready": pin.ready}

    def _unpin(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.server.unpin(self, get_field(msg, "pin", int))
        return {}

    def _delete(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"n": self.store.delete(keys_field(msg))}

    def _evict(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"n": self.store.evict(keys_field(msg), tier=get_field(msg, "tier", str))}

    def _flush(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The store's flush; with ``beat`` (seconds), ``{"ok": true, "beat": true}`` frames that often while it
        runs, so that a client waits for a long flush as long as the server is alive (and no longer)."""
        timeout = get_field(msg, "timeout", (int, float, type(None)), None)
        beat = get_field(msg, "beat", (int, float), None)
        if beat is None:
            return self._flush_now(timeout)
        result: list[dict[str, Any]] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(self._flush_now(timeout))
            except BaseException as exc:  # noqa: BLE001 - raised again on the connection's thread
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"tierstore-serve-flush-{self.peer.pid}", daemon=True).start()
        while not done.wait(max(float(beat), 0.05)):
            self._answer_with({"ok": True, "beat": True})
        if failure:
            raise failure[0]
        return result[0]

    def _flush_now(self, timeout: float | None) -> dict[str, Any]:
        try:
            report = self.store.flush(timeout)
        except errors.WriteBackError as exc:
            return {"failed": _named(exc.failed), "dropped": _named(exc.dropped)}
        return {"failed": {}, "dropped": _named(report.dropped)}

    def _stats(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"stats": {**self.store.stats(), "server": self.server.stats()}}


def _named(chunks: Mapping[Any, tuple[str, ...]]) -> dict[str, list[str]]:
    return {k.hex(): list(v) for k, v in chunks.items()}


def _wanted(msg: dict[str, Any], n: int) -> list[list[Spec]] | None:
    """The ``out`` each key of a get expects: ``specs`` (distinct tensor lists, ``[name, dtype, shape]`` each)
    and ``outs`` (per key, an index into ``specs``); ``None`` if the client has no ``out``."""
    specs = get_field(msg, "specs", list, None)
    if specs is None:
        return None
    if len(specs) > n:
        raise ProtocolError("get: more specs than keys")
    parsed = [_parsed_out(one) for one in specs]
    index = get_field(msg, "outs", list)
    if len(index) != n or not all(type(j) is int and 0 <= j < len(parsed) for j in index):
        raise ProtocolError("get: outs must give each key the index of its spec")
    return [parsed[j] for j in index]


@functools.lru_cache(maxsize=256)
def _parse_out(text: str) -> list[Spec]:
    one = json.loads(text)
    if not isinstance(one, list) or not all(isinstance(x, list) and len(x) == 3 for x in one):
        raise ProtocolError("get: an out is a list of [name, dtype, shape]")
    return parse_spec([[*x, 0] for x in one], 1 << 62)


def _parsed_out(one: Any) -> list[Spec]:
    """One ``out``'s tensor list, validated once per distinct list (an engine asks with the same few)."""
    return _parse_out(json.dumps(one))


def _matches(tensors: Mapping[str, Any], want: list[Spec]) -> bool:
    if len(tensors) != len(want):
        return False
    for name, dtype, shape, _ in want:
        t = tensors.get(name)
        if t is None or t.dtype != dtype or tuple(t.shape) != shape:
            return False
    return True


