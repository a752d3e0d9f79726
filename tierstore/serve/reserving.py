"""Puts by reservation in a node server's pool, for servers with ``trusted_writers`` (docs/serve.md): the
server side of :meth:`ServerStore.reserve <.client.ServerStore.reserve>`.

A ``reserve`` request names keys and each one's tensor list; the server reserves pool runs for them as
:meth:`TieredStore.reserve <tierstore.TieredStore.reserve>` does in process (room made as a put makes it,
evicting least recently used first) and answers with where each tensor lies in the pool. The client, whose
mapping of the pool is writable, gathers its blocks straight there — one copy — and sends ``commit`` (per key
whether to publish it) or ``abort``. Nothing of a reserved key's new value is visible before the commit.
A reservation belongs to its connection: one that closes (its client killed mid-fill included) aborts what it
held, and one older than ``lease_ttl`` is taken back by the lease reaper; either way its runs and bytes are
given back and nothing is published.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..keys import ChunkKey
from ..reservation import Reservation
from .protocol import Spec


@dataclass
class _Open:
    reservation: Reservation
    n: int
    nbytes: int
    since: float


class Reservations:
    """The reservations one connection holds open. ``reserve`` runs on the connection's thread; ``expire`` on the
    reaper's: whoever takes one out of the table ends it."""

    def __init__(self, reserve: Callable[..., Reservation], offset_of: Callable[[torch.Tensor], int]):
        self._reserve, self._offset_of = reserve, offset_of
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}
        self._ids = 0

    def open(self, keys: list[ChunkKey], wants: list[list[Spec]], wait: bool) -> dict[str, Any]:
        """Reserve pool runs for ``keys`` shaped as ``wants``; the reply: per key ``None`` (nothing reserved: put
        it the usual way) or the byte offset in the pool of each of its tensors, in ``wants``' order, and the
        reservation's ``id`` when it holds any."""
        likes = [{name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape, _ in want}
                 for want in wants]
        reservation = self._reserve(list(zip(keys, likes, strict=True)), wait=wait)
        items: list[list[int] | None] = []
        nbytes = 0
        for tensors, want in zip(reservation.tensors, wants, strict=True):
            if tensors is None:
                items.append(None)
                continue
            items.append([self._offset_of(tensors[name]) for name, _, _, _ in want])
            nbytes += sum(t.nbytes for t in tensors.values())
        if not nbytes:
            reservation.abort()
            return {"items": items}
        with self._lock:
            self._ids += 1
            rid = self._ids
            self._open[rid] = _Open(reservation, len(keys), nbytes, time.monotonic())
        return {"id": rid, "items": items}

    def commit(self, rid: int, which: Sequence[bool] | None) -> list[bool]:
        """Publish reservation ``rid``'s keys (``which[i]`` true, default all; the rest are aborted); per key
        whether it is stored. ``[]`` for a reservation this connection does not hold (taken back, or never
        made): the client counts that as nothing stored."""
        with self._lock:
            held = self._open.pop(rid, None)
        if held is None:
            return []
        if which is not None and len(which) != held.n:
            held.reservation.abort()
            return [False] * held.n
        return held.reservation.commit(which)

    def abort(self, rid: int) -> None:
        with self._lock:
            held = self._open.pop(rid, None)
        if held is not None:
            held.reservation.abort()

    def expire(self, before: float = float("inf")) -> int:
        """Abort the reservations opened before ``before`` (default: all); how many."""
        with self._lock:
            old = [rid for rid, h in self._open.items() if h.since < before]
            gone = [self._open.pop(rid) for rid in old]
        for held in gone:
            held.reservation.abort()
        return len(gone)

    def stats(self) -> tuple[int, int]:
        """Reservations open and the bytes they hold."""
        with self._lock:
            return len(self._open), sum(h.nbytes for h in self._open.values())
