"""Residency: the one control plane of a store — where every copy of every chunk lives, and what may happen
to it next.

Pure bookkeeping: no I/O, no tensors, no threads started, no waiting. One lock guards all of it. Every method
answers at once with a decision that the data plane (:mod:`tierstore.transfers`) carries out and reports
back; callers that must wait (for a busy key, for room) wait on :meth:`Residency.wait_until`.

**What is kept.** Per level (one storage tier, fastest first): the copies it holds in LRU order, each with its
size and the *generation* of the value it holds, the bytes held, reserved by writes in flight and being
evicted, pins, and a byte budget (its capacity, lowered after ENOSPC). Per key, only while something is
going on (a value not yet written everywhere, a storage mutation in flight, a delete, a copy holding an
older value): the current generation, the levels still to receive it (*pending*, with failed attempts and
retry times) and the one storage mutation in flight per level (*busy*).

**The rules** (each checked by ``tests/test_residency.py`` without threads or files):

1. **Current or skipped.** Generations grow with every put and delete of the store. A copy is *current*
   when its generation is the key's (a key with no record: every copy is). Reads, sources of write-back
   and promotion use current copies only, so an older value is never served once a newer one landed.
2. **One storage mutation per key and level.** Writing a copy (put, write-back, promotion, write-down) or
   removing one (eviction, delete, a damaged object) holds that ``(key, level)`` *slot*; a write of an
   older generation than the level already holds, or than a committed put, is *superseded* (skipped).
3. **Pending after landing.** A put's copy and the pending levels below it are recorded in one step
   (:meth:`commit_write`), so no eviction can mistake the only copy of a value for a clean one.
4. **Exact capacity.** ``used + reserved`` never exceeds a level's budget: a write reserves first;
   :meth:`reserve` names victims, least recently used first, never pinned, busy or being deleted ones.
5. **Dirty victims go down first.** A victim whose copy is the only current one while lower levels are
   pending is written to the nearest pending level that is not backing off before it is removed; when none
   can take it, the pressure policy keeps it (``keep``) or drops it, counted and reported (``drop``), never
   while a lower level holds an older value of it.
6. **Retry while held.** A failed write of a pending level is retried with exponential back-off; after
   ``fast_retries`` failures the level is *failing* (reported by a flush). A level with no current copy left to
   read from is given up and reported.
7. **Deletes win.** A delete waits for mutations in flight, refuses writes of older generations and removes
   every copy; a probe or read that began before a delete ended indexes nothing it found.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from .flushes import FlushState, FlushTracker
from .keys import ChunkKey

T = TypeVar("T")

_SIZE_BITS = 48
_SIZE_MASK = (1 << _SIZE_BITS) - 1
#: the generation of a value this process never wrote (found in storage)
UNKNOWN = 0
#: ``busy`` marker of a removal in flight (writes record the generation they write)
REMOVING = -1


_NOT_ASIDE = (0.0, 0.0)


def _pack(gen: int, size: int) -> int:
    """One int for a copy's generation and size (``size`` itself, no new int, for a copy found in storage)."""
    return gen << _SIZE_BITS | size if gen else size


class Pressure(str, enum.Enum):
    """What a full level does with a dirty victim that no level below can take now (``on_pressure``)."""

    DROP = "drop"  #: evict it and count it (a cache: KV can be recomputed, weights fetched again)
    KEEP = "keep"  #: keep it; the write that needed the room skips the level


class Slot(enum.Enum):
    """Answer of :meth:`Residency.begin_write`."""

    OK = "ok"  #: the caller holds the (key, level) slot: write, then commit or abort
    BUSY = "busy"  #: another mutation of the key at that level (or a delete) is in flight: wait, ask again
    SUPERSEDED = "superseded"  #: a newer value is there or was put: nothing to write


@dataclass(frozen=True)
class LevelSpec:
    """What the control plane knows of a level: its name, byte budget (``None``: unbounded), whether the store
    writes it, and whether other processes share it (its index is partial: misses are probed)."""

    name: str
    capacity: int | None = None
    writable: bool = True
    shared: bool = False


class Hold(NamedTuple):
    """A copy a read may use: pinned until :meth:`Residency.unpin` (a tuple: one is made per key read)."""

    key: ChunkKey
    level: int
    size: int
    gen: int


@dataclass(frozen=True)
class Victim:
    """A copy chosen for eviction; its ``(key, level)`` slot is held for the eviction. ``down``: the level to
    write it to before it goes (it is dirty), ``None``: it may simply go."""

    key: ChunkKey
    level: int
    size: int
    gen: int
    down: int | None
    #: whether the pressure policy may drop it when no level below takes it (not past a chunk being written)
    droppable: bool = True


@dataclass(frozen=True)
class Room:
    """Answer of :meth:`Residency.reserve`: ``reserved`` bytes (granted), else ``victims`` to evict first, else
    ``wait`` (others are freeing room or hold pins), else no room."""

    reserved: int | None = None
    victims: tuple[Victim, ...] = ()
    wait: bool = False


@dataclass(frozen=True)
class Write:
    """A write-back planned by :meth:`Residency.take_due`: copy generation ``gen`` of ``key`` from ``source``
    (pinned) into ``level`` (whose slot is held)."""

    key: ChunkKey
    level: int
    gen: int
    source: int
    source_size: int


