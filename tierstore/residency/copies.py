"""Reads and the copies they find: locating and pinning current copies, indexing what a probe
found, forgetting what a read found missing or damaged, and the removals that follow."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..keys import ChunkKey
from .core import Core
from .model import REMOVING, SIZE_BITS, SIZE_MASK, UNKNOWN, Hold, pack


class Copies(Core):
    """Reads and the copies they find: locating and pinning current copies, indexing what a probe"""

    def found(self, tier: int, key: ChunkKey, size: int, deletes: int) -> int | None:
        """A probe or read of a shared tier found ``key`` stored there, unindexed: index it, unless a delete
        ended since the probe began (``deletes`` was :attr:`deletes` then), the key is being mutated there or
        deleted, or its value here may be older than the current one. The generation it was indexed with, or
        ``None``."""
        with self._lock:
            tr = self.tiers[tier]
            rec = self._keys.get(key)
            if deletes != self.deletes:
                return None
            packed = tr.copies.get(key)
            if packed is not None:
                return packed >> SIZE_BITS if self._current(key, packed) else None
            if rec is not None and (rec.deleting or tier in rec.busy or rec.gen != UNKNOWN or tier in rec.pending):
                return None
            gen = self._gen_of(key)
            self._put_copy(tr, key, pack(gen, size))
            return gen

    def lost(self, tier: int, key: ChunkKey, gen: int, remove: bool) -> bool:
        """A read found the copy of generation ``gen`` missing or damaged: forget it (unless it was replaced
        or is being mutated meanwhile). With ``remove`` (a damaged object on a tier this store owns) the
        caller gets the slot to remove it from storage, then calls :meth:`removed`; returns whether it did."""
        with self._lock:
            tr = self.tiers[tier]
            packed = tr.copies.get(key)
            if packed is None or packed >> SIZE_BITS != gen or key in tr.evicting:
                return False
            rec = self._keys.get(key)
            if rec is not None and (tier in rec.busy or rec.deleting):
                return False
            if remove:
                self._record(key).busy[tier] = REMOVING
                return True
            self._drop_copy(tr, key)
            self._tidy(key)
            self._changed()
            return False

    def claim_stale(self, key: ChunkKey, tier: int) -> bool:
        """Take the slot to remove ``tier``'s copy of ``key`` if it holds an older value and nothing mutates
        it (a put landed below a tier that refused it); then remove it and call :meth:`removed`."""
        with self._lock:
            tr = self.tiers[tier]
            packed = tr.copies.get(key)
            rec = self._keys.get(key)
            if (packed is None or rec is None or packed >> SIZE_BITS == rec.gen or tier in rec.busy
                    or rec.deleting or key in tr.evicting):
                return False
            rec.busy[tier] = REMOVING
            return True

    def removed(self, tier: int, key: ChunkKey) -> None:
        """A removal :meth:`lost` or :meth:`claim_stale` granted is done: the copy is gone from the index too."""
        with self._lock:
            self._drop_copy(self.tiers[tier], key)
            rec = self._keys.get(key)
            if rec is not None:
                rec.busy.pop(tier, None)
            self._tidy(key)
            self._changed()

    def removal_failed(self, tier: int, key: ChunkKey) -> None:
        """A removal :meth:`lost` or :meth:`claim_stale` granted failed: the copy stays indexed (it is still
        in storage). An older value left there is reported by every flush as a tier the key could not reach
        (a restart would find that value), until the key is put or deleted again."""
        with self._lock:
            rec = self._keys.get(key)
            if rec is not None:
                rec.busy.pop(tier, None)
                packed = self.tiers[tier].copies.get(key)
                if packed is not None and packed >> SIZE_BITS != rec.gen:
                    self._flushes.keep_stale(key, tier)
            self._tidy(key)
            self._changed()

    # ------------------------------------------------------------------ reads, pins
    def locate(self, keys: Sequence[ChunkKey], tiers: Iterable[int] | None = None) -> list[int | None]:
        """Per key, the first of ``tiers`` (default: all) holding its current value, from the index alone."""
        order = list(range(len(self.tiers))) if tiers is None else sorted(tiers)
        with self._lock:
            return [self._first_current(k, order) for k in keys]

    def _first_current(self, key: ChunkKey, order: Sequence[int]) -> int | None:
        rec = self._keys.get(key)
        if rec is not None and rec.deleting:
            return None
        for i in order:
            packed = self.tiers[i].copies.get(key)
            if packed is not None and (rec is None or packed >> SIZE_BITS == rec.gen):
                return i
        return None

    def pin(self, keys: Sequence[ChunkKey], tiers: Iterable[int] | None = None, touch: bool = True
            ) -> list[Hold | None]:
        """Pin each key's copy in the first of ``tiers`` holding its current value; ``None`` where none
        does. ``touch`` marks the copies most recently used. Each hold goes back through :meth:`unpin`."""
        order = list(range(len(self.tiers))) if tiers is None else sorted(tiers)
        holds: list[Hold | None] = []
        append, records, new = holds.append, self._keys, tuple.__new__  # a NamedTuple's own __new__ is Python
        candidates = [(i, self.tiers[i]) for i in order]
        with self._lock:
            for key in keys:
                rec = records.get(key)
                found = None
                if rec is None or not rec.deleting:
                    for i, tr in candidates:
                        packed = tr.copies.get(key)
                        if packed is not None and (rec is None or packed >> SIZE_BITS == rec.gen):
                            if touch and key not in tr.evicting:
                                tr.copies.move_to_end(key)
                            pins = tr.pins
                            pins[key] = pins.get(key, 0) + 1
                            found = new(Hold, (key, i, packed & SIZE_MASK, packed >> SIZE_BITS))
                            break
                append(found)
        return holds

    def unpin(self, holds: Iterable[Hold | None]) -> None:
        with self._lock:
            freed = False
            for h in holds:
                if h is None:
                    continue
                pins = self.tiers[h.tier].pins
                n = pins.get(h.key, 0) - 1
                if n > 0:
                    pins[h.key] = n
                else:
                    pins.pop(h.key, None)
                    freed = True
            if freed:  # waiters for room may go on; the write-back scheduler never waits for a pin
                self._cond.notify_all()

    def probe_tiers(self, key: ChunkKey) -> list[int]:
        """Shared tiers where ``key`` may be stored by another process with its current value (to probe)."""
        with self._lock:
            rec = self._keys.get(key)
            if rec is not None and (rec.deleting or rec.gen != UNKNOWN):
                return []
            return [i for i, tr in enumerate(self.tiers) if tr.spec.shared and key not in tr.copies
                    and (rec is None or i not in rec.pending)]

    def current_gen(self, key: ChunkKey, tier: int) -> int | None:
        """The generation of ``tier``'s copy of ``key`` when it holds the current value, else ``None``."""
        with self._lock:
            packed = self.tiers[tier].copies.get(key)
            return packed >> SIZE_BITS if packed is not None and self._current(key, packed) else None

    def holds_current(self, key: ChunkKey, tier: int, gen: int) -> bool:
        """Whether ``tier`` still holds generation ``gen`` of ``key`` as its current value."""
        with self._lock:
            packed = self.tiers[tier].copies.get(key)
            return packed is not None and packed >> SIZE_BITS == gen and self._current(key, packed)

    def writing(self, key: ChunkKey, tier: int) -> bool:
        """Whether a write, promotion or removal of ``key`` in ``tier`` is in flight."""
        with self._lock:
            rec = self._keys.get(key)
            return rec is not None and tier in rec.busy

    # ------------------------------------------------------------------ promotion
    def begin_promote(self, key: ChunkKey, source: int, gen: int, target: int) -> bool:
        """Take the slot to copy generation ``gen`` of ``key``, read from ``source``, into ``target`` — only if
        that is still the current value, ``target`` lacks it and nothing else mutates it there."""
        with self._lock:
            tr = self.tiers[target]
            packed = self.tiers[source].copies.get(key)
            if packed is None or packed >> SIZE_BITS != gen or not self._current(key, packed):
                return False
            have = tr.copies.get(key)
            if have is not None and self._current(key, have):
                return False
            rec = self._record(key)
            if target in rec.busy or rec.deleting:
                self._tidy(key)
                return False
            rec.busy[target] = gen
            return True


__all__ = ["Copies"]
