"""Residency: the one control plane of a store — where every copy of every chunk lives, and what may happen
to it next.

Pure bookkeeping: no I/O, no tensors, no threads started, no waiting. One lock guards all of it. Every method
answers at once with a decision that the data plane (:mod:`tierstore.transfers`) carries out and reports
back; callers that must wait (for a busy key, for room) wait on :meth:`Residency.wait_until`.

**What is kept.** Per tier (fastest first): the copies it holds in LRU order, each with its
size and the *generation* of the value it holds, the bytes held, reserved by writes in flight and being
evicted, pins, and a byte budget (its capacity, lowered after ENOSPC). Per key, only while something is
going on (a value not yet written everywhere, a storage mutation in flight, a delete, a copy holding an
older value): the current generation, the tiers still to receive it (*pending*, with failed attempts and
retry times) and the one storage mutation in flight per tier (*busy*).

**Where each part lives** (one lock, one object: the parts are mixins over one state):
:mod:`.model` (what callers see), :mod:`.state` (the per-key and per-tier records), :mod:`.core` (the lock,
waiting, generations, pending marks), :mod:`.copies` (reads, pins, probes, lost copies), :mod:`.writes`
(slots, commits, deletes), :mod:`.eviction` (room, victims, ENOSPC), :mod:`.queue` (write-back and flushes;
the flush counters are :mod:`tierstore.flushes`).

**The rules** (each checked by ``tests/test_residency.py`` without threads or files):

1. **Current or skipped.** Generations grow with every put and delete of the store. A copy is *current*
   when its generation is the key's (a key with no record: every copy is). Reads, sources of write-back
   and promotion use current copies only, so an older value is never served once a newer one landed.
2. **One storage mutation per key and tier.** Writing a copy (put, write-back, promotion, write-down) or
   removing one (eviction, delete, a damaged object) holds that ``(key, tier)`` *slot*; a write of an
   older generation than the tier already holds, or than a committed put, is *superseded* (skipped).
3. **Pending after landing.** A put's copy and the pending tiers below it are recorded in one step
   (:meth:`commit_write`), so no eviction can mistake the only copy of a value for a clean one.
4. **Exact capacity.** ``used + reserved`` never exceeds a tier's budget: a write reserves first;
   :meth:`reserve` names victims, least recently used first, never pinned, busy or being deleted ones.
5. **Dirty victims go down first.** A victim whose copy is the only current one while lower tiers are
   pending is written to the nearest pending tier that is not backing off before it is removed; when none
   can take it, the pressure policy keeps it (``keep``) or drops it, counted and reported (``drop``), never
   while a lower tier holds an older value of it.
6. **Retry while held.** A failed write of a pending tier is retried with exponential back-off; after
   ``fast_retries`` failures the tier is *failing* (reported by a flush). A tier with no current copy left to
   read from is given up and reported.
7. **Deletes win.** A delete waits for mutations in flight, refuses writes of older generations and removes
   every copy; a probe or read that began before a delete ended indexes nothing it found.
"""

from __future__ import annotations

from ..flushes import FlushState
from ..keys import ChunkKey
from .copies import Copies
from .eviction import Eviction
from .model import REMOVING, UNKNOWN, Hold, Pressure, Room, Slot, TierSpec, Victim, Write
from .queue import WriteBack
from .writes import Writes


class Residency(Copies, Writes, Eviction, WriteBack):
    """The control plane of one store over ``tiers`` (fastest first). Thread-safe; nothing here blocks
    except :meth:`wait_until`."""

    # ------------------------------------------------------------------ stats
    def tier_stats(self, tier: int) -> dict[str, float | int | None]:
        """``tier``'s figures for ``stats()``, from counters kept as they change (no walk of the keys; the
        set-aside count walks only the victims set aside, which failed eviction)."""
        now = self.clock()
        with self._lock:
            tr = self.tiers[tier]
            pending = tr.pending
            oldest = next(iter(pending.values())) if pending else now
            return {"used_bytes": tr.used, "capacity_bytes": tr.spec.capacity, "objects": len(tr.copies),
                    "reserved_bytes": tr.reserved, "pinned": len(tr.pins), "space_limit_bytes": tr.space.bytes,
                    "set_aside": sum(1 for until, _ in tr.aside.values() if until > now),
                    "writeback_pending": len(pending), "writeback_lag_s": now - oldest, **tr.counts}

    def keys(self, tier: int) -> list[ChunkKey]:
        """The keys ``tier`` holds, least recently used first (a copy of the index: admin and tests only)."""
        with self._lock:
            return list(self.tiers[tier].copies)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


__all__ = ["REMOVING", "UNKNOWN", "FlushState", "Hold", "Pressure", "Residency", "Room", "Slot",
           "TierSpec", "Victim", "Write"]