class _Key:
    """Per-key state while anything is going on (see the module docstring)."""

    __slots__ = ("busy", "deleting", "epoch", "gen", "pending", "since", "tomb")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.pending: dict[int, int] = {}  # level -> failed attempts since the last success
        self.busy: dict[int, int] = {}  # level -> generation being written there, or REMOVING
        self.deleting = 0  # generation of a delete in progress (0: none)
        self.since = 0.0  # when the current pending levels became pending (write-back lag)
        self.epoch = 0  # the flush epoch its pending writes are counted under (see tierstore.flushes)
        #: its value was dropped before reaching a shared level, which may hold an older value this store
        #: never indexed: the record stays (no probe, nothing found indexed) until the key is put or deleted
        self.tomb = False


class _Level:
    __slots__ = ("aside", "copies", "counts", "evicting", "evicting_bytes", "failing", "pins", "ready",
                 "reserved", "retry_at", "retry_heap", "space", "spec", "used")

    def __init__(self, spec: LevelSpec) -> None:
        self.spec = spec
        self.copies: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> packed (gen, size), LRU first
        self.used = 0
        self.reserved = 0
        self.evicting: dict[ChunkKey, int] = {}
        self.evicting_bytes = 0
        self.pins: dict[ChunkKey, int] = {}
        self.ready: dict[ChunkKey, None] = {}  # write-backs due now, in order
        self.retry_at: dict[ChunkKey, float] = {}
        self.retry_heap: list[tuple[float, int, ChunkKey]] = []
        self.space = _SpaceLimit()
        #: victims that could not be evicted (their copy unreadable or unremovable): key -> (until, back-off s);
        #: no eviction names them again before ``until``
        self.aside: dict[ChunkKey, tuple[float, float]] = {}
        self.counts = {"evictions": 0, "eviction_failures": 0, "writeback_done": 0, "writeback_failed": 0,
                       "writeback_dropped": 0}
        self.failing = False  # a write into it kept failing, and none has succeeded since


class _SpaceLimit:
    """How many bytes a level may hold after its storage said ENOSPC: what it held then, until a probe of
    free space (after a back-off that doubles while the storage stays full) says more."""

    __slots__ = ("backoff", "bytes", "lifted", "recheck_at")

    def __init__(self) -> None:
        self.bytes: int | None = None
        self.recheck_at = 0.0
        self.backoff = 0.0
        self.lifted = False


