"""The write-back queue: per tier, the keys due now and those retried later; the writes handed out,
given up or filled in after a promotion; and the flushes that wait for them (:mod:`tierstore.flushes`)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from ..flushes import FlushState
from ..keys import ChunkKey
from .core import Core
from .model import SIZE_BITS, SIZE_MASK, Write
from .state import KeyState, TierIndex


class WriteBack(Core):
    """The write-back queue: per tier, the keys due now and those retried later; the writes handed out,"""

    # ------------------------------------------------------------------ write-back
    def take_due(self, tier: int, limit: int) -> tuple[list[Write], list[tuple[ChunkKey, int]]]:
        """Up to ``limit`` write-backs into ``tier`` that are due now, each with the slot taken and a current
        source copy pinned; plus ``(key, tier)`` pairs given up because no tier holds the current value any
        more and an older value sits in ``tier`` (the caller removes it: :meth:`lost` with ``remove``)."""
        with self._lock:
            tr = self.tiers[tier]
            self._take_due_retries(tr)
            writes: list[Write] = []
            stale: list[tuple[ChunkKey, int]] = []
            soon = self.clock() + self.retry_delay
            while tr.ready and len(writes) < limit:
                key = next(iter(tr.ready))
                del tr.ready[key]
                rec = self._keys.get(key)
                if rec is None or tier not in rec.pending:
                    continue
                if tier in rec.busy or rec.deleting:
                    self._retry_later(tr, key, soon)  # another mutation is in flight: look again shortly
                    continue
                packed = tr.copies.get(key)
                if packed is not None and packed >> SIZE_BITS == rec.gen:
                    self._unpend(key, rec, tier)  # it holds the value already (a promotion, another writer)
                    tr.counts["writeback_done"] += 1
                    self._tidy(key)
                    continue
                source = self._source(key, rec, tier)
                if source is None:
                    self._give_up(key, rec, tier)
                    if packed is not None and not tr.spec.shared:
                        stale.append((key, tier))
                    continue
                if source in rec.busy:  # its only source is being replaced or removed now: look again shortly
                    self._retry_later(tr, key, soon)
                    continue
                src = self.tiers[source]
                src.pins[key] = src.pins.get(key, 0) + 1
                rec.busy[tier] = rec.gen
                writes.append(Write(key, tier, rec.gen, source, src.copies[key] & SIZE_MASK))
            if stale or writes:
                self._changed()
            return writes, stale

    def _take_due_retries(self, tr: TierIndex) -> None:
        heap, due_at, now = tr.retry_heap, tr.retry_at, self.clock()
        while heap:
            at, _, key = heap[0]
            if due_at.get(key) != at:
                heapq.heappop(heap)  # superseded or cancelled
            elif at <= now:
                heapq.heappop(heap)
                del due_at[key]
                tr.ready[key] = None
            else:
                return

    def next_due(self, tier: int) -> float | None:
        """When write-back into ``tier`` has work next: ``0.0`` now, else the next retry time, else ``None``."""
        with self._lock:
            tr = self.tiers[tier]
            self._take_due_retries(tr)
            if tr.ready:
                return 0.0
            while tr.retry_heap and tr.retry_at.get(tr.retry_heap[0][2]) != tr.retry_heap[0][0]:
                heapq.heappop(tr.retry_heap)
            return tr.retry_heap[0][0] if tr.retry_heap else None

    def _source(self, key: ChunkKey, rec: KeyState, tier: int) -> int | None:
        """A tier holding the current value to copy into ``tier``: above it first, then below; one with no
        mutation in flight when there is such a one."""
        order = list(range(tier)) + list(range(tier + 1, len(self.tiers)))
        held = [i for i in order if (packed := self.tiers[i].copies.get(key)) is not None
                and packed >> SIZE_BITS == rec.gen]
        return next((i for i in held if i not in rec.busy), held[0] if held else None)

    def _give_up(self, key: ChunkKey, rec: KeyState, tier: int) -> None:
        self._unpend(key, rec, tier)
        tr = self.tiers[tier]
        self._clear_retry(tr, key)
        tr.counts["writeback_failed"] += 1
        self._flushes.give_up(key, tier)
        self._tidy(key)

    def fill(self, key: ChunkKey, gen: int, tiers: Iterable[int]) -> None:
        """A promotion put the current value (``gen``) above ``tiers``: have write-back copy it into those
        that lack it too, as for a put."""
        with self._lock:
            rec = self._record(key)
            if rec.gen != gen or rec.deleting:
                self._tidy(key)
                return
            for j in tiers:
                tr = self.tiers[j]
                packed = tr.copies.get(key)
                if j in rec.pending or not tr.spec.writable or (packed is not None and packed >> SIZE_BITS == gen):
                    continue
                self._pend(key, rec, j)
                tr.ready[key] = None
            self._tidy(key)
            self._changed()

    # ------------------------------------------------------------------ flush
    def flush_begin(self) -> FlushState:
        """What a flush that begins now waits for (see :mod:`tierstore.flushes`); failing tiers get a fresh
        round of retries (a walk of the failing pairs only, not of the keys)."""
        with self._lock:
            state = self._flushes.begin()
            for key, tiers in self._flushes.take_failing().items():
                rec = self._keys[key]
                for j in tiers:
                    rec.pending[j] = 0
                    self._flushes.opened(rec.epoch)
                    tr = self.tiers[j]
                    tr.retry_at.pop(key, None)
                    tr.ready[key] = None
            self._changed()
            return state

    def flush_waits_for(self, state: FlushState) -> int:
        """How many writes ``state``'s flush still waits for (none: every one written, superseded, given up,
        dropped or failing)."""
        with self._lock:
            return self._flushes.outstanding(state)

    def flush_settled(self, state: FlushState) -> bool:
        """Whether everything ``state`` waits for is written, superseded, given up, dropped or failing."""
        return self.flush_waits_for(state) == 0

    def losses(self) -> tuple[dict[ChunkKey, set[int]], dict[ChunkKey, set[int]]]:
        """``(failed, dropped)``: per key the tiers it could not reach (given up, or failing now) and those
        the pressure policy dropped (a walk of the losses kept, at most ``LOSSES_KEPT`` keys, and of the failing
        pairs: once per flush, never per write)."""
        with self._lock:
            return self._flushes.losses(self._stale_gone)

    def _stale_gone(self, key: ChunkKey, tier: int) -> bool:
        """Whether the older copy of ``key`` that ``tier`` could not remove has gone since (under the lock)."""
        packed = self.tiers[tier].copies.get(key)
        rec = self._keys.get(key)
        return packed is None or rec is None or packed >> SIZE_BITS == rec.gen

    def dirty(self) -> int:
        """Keys with a value not yet written to every tier it must reach."""
        with self._lock:
            return self._dirty


__all__ = ["WriteBack"]
