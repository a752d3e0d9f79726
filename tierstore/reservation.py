"""Puts by reservation: pool memory of the top tier set aside for keys, filled by the caller, then committed.

A :meth:`~tierstore.TieredStore.put_many` copies the caller's tensors into the host pool. A caller that would
first have to produce those tensors (``KVCacheStore.save_from`` gathers them out of an engine's paged cache)
can instead write them straight into the pool: :func:`reserve` takes, per key, the same steps a put takes
before its copy — a new generation, the ``(key, tier)`` slot, room in the tier's byte budget (evicting as a
put does: least recently used first, dirty victims written below first) and a run of the pool — and hands out
views of that run shaped like the chunk. The caller fills them; :meth:`Reservation.commit` then publishes each
chunk exactly as a put publishes its copy (the backend first, then the residency: pending below, write-back
queued), :meth:`Reservation.abort` gives everything back. Before the commit no reader, lookup or eviction sees
anything of a reserved key's new value; an abort (or an error, or leaving the ``with`` block) leaves no trace.
``wait=False`` (a caller that must not block: an engine's forward thread) takes room only from free memory and
clean victims, never writes a dirty one down and waits for nothing; a key without room now gets ``None``.

Only a top tier with a pool reserves (``host`` with its pool, under ``write_back``): a key it cannot reserve
gets ``None`` and is put the usual way. A reservation touches nothing of its store but what the store hands it
as an :class:`Owner` (its residency, its transfers, its call lifecycle and its put counter).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .keys import ChunkKey
from .residency import Slot
from .transfers import ENOMEM_ROUNDS

if TYPE_CHECKING:
    from .lifecycle import Lifecycle
    from .residency import Residency
    from .transfers import Tier, Transfers


@dataclass(frozen=True)
class Owner:
    """What a reservation uses of its store, handed over by the store: the steps of a put before and after its
    copy (``residency``: generations, slots, bytes; ``transfers``: making room, evicting, removing stale copies
    below), the store's call lifecycle (an open reservation is a running call: ``close()`` waits for it) and
    ``count_puts`` (the store's put counter)."""

    residency: Residency
    transfers: Transfers
    life: Lifecycle
    count_puts: Callable[[int], None]


@dataclass
class _Held:
    key: ChunkKey
    gen: int
    size: int
    reserved: int
    run: Any
    tensors: dict[str, torch.Tensor]


class Reservation:
    """Pool memory reserved for some keys (see the module docstring). ``tensors[i]``: views to fill for
    ``keys[i]``, or ``None`` where nothing was reserved. Commit or abort exactly once (a context manager
    aborts what was not committed)."""

    def __init__(self, owner: Owner, tier: Tier | None, held: list[_Held | None]):
        self._owner, self._tier, self._held = owner, tier, held
        self.tensors: list[dict[str, torch.Tensor] | None] = [None if h is None else h.tensors for h in held]
        self._open = tier is not None and any(h is not None for h in held)
        if not self._open:
            owner.life.leave()

    def commit(self, which: Sequence[bool] | None = None) -> list[bool]:
        """Publish the reserved chunks (those with ``which[i]`` true, default all; the others are aborted).
        Their tensors must hold their bytes (CUDA copies into them synchronized). Per key whether it is stored."""
        ok = [False] * len(self._held)
        if not self._open:
            return ok
        assert self._tier is not None
        tier, owner, res = self._tier, self._owner, self._owner.residency
        try:
            for i, h in enumerate(self._held):
                if h is None or (which is not None and not which[i]):
                    continue
                tier.backend.publish_run(h.key, h.run, h.tensors)  # type: ignore[attr-defined]
                self._held[i] = None  # published: from here on it is the key's value
                stale = res.commit_write(h.key, tier.index, h.gen, h.size, h.reserved, put=True)
                tier.count(puts=1, bytes_in=h.size)
                ok[i] = True
                owner.transfers.remove_stale(h.key, stale)
        finally:
            owner.count_puts(sum(ok))
            self.abort()  # the ones not asked for, or left by an error
        return ok

    def abort(self) -> None:
        """Give back every chunk not committed: its pool run, its bytes and its slot; nothing was visible."""
        if not self._open:
            return
        try:
            for i, h in enumerate(self._held):
                if h is not None:
                    self._held[i] = None
                    self._give_back(h)
        finally:
            self._close()

    def _give_back(self, h: _Held) -> None:
        assert self._tier is not None
        self._tier.backend.cancel_run(h.run)  # type: ignore[attr-defined]
        self._owner.residency.release(self._tier.index, h.reserved)
        self._owner.residency.abort_write(h.key, self._tier.index, h.gen)

    def _close(self) -> None:
        if self._open:
            self._open = False
            self._owner.life.leave()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def reservable(store: Any) -> Tier | None:
    """The tier a put of ``store`` lands in first if it can reserve pool memory there, else ``None``."""
    from .config import WritePolicy

    if getattr(store, "write_policy", None) is not WritePolicy.WRITE_BACK:
        return None
    for tier in getattr(store, "tiers", ()):
        if tier.writable:
            reserve = getattr(tier.backend, "reserved_size", None)
            return tier if reserve is not None and getattr(tier.backend, "pool", None) is not None else None
    return None


def reserve(owner: Owner, tier: Tier | None, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]],
            wait: bool = True) -> Reservation:
    """Reserve pool memory of ``tier`` (what :func:`reservable` found; ``None``: nothing is reserved) for each
    ``(key, like)``: a chunk with tensors shaped like ``like`` (names, shapes, dtypes; ``meta`` tensors will do).
    Keys the tier cannot take now (too big, no room in time, a busy slot) get ``None`` in
    :attr:`Reservation.tensors`. ``wait=False`` never blocks the caller: room comes only from free memory and
    clean victims (copies a tier below holds, evicted without I/O); no dirty victim is written down, no pin,
    busy slot or write-back is waited for, and a key without room now gets ``None`` (counted ``skipped``)."""
    owner.life.enter()
    held: list[_Held | None] = [None] * len(items)
    if tier is None:
        return Reservation(owner, None, held)
    try:
        deadline = time.monotonic() + (owner.transfers.pin_wait if wait else 0.0)
        capacity, holds = tier.spec.capacity, 0
        for i, (key, like) in enumerate(items):
            size = tier.backend.reserved_size(like)  # type: ignore[attr-defined]
            # wait for room only while others hold it: past the tier's capacity the room lacking is this
            # reservation's own, which no wait frees
            waits = wait and (capacity is None or holds + size <= capacity)
            held[i] = h = _reserve_one(owner, tier, key, like, size, deadline, waits, clean=not wait)
            holds += h.size if h is not None else 0
    except BaseException:
        Reservation(owner, tier, held).abort()
        raise
    return Reservation(owner, tier, held)