class Residency:
    """The control plane of one store over ``levels`` (fastest first). Thread-safe; nothing here blocks
    except :meth:`wait_until`."""

    #: failures after which a pending level counts as failing (reported by a flush); retries go on meanwhile
    fast_retries = 4
    retry_delay = 0.05
    max_retry_delay = 5.0
    #: seconds after ENOSPC before free space is probed again (doubling while the storage stays full)
    enospc_recheck = 1.0
    max_enospc_recheck = 60.0
    #: seconds a victim that could not be evicted is set aside (doubling while it keeps failing)
    aside_delay = 1.0
    max_aside_delay = 60.0

    def __init__(self, levels: Sequence[LevelSpec], pressure: Pressure = Pressure.DROP,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.levels = [_Level(spec) for spec in levels]
        self.pressure = Pressure(pressure)
        self.clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        #: what :meth:`wait_for_change` waits on (the write-back scheduler): every change but a pin's release,
        #: which only waiters for room care about (a read releases its pins: no scheduler wake-up per read)
        self._scheduler = threading.Condition(self._lock)
        self._keys: dict[ChunkKey, _Key] = {}
        #: bumped by every change of state that may let a waiter go on (see :meth:`wait_for_change`)
        self.changes = 0
        self._gens = itertools.count(1)
        self._seq = itertools.count()
        self.deletes = 0  #: deletes finished so far (a probe indexes what it found only if none ended meanwhile)
        self._flushes = FlushTracker()
        self._dirty = 0  # keys with pending levels (counted as they change)
        self._writable = [i for i, lv in enumerate(self.levels) if lv.spec.writable]

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
        for lv in self.levels:
            packed = lv.copies.get(key)
            if packed is not None:
                return packed >> _SIZE_BITS
        return UNKNOWN

    def _current(self, key: ChunkKey, packed: int) -> bool:
        rec = self._keys.get(key)
        return rec is None or (packed >> _SIZE_BITS == rec.gen and not rec.deleting)

    def _record(self, key: ChunkKey) -> _Key:
        rec = self._keys.get(key)
        if rec is None:
            rec = self._keys[key] = _Key(self._gen_of(key))
        return rec

    def _tidy(self, key: ChunkKey) -> None:
        """Forget the key's record once nothing is going on and every copy holds its current value."""
        rec = self._keys.get(key)
        if rec is None or rec.pending or rec.busy or rec.deleting or rec.tomb:
            return
        for lv in self.levels:
            packed = lv.copies.get(key)
            if packed is not None and packed >> _SIZE_BITS != rec.gen:
                return
        del self._keys[key]

    def adopt(self, level: int, items: Iterable[tuple[ChunkKey, int]]) -> None:
        """Register copies found in ``level``'s storage (an index rebuilt at open), least recently used first.
        Capacity is not enforced here (the store trims what is over)."""
        with self._lock:
            lv = self.levels[level]
            for key, size in items:
                self._put_copy(lv, key, _pack(self._gen_of(key), size))

    def _put_copy(self, lv: _Level, key: ChunkKey, packed: int) -> None:
        old = lv.copies.pop(key, None)
        if old is not None:
            lv.used -= old & _SIZE_MASK
        lv.copies[key] = packed
        lv.used += packed & _SIZE_MASK

    def _drop_copy(self, lv: _Level, key: ChunkKey) -> bool:
        old = lv.copies.pop(key, None)
        if old is None:
            return False
        lv.used -= old & _SIZE_MASK
        lv.aside.pop(key, None)
        return True

    def found(self, level: int, key: ChunkKey, size: int, deletes: int) -> int | None:
        """A probe or read of a shared level found ``key`` stored there, unindexed: index it, unless a delete
        ended since the probe began (``deletes`` was :attr:`deletes` then), the key is being mutated there or
        deleted, or its value here may be older than the current one. The generation it was indexed with, or
        ``None``."""
        with self._lock:
            lv = self.levels[level]
            rec = self._keys.get(key)
            if deletes != self.deletes:
                return None
            packed = lv.copies.get(key)
            if packed is not None:
                return packed >> _SIZE_BITS if self._current(key, packed) else None
            if rec is not None and (rec.deleting or level in rec.busy or rec.gen != UNKNOWN or level in rec.pending):
                return None
            gen = self._gen_of(key)
            self._put_copy(lv, key, _pack(gen, size))
            return gen

    def lost(self, level: int, key: ChunkKey, gen: int, remove: bool) -> bool:
        """A read found the copy of generation ``gen`` missing or damaged: forget it (unless it was replaced
        or is being mutated meanwhile). With ``remove`` (a damaged object on a level this store owns) the
        caller gets the slot to remove it from storage, then calls :meth:`removed`; returns whether it did."""
        with self._lock:
            lv = self.levels[level]
            packed = lv.copies.get(key)
            if packed is None or packed >> _SIZE_BITS != gen or key in lv.evicting:
                return False
            rec = self._keys.get(key)
            if rec is not None and (level in rec.busy or rec.deleting):
                return False
            if remove:
                self._record(key).busy[level] = REMOVING
                return True
            self._drop_copy(lv, key)
            self._tidy(key)
            self._changed()
            return False

    def claim_stale(self, key: ChunkKey, level: int) -> bool:
        """Take the slot to remove ``level``'s copy of ``key`` if it holds an older value and nothing mutates
        it (a put landed below a level that refused it); then remove it and call :meth:`removed`."""
        with self._lock:
            lv = self.levels[level]
            packed = lv.copies.get(key)
            rec = self._keys.get(key)
            if (packed is None or rec is None or packed >> _SIZE_BITS == rec.gen or level in rec.busy
                    or rec.deleting or key in lv.evicting):
                return False
            rec.busy[level] = REMOVING
            return True

    def removed(self, level: int, key: ChunkKey) -> None:
        """A removal :meth:`lost` or :meth:`claim_stale` granted is done: the copy is gone from the index too."""
        with self._lock:
            self._drop_copy(self.levels[level], key)
            rec = self._keys.get(key)
            if rec is not None:
                rec.busy.pop(level, None)
            self._tidy(key)
            self._changed()

    def removal_failed(self, level: int, key: ChunkKey) -> None:
        """A removal :meth:`lost` or :meth:`claim_stale` granted failed: the copy stays indexed (it is still
        in storage). An older value left there is reported by every flush as a level the key could not reach
        (a restart would find that value), until the key is put or deleted again."""
        with self._lock:
            rec = self._keys.get(key)
            if rec is not None:
                rec.busy.pop(level, None)
                packed = self.levels[level].copies.get(key)
                if packed is not None and packed >> _SIZE_BITS != rec.gen:
                    self._flushes.keep_stale(key, level)
            self._tidy(key)
            self._changed()

    # ------------------------------------------------------------------ reads, pins
    def locate(self, keys: Sequence[ChunkKey], levels: Iterable[int] | None = None) -> list[int | None]:
        """Per key, the first of ``levels`` (default: all) holding its current value, from the index alone."""
        order = list(range(len(self.levels))) if levels is None else sorted(levels)
        with self._lock:
            return [self._first_current(k, order) for k in keys]

    def _first_current(self, key: ChunkKey, order: Sequence[int]) -> int | None:
        rec = self._keys.get(key)
        if rec is not None and rec.deleting:
            return None
        for i in order:
            packed = self.levels[i].copies.get(key)
            if packed is not None and (rec is None or packed >> _SIZE_BITS == rec.gen):
                return i
        return None

    def pin(self, keys: Sequence[ChunkKey], levels: Iterable[int] | None = None, touch: bool = True
            ) -> list[Hold | None]:
        """Pin each key's copy in the first of ``levels`` holding its current value; ``None`` where none
        does. ``touch`` marks the copies most recently used. Each hold goes back through :meth:`unpin`."""
        order = list(range(len(self.levels))) if levels is None else sorted(levels)
        holds: list[Hold | None] = []
        append, records, new = holds.append, self._keys, tuple.__new__  # a NamedTuple's own __new__ is Python
        candidates = [(i, self.levels[i]) for i in order]
        with self._lock:
            for key in keys:
                rec = records.get(key)
                found = None
                if rec is None or not rec.deleting:
                    for i, lv in candidates:
                        packed = lv.copies.get(key)
                        if packed is not None and (rec is None or packed >> _SIZE_BITS == rec.gen):
                            if touch and key not in lv.evicting:
                                lv.copies.move_to_end(key)
                            pins = lv.pins
                            pins[key] = pins.get(key, 0) + 1
                            found = new(Hold, (key, i, packed & _SIZE_MASK, packed >> _SIZE_BITS))
                            break
                append(found)
        return holds

    def unpin(self, holds: Iterable[Hold | None]) -> None:
        with self._lock:
            freed = False
            for h in holds:
                if h is None:
                    continue
                pins = self.levels[h.level].pins
                n = pins.get(h.key, 0) - 1
                if n > 0:
                    pins[h.key] = n
                else:
                    pins.pop(h.key, None)
                    freed = True
            if freed:  # waiters for room may go on; the write-back scheduler never waits for a pin
                self._cond.notify_all()

    def probe_levels(self, key: ChunkKey) -> list[int]:
        """Shared levels where ``key`` may be stored by another process with its current value (to probe)."""
        with self._lock:
            rec = self._keys.get(key)
            if rec is not None and (rec.deleting or rec.gen != UNKNOWN):
                return []
            return [i for i, lv in enumerate(self.levels) if lv.spec.shared and key not in lv.copies
                    and (rec is None or i not in rec.pending)]

    def current_gen(self, key: ChunkKey, level: int) -> int | None:
        """The generation of ``level``'s copy of ``key`` when it holds the current value, else ``None``."""
        with self._lock:
            packed = self.levels[level].copies.get(key)
            return packed >> _SIZE_BITS if packed is not None and self._current(key, packed) else None

    def holds_current(self, key: ChunkKey, level: int, gen: int) -> bool:
        """Whether ``level`` still holds generation ``gen`` of ``key`` as its current value."""
        with self._lock:
            packed = self.levels[level].copies.get(key)
            return packed is not None and packed >> _SIZE_BITS == gen and self._current(key, packed)

    def writing(self, key: ChunkKey, level: int) -> bool:
        """Whether a write, promotion or removal of ``key`` in ``level`` is in flight."""
        with self._lock:
            rec = self._keys.get(key)
            return rec is not None and level in rec.busy

    # ------------------------------------------------------------------ writes
    def begin_write(self, key: ChunkKey, level: int, gen: int) -> Slot:
        """Take the ``(key, level)`` slot to write generation ``gen`` there (see :class:`Slot`)."""
        with self._lock:
            rec = self._record(key)
            lv = self.levels[level]
            if rec.deleting:
                if gen < rec.deleting:
                    self._tidy(key)
                    return Slot.SUPERSEDED
                return Slot.BUSY
            if level in rec.busy:
                return Slot.BUSY
            packed = lv.copies.get(key)
            if gen < rec.gen or (packed is not None and packed >> _SIZE_BITS > gen):
                self._tidy(key)
                return Slot.SUPERSEDED
            rec.busy[level] = gen
            return Slot.OK

    def reserve(self, key: ChunkKey, level: int, size: int) -> Room:
        """Set aside room for ``size`` bytes of ``key`` in ``level`` (the caller holds the slot). The copy
        being replaced counts as freed. See :class:`Room`; victims hold their slots until
        :meth:`evicted` or :meth:`keep`."""
        with self._lock:
            lv = self.levels[level]
            limit = self._limit(lv)
            if limit is None:
                return Room(reserved=0)
            old = lv.copies.get(key)
            credit = 0 if old is None else old & _SIZE_MASK
            need = max(0, size - credit)
            if size > limit:
                return Room()
            over = lv.used + lv.reserved + need - limit
            if over <= 0:
                lv.reserved += need
                return Room(reserved=need)
            deficit = over - lv.evicting_bytes
            blocked: list[bool] = [False]
            if deficit > 0:
                victims = self._select_victims(level, deficit, key, blocked)
                if victims:
                    return Room(victims=tuple(victims))
            return Room(wait=bool(lv.evicting_bytes or lv.reserved or lv.pins or blocked[0]))

    def could_take(self, level: int, size: int, look: int = 64) -> bool:
        """Whether a write of ``size`` bytes into ``level`` could go on now rather than only wait: the room is
        free, or one of the ``look`` least recently used copies is neither pinned nor being mutated (a victim
        to name). A cheap admission check, not a reservation."""
        with self._lock:
            lv = self.levels[level]
            limit = self._limit(lv)
            if limit is None or lv.used + lv.reserved + size <= limit:
                return True
            if size > limit:
                return False
            for key in itertools.islice(lv.copies, look):
                rec = self._keys.get(key)
                if key not in lv.pins and key not in lv.evicting and (rec is None or not rec.busy):
                    return True
            return False

    def release(self, level: int, reserved: int) -> None:
        """Give back bytes reserved for a write that stored nothing (its slot stays with the caller)."""
        with self._lock:
            self.levels[level].reserved -= reserved
            self._changed()

    def commit_write(self, key: ChunkKey, level: int, gen: int, size: int, reserved: int, *,
                     put: bool = False, queue: bool = True) -> list[int]:
        """The write of generation ``gen`` into ``level`` is stored (``size`` bytes, ``reserved`` of them set
        aside): index the copy and release the slot.

        A ``put`` that makes ``gen`` the current value records the writable levels below as pending (queued
        for write-back unless ``queue`` is false: a ``write_through`` put writes them itself). Returns the
        levels above ``level`` whose copies now hold an older value (the put removes them)."""
        with self._lock:
            lv = self.levels[level]
            rec = self._record(key)
            rec.busy.pop(level, None)
            lv.reserved -= reserved
            lv.failing = False
            self._put_copy(lv, key, _pack(gen, size))
            stale_above: list[int] = []
            if gen > rec.gen and put:
                rec.gen, rec.tomb = gen, False
                for j in list(rec.pending):
                    self._unpend(key, rec, j)
                rec.since = self.clock()
                for j in self._writable:
                    if j > level:
                        self._pend(rec, j)
                        self._clear_retry(self.levels[j], key)
                        if queue:
                            self.levels[j].ready[key] = None
                self._flushes.forget(key)
                stale_above = [j for j in range(level) if key in self.levels[j].copies and self.levels[j].spec.writable]
            elif gen == rec.gen and level in rec.pending:
                self._unpend(key, rec, level)
                self._clear_retry(lv, key)
                lv.counts["writeback_done"] += 1
            self._tidy(key)
            self._changed()
            return stale_above

    def abort_write(self, key: ChunkKey, level: int, gen: int, reserved: int = 0, failed: bool = False) -> bool:
        """The write of ``gen`` into ``level`` stored nothing: release its slot (if it held it) and bytes.
        ``failed``: a pending level's write failed (it is retried with back-off, counted). Returns whether this
        failure made the level *failing*, when it was not already (worth one log line, until a write to it
        succeeds)."""
        first_failing = False
        with self._lock:
            lv = self.levels[level]
            lv.reserved -= reserved
            rec = self._keys.get(key)
            if rec is not None:
                if rec.busy.get(level) == gen:  # (a write that never got the slot leaves its holder's alone)
                    del rec.busy[level]
                if failed and gen == rec.gen and level in rec.pending:
                    attempts = rec.pending[level] = rec.pending[level] + 1
                    lv.counts["writeback_failed"] += 1
                    delay = min(self.retry_delay * 2 ** (attempts - 1), self.max_retry_delay)
                    self._retry_later(lv, key, self.clock() + delay, replace=True)
                    first_failing = attempts == self.fast_retries and not lv.failing
                    if attempts == self.fast_retries:
                        self._flushes.settled(rec.epoch)
                        self._flushes.fail(key, level)
                    lv.failing = lv.failing or attempts >= self.fast_retries
                self._tidy(key)
            self._changed()
        return first_failing

    def _pend(self, rec: _Key, level: int) -> None:
        """``level`` is to receive the key's current value (a write a flush waits for)."""
        if not rec.pending:
            rec.epoch = self._flushes.epoch
            self._dirty += 1
        rec.pending[level] = 0
        self._flushes.opened(rec.epoch)

    def _unpend(self, key: ChunkKey, rec: _Key, level: int) -> None:
        """``level`` no longer waits for the key's value (written, superseded, given up, dropped, deleted)."""
        if rec.pending.pop(level) >= self.fast_retries:
            self._flushes.unfail(key, level)
        else:
            self._flushes.settled(rec.epoch)
        if not rec.pending:
            self._dirty -= 1

    def _retry_later(self, lv: _Level, key: ChunkKey, at: float, replace: bool = False) -> None:
        if replace or lv.retry_at.get(key, float("inf")) > at:
            lv.retry_at[key] = at
            heapq.heappush(lv.retry_heap, (at, next(self._seq), key))
            lv.ready.pop(key, None)

    def _clear_retry(self, lv: _Level, key: ChunkKey) -> None:
        lv.retry_at.pop(key, None)
        lv.ready.pop(key, None)

    def _backing_off(self, rec: _Key, key: ChunkKey, level: int) -> bool:
        return rec.pending.get(level, 0) > 0 and key in self.levels[level].retry_at

    # ------------------------------------------------------------------ capacity and eviction
    def _limit(self, lv: _Level) -> int | None:
        cap, space = lv.spec.capacity, lv.space.bytes
        if space is None:
            return cap
        return space if cap is None else min(space, cap)

    def _select_victims(self, level: int, deficit: int, exclude: ChunkKey | None,
                        blocked: list[bool] | None = None) -> list[Victim]:
        """Victims worth ``deficit`` bytes, least recently used first. A candidate whose write below is in flight
        is passed over with ``blocked[0]`` set (room comes when the write ends: wait), and no newer candidate is
        dropped in its place: past it, a dirty chunk goes only if it can be written below. None on a shared
        level (out of space, out of memory): its objects are every process's, never this store's to evict."""
        lv = self.levels[level]
        if lv.spec.shared:
            return []
        victims: list[Victim] = []
        freed = 0
        may_drop = True
        aside, now = lv.aside, self.clock()
        for key, packed in lv.copies.items():
            if freed >= deficit:
                break
            if key == exclude or key in lv.evicting or (aside and aside.get(key, _NOT_ASIDE)[0] > now):
                continue
            rec = self._keys.get(key)
            if rec is not None and any(j > level for j in rec.busy):  # being written below (its source pinned)
                may_drop = False
                if blocked is not None:
                    blocked[0] = True
                continue
            if key in lv.pins or (rec is not None and (level in rec.busy or rec.deleting)):
                continue
            gen = packed >> _SIZE_BITS
            down = self._down_target(key, level, gen, may_drop=may_drop)
            if down is False:
                continue  # dirty and kept by the policy (or, past a chunk being written below, not dropped)
            size = packed & _SIZE_MASK
            self._record(key).busy[level] = REMOVING
            lv.evicting[key] = size
            lv.evicting_bytes += size
            victims.append(Victim(key, level, size, gen, down if isinstance(down, int) else None, may_drop))
            freed += size
        return victims

    def _down_target(self, key: ChunkKey, level: int, gen: int, tried: Iterable[int] = (),
                     may_drop: bool = True) -> int | None | bool:
        """Where a victim must be written before it goes: a level (dirty), ``None`` (clean: it may go), or
        ``False`` (dirty and must stay: a write of it below is in flight, or no level below can take it now
        and the policy keeps it). Under ``drop`` a dirty victim with nowhere to go is dropped (``None``), its
        pending levels recorded as dropped."""
        rec = self._keys.get(key)
        if rec is None or gen != rec.gen:
            return None  # clean everywhere, or an older value
        below = sorted(j for j in rec.pending if j > level)
        if not below:
            return None
        for i, lv in enumerate(self.levels):  # another current copy that stays: it is the source
            if i != level and key not in lv.evicting:
                packed = lv.copies.get(key)
                if packed is not None and packed >> _SIZE_BITS == gen:
                    return None
        in_flight = False
        for j in below:
            if j in rec.busy:
                in_flight = True  # being written there now: it will be saved (keep it until then)
            elif j not in tried and not self._backing_off(rec, key, j):
                return j
        if in_flight or self.pressure is Pressure.KEEP or not may_drop:
            return False
        for j in range(level + 1, len(self.levels)):
            packed = self.levels[j].copies.get(key)
            if packed is not None and packed >> _SIZE_BITS != gen:
                return False  # an older value below must never become the one a read finds
        self._drop(key, below)
        return None

    def _drop(self, key: ChunkKey, levels: Iterable[int]) -> None:
        rec = self._keys[key]
        for j in levels:
            if j in rec.pending:
                self._unpend(key, rec, j)
            lv = self.levels[j]
            self._clear_retry(lv, key)
            lv.counts["writeback_dropped"] += 1
            self._flushes.drop(key, j)
            rec.tomb = rec.tomb or lv.spec.shared

    def choose(self, key: ChunkKey, level: int) -> Victim | None:
        """``level``'s copy of ``key`` as a victim (an eviction asked for by name), under the rules any victim
        follows; ``None`` if there is none, or it is pinned, busy, or dirty with nowhere to go that keeps it."""
        with self._lock:
            lv = self.levels[level]
            packed = lv.copies.get(key)
            rec = self._keys.get(key)
            if (packed is None or key in lv.pins or key in lv.evicting
                    or (rec is not None and (level in rec.busy or rec.deleting))):
                return None
            gen, size = packed >> _SIZE_BITS, packed & _SIZE_MASK
            down = self._down_target(key, level, gen)
            if down is False:
                return None
            self._record(key).busy[level] = REMOVING
            lv.evicting[key] = size
            lv.evicting_bytes += size
            return Victim(key, level, size, gen, down if isinstance(down, int) else None)

    def reclaim(self, key: ChunkKey, level: int, size: int) -> list[Victim]:
        """Victims worth ``size`` more bytes of ``level`` for a write of ``key`` that has its bytes reserved but
        found no contiguous room (a fragmented memory pool): evicting neighbours frees runs that merge."""
        with self._lock:
            return self._select_victims(level, size, key)

    def written_down_failed(self, victim: Victim, tried: Iterable[int]) -> int | None | bool:
        """The write of ``victim`` to its ``down`` level (and ``tried`` ones) failed: the next level to try,
        ``None`` (drop it: clean now, or dropped by the policy) or ``False`` (keep it: call :meth:`keep`)."""
        with self._lock:
            return self._down_target(victim.key, victim.level, victim.gen, tried, may_drop=victim.droppable)

    def may_evict(self, victim: Victim) -> bool:
        """Whether ``victim`` may be removed now (no reader pinned it since it was chosen); if not it is kept
        (its slot released)."""
        with self._lock:
            if victim.key in self.levels[victim.level].pins:
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
        keeps failing), so a write that needs room takes another victim or skips the level. Counted."""
        with self._lock:
            lv = self.levels[victim.level]
            if victim.key in lv.copies:
                _, delay = lv.aside.get(victim.key, (0.0, self.aside_delay / 2))
                delay = min(2 * delay, self.max_aside_delay)
                lv.aside[victim.key] = (self.clock() + delay, delay)
            lv.counts["eviction_failures"] += 1
            self._end_eviction(victim)

    def evicted(self, victim: Victim) -> None:
        """``victim`` was removed from storage."""
        with self._lock:
            lv = self.levels[victim.level]
            if self._drop_copy(lv, victim.key):
                lv.counts["evictions"] += 1
            self._end_eviction(victim)

    def _end_eviction(self, victim: Victim) -> None:
        lv = self.levels[victim.level]
        size = lv.evicting.pop(victim.key, None)
        if size is not None:
            lv.evicting_bytes -= size
        rec = self._keys.get(victim.key)
        if rec is not None:
            rec.busy.pop(victim.level, None)
        self._tidy(victim.key)
        self._changed()

    # ------------------------------------------------------------------ ENOSPC
    def space_full(self, level: int) -> float:
        """``level``'s storage is full below its capacity: hold at most what it holds now; returns the seconds
        until free space is probed again."""
        with self._lock:
            lv = self.levels[level]
            sp = lv.space
            sp.bytes = lv.used + lv.reserved
            sp.backoff = min(max(2 * sp.backoff, self.enospc_recheck), self.max_enospc_recheck)
            sp.recheck_at = self.clock() + sp.backoff
            return sp.backoff

    def space_probe_due(self, level: int) -> bool:
        with self._lock:
            sp = self.levels[level].space
            return sp.bytes is not None and self.clock() >= sp.recheck_at

    def space_probed(self, level: int, free: int | None) -> None:
        """Free space was probed: ``free`` bytes (``None``: unknown; lift the limit and just try again)."""
        with self._lock:
            lv = self.levels[level]
            sp = lv.space
            if sp.bytes is None:
                return
            sp.bytes = None if free is None else max(sp.bytes, lv.used + lv.reserved + free)
            sp.recheck_at = self.clock() + sp.backoff
            sp.lifted = True
            self._changed()

    def space_stored(self, level: int) -> None:
        """A write fit after the limit was raised: the storage has room again (the back-off starts over)."""
        with self._lock:
            sp = self.levels[level].space
            if sp.lifted:
                sp.lifted, sp.backoff = False, 0.0

    def trim(self, level: int) -> list[Victim]:
        """Victims that bring ``level`` within its budget (an index rebuilt over a lowered capacity): they are
        clean (nothing of this process is pending yet) and go without write-down."""
        with self._lock:
            lv = self.levels[level]
            limit = self._limit(lv)
            if limit is None or lv.used <= limit:
                return []
            return self._select_victims(level, lv.used - limit, exclude=None)

    # ------------------------------------------------------------------ write-back
    def take_due(self, level: int, limit: int) -> tuple[list[Write], list[tuple[ChunkKey, int]]]:
        """Up to ``limit`` write-backs into ``level`` that are due now, each with the slot taken and a current
        source copy pinned; plus ``(key, level)`` pairs given up because no level holds the current value any
        more and an older value sits in ``level`` (the caller removes it: :meth:`lost` with ``remove``)."""
        with self._lock:
            lv = self.levels[level]
            self._take_due_retries(lv)
            writes: list[Write] = []
            stale: list[tuple[ChunkKey, int]] = []
            soon = self.clock() + self.retry_delay
            while lv.ready and len(writes) < limit:
                key = next(iter(lv.ready))
                del lv.ready[key]
                rec = self._keys.get(key)
                if rec is None or level not in rec.pending:
                    continue
                if level in rec.busy or rec.deleting:
                    self._retry_later(lv, key, soon)  # another mutation is in flight: look again shortly
                    continue
                packed = lv.copies.get(key)
                if packed is not None and packed >> _SIZE_BITS == rec.gen:
                    self._unpend(key, rec, level)  # it holds the value already (a promotion, another writer)
                    lv.counts["writeback_done"] += 1
                    self._tidy(key)
                    continue
                source = self._source(key, rec, level)
                if source is None:
                    self._give_up(key, rec, level)
                    if packed is not None and not lv.spec.shared:
                        stale.append((key, level))
                    continue
                if source in rec.busy:  # its only source is being replaced or removed now: look again shortly
                    self._retry_later(lv, key, soon)
                    continue
                src = self.levels[source]
                src.pins[key] = src.pins.get(key, 0) + 1
                rec.busy[level] = rec.gen
                writes.append(Write(key, level, rec.gen, source, src.copies[key] & _SIZE_MASK))
            if stale or writes:
                self._changed()
            return writes, stale

    def _take_due_retries(self, lv: _Level) -> None:
        heap, due_at, now = lv.retry_heap, lv.retry_at, self.clock()
        while heap:
            at, _, key = heap[0]
            if due_at.get(key) != at:
                heapq.heappop(heap)  # superseded or cancelled
            elif at <= now:
                heapq.heappop(heap)
                del due_at[key]
                lv.ready[key] = None
            else:
                return

    def next_due(self, level: int) -> float | None:
        """When write-back into ``level`` has work next: ``0.0`` now, else the next retry time, else ``None``."""
        with self._lock:
            lv = self.levels[level]
            self._take_due_retries(lv)
            if lv.ready:
                return 0.0
            while lv.retry_heap and lv.retry_at.get(lv.retry_heap[0][2]) != lv.retry_heap[0][0]:
                heapq.heappop(lv.retry_heap)
            return lv.retry_heap[0][0] if lv.retry_heap else None

    def _source(self, key: ChunkKey, rec: _Key, level: int) -> int | None:
        """A level holding the current value to copy into ``level``: above it first, then below; one with no
        mutation in flight when there is such a one."""
        order = list(range(level)) + list(range(level + 1, len(self.levels)))
        held = [i for i in order if (packed := self.levels[i].copies.get(key)) is not None
                and packed >> _SIZE_BITS == rec.gen]
        return next((i for i in held if i not in rec.busy), held[0] if held else None)

    def _give_up(self, key: ChunkKey, rec: _Key, level: int) -> None:
        self._unpend(key, rec, level)
        lv = self.levels[level]
        self._clear_retry(lv, key)
        lv.counts["writeback_failed"] += 1
        self._flushes.give_up(key, level)
        self._tidy(key)

    def fill(self, key: ChunkKey, gen: int, levels: Iterable[int]) -> None:
        """A promotion put the current value (``gen``) above ``levels``: have write-back copy it into those
        that lack it too, as for a put."""
        with self._lock:
            rec = self._record(key)
            if rec.gen != gen or rec.deleting:
                self._tidy(key)
                return
            now = self.clock()
            for j in levels:
                lv = self.levels[j]
                packed = lv.copies.get(key)
                if j in rec.pending or not lv.spec.writable or (packed is not None and packed >> _SIZE_BITS == gen):
                    continue
                if not rec.pending:
                    rec.since = now
                self._pend(rec, j)
                lv.ready[key] = None
            self._tidy(key)
            self._changed()

    # ------------------------------------------------------------------ promotion
    def begin_promote(self, key: ChunkKey, source: int, gen: int, target: int) -> bool:
        """Take the slot to copy generation ``gen`` of ``key``, read from ``source``, into ``target`` — only if
        that is still the current value, ``target`` lacks it and nothing else mutates it there."""
        with self._lock:
            lv = self.levels[target]
            packed = self.levels[source].copies.get(key)
            if packed is None or packed >> _SIZE_BITS != gen or not self._current(key, packed):
                return False
            have = lv.copies.get(key)
            if have is not None and self._current(key, have):
                return False
            rec = self._record(key)
            if target in rec.busy or rec.deleting:
                self._tidy(key)
                return False
            rec.busy[target] = gen
            return True

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
        """Once no mutation of ``key`` is in flight: take every slot and return the levels whose storage to
        clear (those holding a copy, and every shared writable level, whose index may not know it); ``None``
        while mutations are still in flight."""
        with self._lock:
            rec = self._keys[key]
            if rec.busy:
                return None
            levels = [i for i, lv in enumerate(self.levels) if lv.spec.writable
                      and (key in lv.copies or lv.spec.shared)]
            for i in levels:
                rec.busy[i] = REMOVING
            return levels

    def end_delete(self, key: ChunkKey, kept: Collection[int] = ()) -> int:
        """The delete's storage work is done: every copy is forgotten, but in ``kept``, the levels whose storage
        could not remove it. A kept copy of the current value stays indexed as the current value (the delete
        did not happen there); a kept copy of an older value is forgotten and the key's record stays as a
        tombstone (no probe finds it) until it is put or deleted again. Returns how many levels held one."""
        with self._lock:
            rec = self._keys[key]
            held = 0
            for i, lv in enumerate(self.levels):
                packed = lv.copies.get(key)
                if lv.spec.writable and packed is not None:
                    held += 1
                    if i in kept and packed >> _SIZE_BITS == rec.gen:
                        self._put_copy(lv, key, _pack(rec.deleting, packed & _SIZE_MASK))
                    else:
                        self._drop_copy(lv, key)
                        rec.tomb = rec.tomb or i in kept
                self._clear_retry(lv, key)
            tomb = rec.tomb and bool(kept)
            rec.gen, rec.deleting, rec.tomb = rec.deleting, 0, tomb
            for j in list(rec.pending):
                self._unpend(key, rec, j)
            rec.busy.clear()
            self._flushes.forget(key)
            self.deletes += 1
            self._tidy(key)
            self._changed()
            return held

    # ------------------------------------------------------------------ flush
    def flush_begin(self) -> FlushState:
        """What a flush that begins now waits for (see :mod:`tierstore.flushes`); failing levels get a fresh
        round of retries."""
        with self._lock:
            state = self._flushes.begin()
            for key, levels in self._flushes.take_failing().items():
                rec = self._keys[key]
                for j in levels:
                    rec.pending[j] = 0
                    self._flushes.opened(rec.epoch)
                    lv = self.levels[j]
                    lv.retry_at.pop(key, None)
                    lv.ready[key] = None
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
        """``(failed, dropped)``: per key the levels it could not reach (given up, or failing now) and those
        the pressure policy dropped."""
        with self._lock:
            return self._flushes.losses(self._stale_gone)

    def _stale_gone(self, key: ChunkKey, level: int) -> bool:
        """Whether the older copy of ``key`` that ``level`` could not remove has gone since (under the lock)."""
        packed = self.levels[level].copies.get(key)
        rec = self._keys.get(key)
        return packed is None or rec is None or packed >> _SIZE_BITS == rec.gen

    # ------------------------------------------------------------------ stats
    def level_stats(self, level: int) -> dict[str, float | int | None]:
        now = self.clock()
        with self._lock:
            lv = self.levels[level]
            pending, oldest = 0, now
            for rec in self._keys.values():
                if level in rec.pending:
                    pending += 1
                    oldest = min(oldest, rec.since)
            return {"used_bytes": lv.used, "capacity_bytes": lv.spec.capacity, "objects": len(lv.copies),
                    "reserved_bytes": lv.reserved, "pinned": len(lv.pins), "space_limit_bytes": lv.space.bytes,
                    "set_aside": sum(1 for until, _ in lv.aside.values() if until > now),
                    "writeback_pending": pending, "writeback_lag_s": now - oldest, **lv.counts}

    def dirty(self) -> int:
        """Keys with a value not yet written to every level it must reach."""
        with self._lock:
            return self._dirty

    def keys(self, level: int) -> list[ChunkKey]:
        """The keys ``level`` holds, least recently used first."""
        with self._lock:
            return list(self.levels[level].copies)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


__all__ = ["REMOVING", "UNKNOWN", "FlushState", "Hold", "LevelSpec", "Pressure", "Residency", "Room", "Slot",
           "Victim", "Write"]
