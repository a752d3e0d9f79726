"""The one-copy KV path through a node server: :meth:`ServerStore.lend <.client.ServerStore.lend>` and
:meth:`ServerStore.reserve <.client.ServerStore.reserve>`, the forms of :meth:`TieredStore.lend
<tierstore.TieredStore.lend>` and :meth:`TieredStore.reserve <tierstore.TieredStore.reserve>` that
:mod:`tierstore.kv.transfer` uses.

**A load** asks the server to lend the chunks its pool holds (one ``lend`` request per window: a lease, nothing
read from a lower tier) and scatters them straight from the pool, mapped read-only here, into the engine's
blocks: one copy. The lease pins them, but one that outlives the server's ``lease_ttl`` is taken back and its
memory may then be reused while the copy runs, so after the copy each chunk's *stamp* is read again
(:mod:`.places`): a chunk whose stamp changed is reported by :meth:`ServerLoan.changed` and the load treats it
as a miss (its blocks are recomputed, never used with another value's bytes).

**A save** to a server with ``trusted_writers`` (:class:`PoolReservation`) gathers the blocks straight into pool
runs the server reserved for the keys (:mod:`.reserving`) and commits them with one request: one copy, nothing
visible to readers before the commit, everything given back on an abort, an error or this process dying.

**A save to any other server** cannot write into the pool: it is sealed against every client's writes, so that
no client can touch data others read (:mod:`.shm`). A reservation is made in the connection's staging area: the
blocks are gathered straight into it, and the commit is one ``put`` request naming where they lie — the server
copies them into its pool. Two copies, not three (no buffer of this process's in between). Until the commit the
server has seen nothing: an abort, an error or this process dying leaves no trace there and holds nothing.
A reservation holds its connection until it is committed or aborted; what does not fit the staging area is
not reserved (``None``: put the usual way).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidInputError
from ..keys import ChunkKey
from ..tensors import TensorDict, dtype_name
from .places import stamp_holds
from .protocol import MAX_KEYS, ProtocolError, parse_spec, place, spec, views


class ServerLoan:
    """What :meth:`ServerStore.lend <.client.ServerStore.lend>` lent: per key the chunk's tensors, views of the
    server's pool, or ``None``. :meth:`changed` after the copies, :meth:`close` then (a second does nothing)."""

    def __init__(self, tensors: list[TensorDict | None], marks: list[tuple[int, int] | None],
                 words: torch.Tensor | None = None, release: Callable[[], None] | None = None):
        self.tensors, self.marks = tensors, marks
        self._words, self._release = words, release

    def changed(self) -> list[int]:
        """Indices of the lent chunks whose pool memory went to another value since they were lent (their
        stamp no longer holds): a copy made from them may hold another value's bytes. Call it once the copies
        out of them are done."""
        words = self._words
        if words is None:
            return []
        return [i for i, m in enumerate(self.marks) if m is not None and not stamp_holds(words, m[0], m[1])]

    def close(self) -> None:
        """Give the lease back (with the connection's next request, or its idle pass)."""
        release, self._release = self._release, None
        if release is not None:
            release()


def lent(n: int, items: Any, pool: torch.Tensor, words: torch.Tensor, release: Callable[[], None] | None
         ) -> ServerLoan:
    """The loan a ``lend`` reply's ``items`` describe (for the first of ``n`` keys: :data:`MAX_KEYS` at most);
    ``release`` gives its lease back. A reply that breaks the protocol gives it back and raises
    :class:`~.protocol.ProtocolError`."""
    loan = ServerLoan([None] * n, [None] * n, words, release)
    try:
        if not isinstance(items, list) or len(items) != min(n, MAX_KEYS):
            raise ProtocolError("lend: one item per key")
        size = pool.numel()
        for i, item in enumerate(items):
            if item is None:
                continue
            if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int and type(item[1]) is int):
                raise ProtocolError("lend: an item is [stamp, word, tensors]")
            loan.tensors[i] = views(pool, parse_spec(item[2], size))
            loan.marks[i] = (item[0], item[1]) if item[0] else None
    except BaseException:
        loan.close()
        raise
    return loan


#: one chunk of a put request: ``{"k": key, "t": tensor specs in the staging area}``
Wire = dict[str, Any]


