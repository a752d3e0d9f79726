"""The residency's state under its one lock, and what every part of it shares: waiting for a change, the
generations of values, the per-key records (current generation, pending tiers) and the per-tier index of
copies. The parts built on it (copies, writes, eviction, write-back) are mixins over this state;
:class:`~tierstore.residency.Residency` joins them."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from ..flushes import FlushTracker
from ..keys import ChunkKey
from .model import SIZE_BITS, SIZE_MASK, UNKNOWN, Pressure, TierSpec, pack
from .state import KeyState, TierIndex

T = TypeVar("T")


class Core:
    """The state of one store's residency over ``tiers`` (fastest first), and the helpers its parts share."""

    #: failures after which a pending tier counts as failing (reported by a flush); retries go on meanwhile
    fast_retries = 4
    retry_delay = 0.05
    max_retry_delay = 5.0
    #: seconds after ENOSPC before free space is probed again (doubling while the storage stays full)
    enospc_recheck = 1.0
    max_enospc_recheck = 60.0
    #: seconds a victim that could not be evicted is set aside (doubling while it keeps failing)
    aside_delay = 1.0
    max_aside_delay = 60.0

    def __init__(self, tiers: Sequence[TierSpec], pressure: Pressure = Pressure.DROP,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers = [TierIndex(spec) for spec in tiers]
        self.pressure = Pressure(pressure)
        self.clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        #: what :meth:`wait_for_change` waits on (the write-back scheduler): every change but a pin's release,
        #: which only waiters for room care about (a read releases its pins: no scheduler wake-up per read)
        self._scheduler = threading.Condition(self._lock)
        self._keys: dict[ChunkKey, KeyState] = {}
        #: bumped by every change of state that may let a waiter go on (see :meth:`wait_for_change`)
        self.changes = 0
        self._gens = itertools.count(1)
        self._seq = itertools.count()
        self.deletes = 0  #: deletes finished so far (a probe indexes what it found only if none ended meanwhile)
        self._flushes = FlushTracker()
        self._dirty = 0  # keys with pending tiers (counted as they change)
        self._writable = [i for i, tr in enumerate(self.tiers) if tr.spec.writable]

    # ------------------------------------------------------------------ waiting (for the data plane)
    def wait_until(self, attempt: Callable[[], T | None], deadline: float | None = None,
                   poll: float = 0.05) -> T | None:
        """Call ``attempt()`` under the lock until it returns something other than ``None`` (every change of
        state wakes it, and it looks again every ``poll`` s) or ``deadline`` (``time.monotonic``) passes."""
        with self._cond:
            while True:
                result = attempt()
                if result is not None:
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(poll if remaining is None else min(poll, remaining))

    def notify(self) -> None:
        """Wake whoever waits on a change of state (a caller changed something the residency does not see)."""
        with self._cond:
            self._changed()

    def _changed(self) -> None:
        self.changes += 1
        self._cond.notify_all()
        self._scheduler.notify_all()

    def wait_for_change(self, seen: int, timeout: float) -> None:
        """Wait until :attr:`changes` differs from ``seen`` (read before looking at the state), or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._scheduler:
            while self.changes == seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._scheduler.wait(remaining)

    # ------------------------------------------------------------------ generations and copies
    def next_gen(self) -> int:
        """A generation for a new value (every put takes one when it begins)."""
        with self._lock:
            return next(self._gens)

    def _gen_of(self, key: ChunkKey) -> int:
        """The key's current generation: its record's, else that of any copy (a key with no record holds one
        value everywhere), else :data:`UNKNOWN`."""
        rec = self._keys.get(key)
        if rec is not None:
            return rec.gen
        for tr in self.tiers:
            packed = tr.copies.get(key)
            if packed is not None:
                return packed >> SIZE_BITS
        return UNKNOWN

    def _current(self, key: ChunkKey, packed: int) -> bool:
        rec = self._keys.get(key)
        return rec is None or (packed >> SIZE_BITS == rec.gen and not rec.deleting)

    def _record(self, key: ChunkKey) -> KeyState:
        rec = self._keys.get(key)
        if rec is None:
            rec = self._keys[key] = KeyState(self._gen_of(key))
        return rec

    def _tidy(self, key: ChunkKey) -> None:
        """Forget the key's record once nothing is going on and every copy holds its current value."""
        rec = self._keys.get(key)
        if rec is None or rec.pending or rec.busy or rec.deleting or rec.tomb:
            return
        for tr in self.tiers:
            packed = tr.copies.get(key)
            if packed is not None and packed >> SIZE_BITS != rec.gen:
                return
        del self._keys[key]

    def adopt(self, tier: int, items: Iterable[tuple[ChunkKey, int]]) -> None:
        """Register copies found in ``tier``'s storage (an index rebuilt at open), least recently used first.
        Capacity is not enforced here (the store trims what is over)."""
        with self._lock:
            tr = self.tiers[tier]
            for key, size in items:
                self._put_copy(tr, key, pack(self._gen_of(key), size))

    def _put_copy(self, tr: TierIndex, key: ChunkKey, packed: int) -> None:
        old = tr.copies.pop(key, None)
        if old is not None:
            tr.used -= old & SIZE_MASK
        tr.copies[key] = packed
        tr.used += packed & SIZE_MASK

    def _drop_copy(self, tr: TierIndex, key: ChunkKey) -> bool:
        old = tr.copies.pop(key, None)
        if old is None:
            return False
        tr.used -= old & SIZE_MASK
        tr.aside.pop(key, None)
        return True

    def _pend(self, key: ChunkKey, rec: KeyState, tier: int) -> None:
        """``tier`` is to receive the key's current value (a write a flush waits for)."""
        if not rec.pending:
            rec.epoch = self._flushes.epoch
            self._dirty += 1
        rec.pending[tier] = 0
        self.tiers[tier].pending[key] = self.clock()
        self._flushes.opened(rec.epoch)

    def _unpend(self, key: ChunkKey, rec: KeyState, tier: int) -> None:
        """``tier`` no longer waits for the key's value (written, superseded, given up, dropped, deleted)."""
        del self.tiers[tier].pending[key]
        if rec.pending.pop(tier) >= self.fast_retries:
            self._flushes.unfail(key, tier)
        else:
            self._flushes.settled(rec.epoch)
        if not rec.pending:
            self._dirty -= 1

    def _retry_later(self, tr: TierIndex, key: ChunkKey, at: float, replace: bool = False) -> None:
        if replace or tr.retry_at.get(key, float("inf")) > at:
            tr.retry_at[key] = at
            heapq.heappush(tr.retry_heap, (at, next(self._seq), key))
            tr.ready.pop(key, None)

    def _clear_retry(self, tr: TierIndex, key: ChunkKey) -> None:
        tr.retry_at.pop(key, None)
        tr.ready.pop(key, None)

    def _backing_off(self, rec: KeyState, key: ChunkKey, tier: int) -> bool:
        return rec.pending.get(tier, 0) > 0 and key in self.tiers[tier].retry_at

    def _limit(self, tr: TierIndex) -> int | None:
        cap, space = tr.spec.capacity, tr.space.bytes
        if space is None:
            return cap
        return space if cap is None else min(space, cap)


__all__ = ["Core"]
