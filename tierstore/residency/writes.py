"""Writes and deletes of a key: the ``(key, tier)`` slot, the generation a write lands with, what
becomes pending below a put, and deletes that win over writes in flight."""

from __future__ import annotations

from collections.abc import Collection

from ..keys import ChunkKey
from .core import Core
from .model import REMOVING, SIZE_BITS, SIZE_MASK, Slot, pack


class Writes(Core):
    """Writes and deletes of a key: the ``(key, tier)`` slot, the generation a write lands with, what"""

    # ------------------------------------------------------------------ writes
    def begin_write(self, key: ChunkKey, tier: int, gen: int) -> Slot:
        """Take the ``(key, tier)`` slot to write generation ``gen`` there (see :class:`Slot`)."""
        with self._lock:
            rec = self._record(key)
            tr = self.tiers[tier]
            if rec.deleting:
                if gen < rec.deleting:
                    self._tidy(key)
                    return Slot.SUPERSEDED
                return Slot.BUSY
            if tier in rec.busy:
                return Slot.BUSY
            packed = tr.copies.get(key)
            if gen < rec.gen or (packed is not None and packed >> SIZE_BITS > gen):
                self._tidy(key)
                return Slot.SUPERSEDED
            rec.busy[tier] = gen
            return Slot.OK

    def commit_write(self, key: ChunkKey, tier: int, gen: int, size: int, reserved: int, *,
                     put: bool = False, queue: bool = True) -> list[int]:
        """The write of generation ``gen`` into ``tier`` is stored (``size`` bytes, ``reserved`` of them set
        aside): index the copy and release the slot.

        A ``put`` that makes ``gen`` the current value records the writable tiers below as pending (queued
        for write-back unless ``queue`` is false: a ``write_through`` put writes them itself). Returns the
        tiers above ``tier`` whose copies now hold an older value (the put removes them)."""
        with self._lock:
            tr = self.tiers[tier]
            rec = self._record(key)
            rec.busy.pop(tier, None)
            tr.reserved -= reserved
            tr.failing = False
            self._put_copy(tr, key, pack(gen, size))
            stale_above: list[int] = []
            if gen > rec.gen and put:
                rec.gen, rec.tomb = gen, False
                for j in list(rec.pending):
                    self._unpend(key, rec, j)
                for j in self._writable:
                    if j > tier:
                        self._pend(key, rec, j)
                        self._clear_retry(self.tiers[j], key)
                        if queue:
                            self.tiers[j].ready[key] = None
                self._flushes.forget(key)
                stale_above = [j for j in range(tier) if key in self.tiers[j].copies and self.tiers[j].spec.writable]
            elif gen == rec.gen and tier in rec.pending:
                self._unpend(key, rec, tier)
                self._clear_retry(tr, key)
                tr.counts["writeback_done"] += 1
            self._tidy(key)
            self._changed()
            return stale_above

    def abort_write(self, key: ChunkKey, tier: int, gen: int, reserved: int = 0, failed: bool = False) -> bool:
        """The write of ``gen`` into ``tier`` stored nothing: release its slot (if it held it) and bytes.
        ``failed``: a pending tier's write failed (it is retried with back-off, counted). Returns whether this
        failure made the tier *failing*, when it was not already (worth one log line, until a write to it
        succeeds)."""
        first_failing = False
        with self._lock:
            tr = self.tiers[tier]
            tr.reserved -= reserved
            rec = self._keys.get(key)
            if rec is not None:
                if rec.busy.get(tier) == gen:  # (a write that never got the slot leaves its holder's alone)
                    del rec.busy[tier]
                if failed and gen == rec.gen and tier in rec.pending:
                    attempts = rec.pending[tier] = rec.pending[tier] + 1
                    tr.counts["writeback_failed"] += 1
                    delay = min(self.retry_delay * 2 ** (attempts - 1), self.max_retry_delay)
                    self._retry_later(tr, key, self.clock() + delay, replace=True)
                    first_failing = attempts == self.fast_retries and not tr.failing
                    if attempts == self.fast_retries:
                        self._flushes.settled(rec.epoch)
                        self._flushes.fail(key, tier)
                    tr.failing = tr.failing or attempts >= self.fast_retries
                self._tidy(key)
            self._changed()
        return first_failing

    # ------------------------------------------------------------------ deletes
    def begin_delete(self, key: ChunkKey) -> bool:
        """Start deleting ``key``: writes of older generations are refused from now on. ``False`` while another
        delete of it runs (wait, then ask again)."""
        with self._lock:
            rec = self._record(key)
            if rec.deleting:
                return False
            rec.deleting = next(self._gens)
            return True

    def delete_ready(self, key: ChunkKey) -> list[int] | None:
        """Once no mutation of ``key`` is in flight: take every slot and return the tiers whose storage to
        clear (those holding a copy, and every shared writable tier, whose index may not know it); ``None``
        while mutations are still in flight."""
        with self._lock:
            rec = self._keys[key]
            if rec.busy:
                return None
            tiers = [i for i, tr in enumerate(self.tiers) if tr.spec.writable
                      and (key in tr.copies or tr.spec.shared)]
            for i in tiers:
                rec.busy[i] = REMOVING
            return tiers

    def end_delete(self, key: ChunkKey, kept: Collection[int] = ()) -> int:
        """The delete's storage work is done: every copy is forgotten, but in ``kept``, the tiers whose storage
        did not remove it. A kept copy of the current value stays indexed as the current value (the delete did
        not happen there) and the key is not deleted: every writable tier below the fastest such copy that
        lacks the value now is pending again (write-back restores what the delete removed below, and writes
        over an older value), so it is never the only copy of a value evictions take for clean. A kept copy of
        an older value is forgotten; with no current copy kept, the key's record stays as a tombstone (no
        probe finds it) until it is put or deleted again. Returns how many tiers held one."""
        with self._lock:
            rec = self._keys[key]
            held, top = 0, None
            for i, tr in enumerate(self.tiers):
                packed = tr.copies.get(key)
                if tr.spec.writable and packed is not None:
                    held += 1
                    if i in kept and packed >> SIZE_BITS == rec.gen:
                        self._put_copy(tr, key, pack(rec.deleting, packed & SIZE_MASK))
                        top = i if top is None else top
                    else:
                        self._drop_copy(tr, key)
                        rec.tomb = rec.tomb or i in kept
                self._clear_retry(tr, key)
            tomb = rec.tomb and bool(kept)
            rec.gen, rec.deleting, rec.tomb = rec.deleting, 0, tomb
            if top is None:
                for j in list(rec.pending):
                    self._unpend(key, rec, j)
            else:
                for j in self._writable:
                    if j > top and j not in rec.pending and key not in self.tiers[j].copies:
                        self._pend(key, rec, j)
                for j in rec.pending:
                    self.tiers[j].ready[key] = None  # owed: due now
            rec.busy.clear()
            self._flushes.forget(key)
            self.deletes += 1
            self._tidy(key)
            self._changed()
            return held


__all__ = ["Writes"]