def _reserve_one(owner: Owner, tier: Tier, key: ChunkKey, like: Mapping[str, torch.Tensor], size: int,
                 deadline: float, wait: bool, clean: bool = False) -> _Held | None:
    """One key's generation, slot, ``size`` bytes and pool run (each step as a put takes it), or ``None``;
    ``wait`` for room (by ``deadline``) or only take what evicting now gives; ``clean``: evict only clean
    victims."""
    res, index, backend = owner.residency, tier.index, tier.backend
    gen = res.next_gen()
    slot = res.wait_until(lambda: s if (s := res.begin_write(key, index, gen)) is not Slot.BUSY else None, deadline)
    if slot is not Slot.OK:
        tier.count(skipped=1)
        return None
    reserved = 0
    try:
        got = owner.transfers.make_room(key, index, size, deadline, wait, clean=clean)  # as a put makes room
        if got is not None:
            reserved = got
            for _ in range(ENOMEM_ROUNDS + 1):
                try:
                    run, tensors = backend.reserve_run(key, like, size)  # type: ignore[attr-defined]
                    return _Held(key, gen, size, reserved, run, tensors)
                except OSError as exc:  # the pool has the bytes but no contiguous run: evict more, as a put does
                    if exc.errno != errno.ENOMEM:
                        raise
                    for victim in res.reclaim(key, index, size, clean=clean):
                        owner.transfers.evict(victim, deadline)
    except BaseException:
        res.release(index, reserved)
        res.abort_write(key, index, gen)
        raise
    tier.count(skipped=1)
    res.release(index, reserved)
    res.abort_write(key, index, gen)
    return None