class StagedReservation:
    """What :meth:`ServerStore.reserve <.client.ServerStore.reserve>` reserved: per key views of a connection's
    staging area to fill, or ``None``. Commit or abort exactly once (a context manager aborts)."""

    def __init__(self, keys: Sequence[ChunkKey], tensors: list[dict[str, torch.Tensor] | None],
                 offsets: list[list[int] | None], put: Callable[[list[Wire]], list[bool]] | None = None,
                 done: Callable[[], None] | None = None):
        self._keys, self.tensors, self._offsets = list(keys), tensors, offsets
        self._put, self._done = put, done

    def commit(self, which: Sequence[bool] | None = None) -> list[bool]:
        """Put the reserved chunks (those with ``which[i]`` true, default all) from where they were filled; per
        key whether the server stored it (``False`` where nothing was reserved or the server could not be
        reached)."""
        ok = [False] * len(self._keys)
        put, self._put = self._put, None
        if put is None:
            return ok
        chosen = [i for i, t in enumerate(self.tensors) if t is not None and (which is None or which[i])]
        wire = [{"k": self._keys[i].hex(), "t": spec(t, o)} for i in chosen
                if (t := self.tensors[i]) is not None and (o := self._offsets[i]) is not None]
        if wire:
            for i, stored in zip(chosen, put(wire), strict=True):
                ok[i] = bool(stored)
        self.abort()
        return ok

    def abort(self) -> None:
        """Give the connection back: the server never saw what was filled."""
        self._put = None
        done, self._done = self._done, None
        if done is not None:
            done()

    def __enter__(self) -> StagedReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class PoolReservation:
    """What :meth:`ServerStore.reserve <.client.ServerStore.reserve>` reserved in the pool of a server with trusted
    writers: per key views of the pool (mapped writable here) to fill, or ``None``. Commit or abort exactly once
    (a context manager aborts); ``call`` sends a request on the connection the reservation holds and answers
    its reply, or ``None`` if the server cannot be reached."""

    def __init__(self, tensors: list[dict[str, torch.Tensor] | None], rid: int | None, sent: int = 0,
                 call: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
                 done: Callable[[list[bool]], None] | None = None):
        self.tensors, self._id, self._sent = tensors, rid, sent  # the server knows the first ``sent`` keys
        self._call, self._done = call, done

    def commit(self, which: Sequence[bool] | None = None) -> list[bool]:
        """Publish the reserved chunks (``which[i]`` true, default all; the rest are given back); per key whether
        the server stored it (none if the server took the reservation back: it outlived ``lease_ttl``)."""
        ok = [False] * len(self.tensors)
        call, self._call = self._call, None
        try:
            if call is not None and self._id is not None:
                chosen = [t is not None and (which is None or bool(which[i]))
                          for i, t in enumerate(self.tensors[:self._sent])]
                reply = call({"op": "commit", "id": self._id, "which": chosen})
                acks = reply.get("acks") if reply is not None else None
                if isinstance(acks, list) and len(acks) == self._sent:
                    ok[:self._sent] = [bool(a) for a in acks]
        finally:
            self._finish(ok)
        return ok

    def abort(self) -> None:
        """Give every run back; nothing of it was published."""
        call, self._call = self._call, None
        try:
            if call is not None and self._id is not None:
                call({"op": "abort", "id": self._id})
        finally:
            self._finish([])

    def _finish(self, acks: list[bool]) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(acks)

    def __enter__(self) -> PoolReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def reserved(pool: torch.Tensor, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]], offsets: Any
             ) -> list[dict[str, torch.Tensor] | None]:
    """Per key the views of ``pool`` a ``reserve`` reply's ``offsets`` name for ``items``' tensors (``None`` where
    it reserved nothing). A reply that breaks the protocol raises :class:`~.protocol.ProtocolError`."""
    if not isinstance(offsets, list) or len(offsets) != len(items):
        raise ProtocolError("reserve: one item per key")
    out: list[dict[str, torch.Tensor] | None] = []
    for (_, like), where in zip(items, offsets, strict=True):
        if where is None:
            out.append(None)
            continue
        if not isinstance(where, list) or len(where) != len(like):
            raise ProtocolError("reserve: an item is one offset per tensor")
        out.append(views(pool, parse_spec([[n, dtype_name(t.dtype), list(t.shape), off]
                                           for (n, t), off in zip(like.items(), where, strict=True)], pool.numel())))
    return out


def check_likes(items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]]) -> None:
    """Raise :class:`~tierstore.InvalidInputError` for a ``like`` that is no chunk (no tensors, an empty or repeated
    name, an unknown dtype)."""
    for key, like in items:
        try:
            parse_spec([[n, dtype_name(t.dtype), list(t.shape), 0] for n, t in like.items()], 1 << 62)
        except ProtocolError as exc:
            raise InvalidInputError(f"reserve {key.hex()[:16]}: {exc}") from None


def laid_out(staging: torch.Tensor, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]]
             ) -> tuple[list[dict[str, torch.Tensor] | None], list[list[int] | None]]:
    """``items``' chunks (shaped like their ``like`` tensors) laid out in ``staging`` in order, as many as fit (and
    at most :data:`MAX_KEYS`): per key its views and their offsets, or ``None``. A ``like`` that is no chunk
    (no tensors, an empty or repeated name, an unknown dtype) raises :class:`~tierstore.InvalidInputError`."""
    size, pos = staging.numel(), 0
    tensors: list[dict[str, torch.Tensor] | None] = [None] * len(items)
    offsets: list[list[int] | None] = [None] * len(items)
    for i, (_, like) in enumerate(items[:MAX_KEYS]):
        where, end = place([t.nbytes for t in like.values()], pos)
        if end > size:
            break
        try:
            specs = parse_spec([[n, dtype_name(t.dtype), list(t.shape), off]
                                for (n, t), off in zip(like.items(), where, strict=True)], size)
        except ProtocolError as exc:
            raise InvalidInputError(f"reserve {items[i][0].hex()[:16]}: {exc}") from None
        tensors[i], offsets[i], pos = views(staging, specs), where, end
    return tensors, offsets
