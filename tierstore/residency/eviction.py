"""Room in a tier: reservations within its byte budget, victims least recently used first (dirty ones
written below first, or kept or dropped by the pressure policy), set-aside victims, and ENOSPC limits."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ..keys import ChunkKey
from .core import Core
from .model import REMOVING, SIZE_BITS, SIZE_MASK, Pressure, Room, Victim
from .state import NOT_ASIDE


class Eviction(Core):
    """Room in a tier: reservations within its byte budget, victims least recently used first (dirty ones"""

    def reserve(self, key: ChunkKey, tier: int, size: int, clean: bool = False) -> Room:
        """Set aside room for ``size`` bytes of ``key`` in ``tier`` (the caller holds the slot). The copy
        being replaced counts as freed. See :class:`Room`; victims hold their slots until
        :meth:`evicted` or :meth:`keep`. ``clean``: only victims that go without a write below (held by a
        tier below, or clean everywhere): nothing dirty is written down or dropped for this room."""
        with self._lock:
            tr = self.tiers[tier]
            limit = self._limit(tr)
            if limit is None:
                return Room(reserved=0)
            old = tr.copies.get(key)
            credit = 0 if old is None else old & SIZE_MASK
            need = max(0, size - credit)
            if size > limit:
                return Room()
            over = tr.used + tr.reserved + need - limit
            if over <= 0:
                tr.reserved += need
                return Room(reserved=need)
            deficit = over - tr.evicting_bytes
            blocked: list[bool] = [False]
            if deficit > 0:
                victims = self._select_victims(tier, deficit, key, blocked, clean)
                if victims:
                    return Room(victims=tuple(victims))
            return Room(wait=bool(tr.evicting_bytes or tr.reserved or tr.pins or blocked[0]))

    def could_take(self, tier: int, size: int, look: int = 64) -> bool:
        """Whether a write of ``size`` bytes into ``tier`` could go on now rather than only wait: the room is
        free, or one of the ``look`` least recently used copies is neither pinned nor being mutated (a victim
        to name). A cheap admission check, not a reservation."""
        with self._lock:
            tr = self.tiers[tier]
            limit = self._limit(tr)
            if limit is None or tr.used + tr.reserved + size <= limit:
                return True
            if size > limit:
                return False
            for key in itertools.islice(tr.copies, look):
                rec = self._keys.get(key)
                if key not in tr.pins and key not in tr.evicting and (rec is None or not rec.busy):
                    return True
            return False

    def release(self, tier: int, reserved: int) -> None:
        """Give back bytes reserved for a write that stored nothing (its slot stays with the caller)."""
        with self._lock:
            self.tiers[tier].reserved -= reserved
            self._changed()

    # ------------------------------------------------------------------ capacity and eviction

    def _select_victims(self, tier: int, deficit: int, exclude: ChunkKey | None,
                        blocked: list[bool] | None = None, clean: bool = False) -> list[Victim]:
        """Victims worth ``deficit`` bytes, least recently used first. A candidate whose write below is in flight
        is passed over with ``blocked[0]`` set (room comes when the write ends: wait), and no newer candidate is
        dropped in its place: past it, a dirty chunk goes only if it can be written below. None on a shared
        tier (out of space, out of memory): its objects are every process's, never this store's to evict.
        ``clean``: dirty candidates are passed over (neither written below nor dropped).

        It walks the LRU from its cold end until it has enough: its cost is the copies passed over there
        (pinned, busy, set aside, or dirty and kept by the policy), not the number of keys."""
        tr = self.tiers[tier]
        if tr.spec.shared:
            return []
        victims: list[Victim] = []
        freed = 0
        may_drop = True
        aside, now = tr.aside, self.clock()
        for key, packed in tr.copies.items():
            if freed >= deficit:
                break
            if key == exclude or key in tr.evicting or (aside and aside.get(key, NOT_ASIDE)[0] > now):
                continue
            rec = self._keys.get(key)
            if rec is not None and any(j > tier for j in rec.busy):  # being written below (its source pinned)
                may_drop = False
                if blocked is not None:
                    blocked[0] = True
                continue
            if key in tr.pins or (rec is not None and (tier in rec.busy or rec.deleting)):
                continue
            gen = packed >> SIZE_BITS
            down = self._down_target(key, tier, gen, may_drop=may_drop and not clean)
            if down is False or (clean and down is not None):
                continue  # dirty and kept by the policy (or, past a chunk being written below, not dropped)
            size = packed & SIZE_MASK
            self._record(key).busy[tier] = REMOVING
            tr.evicting[key] = size
            tr.evicting_bytes += size
            victims.append(Victim(key, tier, size, gen, down if isinstance(down, int) else None, may_drop))
            freed += size
        return victims

    def _down_target(self, key: ChunkKey, tier: int, gen: int, tried: Iterable[int] = (),
                     may_drop: bool = True) -> int | None | bool:
        """Where a victim must be written before it goes: a tier (dirty), ``None`` (clean: it may go), or
        ``False`` (dirty and must stay: a write of it below is in flight, or no tier below can take it now
        and the policy keeps it). Under ``drop`` a dirty victim with nowhere to go is dropped (``None``), its
        pending tiers recorded as dropped."""
        rec = self._keys.get(key)
        if rec is None or gen != rec.gen:
            return None  # clean everywhere, or an older value
        below = sorted(j for j in rec.pending if j > tier)
        if not below:
            return None
        for i, tr in enumerate(self.tiers):  # another current copy that stays: it is the source
            if i != tier and key not in tr.evicting:
                packed = tr.copies.get(key)
                if packed is not None and packed >> SIZE_BITS == gen:
                    return None
        in_flight = False
        for j in below:
            if j in rec.busy:
                in_flight = True  # being written there now: it will be saved (keep it until then)
            elif j not in tried and not self._backing_off(rec, key, j):
                return j
        if in_flight or self.pressure is Pressure.KEEP or not may_drop:
            return False
        for j in range(tier + 1, len(self.tiers)):
            packed = self.tiers[j].copies.get(key)
            if packed is not None and packed >> SIZE_BITS != gen:
                return False  # an older value below must never become the one a read finds
        self._drop(key, below)
        return None

    def _drop(self, key: ChunkKey, tiers: Iterable[int]) -> None:
        rec = self._keys[key]
        for j in tiers:
            if j in rec.pending:
                self._unpend(key, rec, j)
            tr = self.tiers[j]
            self._clear_retry(tr, key)
            tr.counts["writeback_dropped"] += 1
            self._flushes.drop(key, j)
            rec.tomb = rec.tomb or tr.spec.shared

    def choose(self, key: ChunkKey, tier: int) -> Victim | None:
        """``tier``'s copy of ``key`` as a victim (an eviction asked for by name), under the rules any victim
        follows; ``None`` if there is none, or it is pinned, busy, or dirty with nowhere to go that keeps it."""
        with self._lock:
            tr = self.tiers[tier]
            packed = tr.copies.get(key)
            rec = self._keys.get(key)
            if (packed is None or key in tr.pins or key in tr.evicting
                    or (rec is not None and (tier in rec.busy or rec.deleting))):
                return None
            gen, size = packed >> SIZE_BITS, packed & SIZE_MASK
            down = self._down_target(key, tier, gen)
            if down is False:
                return None
            self._record(key).busy[tier] = REMOVING
            tr.evicting[key] = size
            tr.evicting_bytes += size
            return Victim(key, tier, size, gen, down if isinstance(down, int) else None)

    def reclaim(self, key: ChunkKey, tier: int, size: int, clean: bool = False) -> list[Victim]:
        """Victims worth ``size`` more bytes of ``tier`` for a write of ``key`` that has its bytes reserved but
        found no contiguous room (a fragmented memory pool): evicting neighbours frees runs that merge.
        ``clean`` as for :meth:`reserve`."""
        with self._lock:
            return self._select_victims(tier, size, key, clean=clean)

    def written_down_failed(self, victim: Victim, tried: Iterable[int]) -> int | None | bool:
        """The write of ``victim`` to its ``down`` tier (and ``tried`` ones) failed: the next tier to try,
        ``None`` (drop it: clean now, or dropped by the policy) or ``False`` (keep it: call :meth:`keep`)."""
        with self._lock:
            return self._down_target(victim.key, victim.tier, victim.gen, tried, may_drop=victim.droppable)

    def may_evict(self, victim: Victim) -> bool:
        """Whether ``victim`` may be removed now (no reader pinned it since it was chosen); if not it is kept
        (its slot released)."""
        with self._lock:
            if victim.key in self.tiers[victim.tier].pins:
                self._end_eviction(victim)
                return False
            return True

    def keep(self, victim: Victim) -> None:
        """``victim`` stays (it could not be saved, or a reader pinned it)."""
        with self._lock:
            self._end_eviction(victim)

    def set_aside(self, victim: Victim) -> None:
        """``victim`` could not be evicted (its copy could not be read to save it, or its storage would not
        remove it): it stays, and no eviction names it again for a while (a back-off that doubles while it
        keeps failing), so a write that needs room takes another victim or skips the tier. Counted."""
        with self._lock:
            tr = self.tiers[victim.tier]
            if victim.key in tr.copies:
                _, delay = tr.aside.get(victim.key, (0.0, self.aside_delay / 2))
                delay = min(2 * delay, self.max_aside_delay)
                tr.aside[victim.key] = (self.clock() + delay, delay)
            tr.counts["eviction_failures"] += 1
            self._end_eviction(victim)

    def evicted(self, victim: Victim) -> None:
        """``victim`` was removed from storage."""
        with self._lock:
            tr = self.tiers[victim.tier]
            if self._drop_copy(tr, victim.key):
                tr.counts["evictions"] += 1
            self._end_eviction(victim)

    def _end_eviction(self, victim: Victim) -> None:
        tr = self.tiers[victim.tier]
        size = tr.evicting.pop(victim.key, None)
        if size is not None:
            tr.evicting_bytes -= size
        rec = self._keys.get(victim.key)
        if rec is not None:
            rec.busy.pop(victim.tier, None)
        self._tidy(victim.key)
        self._changed()

    # ------------------------------------------------------------------ ENOSPC
    def space_full(self, tier: int) -> float:
        """``tier``'s storage is full below its capacity: hold at most what it holds now; returns the seconds
        until free space is probed again."""
        with self._lock:
            tr = self.tiers[tier]
            sp = tr.space
            sp.bytes = tr.used + tr.reserved
            sp.backoff = min(max(2 * sp.backoff, self.enospc_recheck), self.max_enospc_recheck)
            sp.recheck_at = self.clock() + sp.backoff
            return sp.backoff

    def space_probe_due(self, tier: int) -> bool:
        with self._lock:
            sp = self.tiers[tier].space
            return sp.bytes is not None and self.clock() >= sp.recheck_at

    def space_probed(self, tier: int, free: int | None) -> None:
        """Free space was probed: ``free`` bytes (``None``: unknown; lift the limit and just try again)."""
        with self._lock:
            tr = self.tiers[tier]
            sp = tr.space
            if sp.bytes is None:
                return
            sp.bytes = None if free is None else max(sp.bytes, tr.used + tr.reserved + free)
            sp.recheck_at = self.clock() + sp.backoff
            sp.lifted = True
            self._changed()

    def space_stored(self, tier: int) -> None:
        """A write fit after the limit was raised: the storage has room again (the back-off starts over)."""
        with self._lock:
            sp = self.tiers[tier].space
            if sp.lifted:
                sp.lifted, sp.backoff = False, 0.0

    def trim(self, tier: int) -> list[Victim]:
        """Victims that bring ``tier`` within its budget (an index rebuilt over a lowered capacity): they are
        clean (nothing of this process is pending yet) and go without write-down."""
        with self._lock:
            tr = self.tiers[tier]
            limit = self._limit(tr)
            if limit is None or tr.used <= limit:
                return []
            return self._select_victims(tier, tr.used - limit, exclude=None)


__all__ = ["Eviction"]
