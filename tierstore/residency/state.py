"""The residency's records: one per key while anything is going on (its generation, slots in flight,
pending tiers, delete and tombstone marks), and one per tier (its index of copies in LRU order with their
byte budget, pins, evictions in flight, set-aside victims, ENOSPC limit, write-back queue and counters).
Plain data: :class:`~tierstore.residency.Residency` changes them under its lock."""

from __future__ import annotations

from collections import OrderedDict

from ..keys import ChunkKey
from .model import TierSpec

#: ``aside`` entry of a victim never set aside: (until, back-off s)
NOT_ASIDE = (0.0, 0.0)


class KeyState:
    """Per-key state while anything is going on (see the module docstring)."""

    __slots__ = ("busy", "deleting", "epoch", "gen", "pending", "tomb")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.pending: dict[int, int] = {}  # tier -> failed attempts since the last success
        self.busy: dict[int, int] = {}  # tier -> generation being written there, or REMOVING
        self.deleting = 0  # generation of a delete in progress (0: none)
        self.epoch = 0  # the flush epoch its pending writes are counted under (see tierstore.flushes)
        #: its value was dropped before reaching a shared tier, which may hold an older value this store
        #: never indexed: the record stays (no probe, nothing found indexed) until the key is put or deleted
        self.tomb = False


class TierIndex:
    """One tier's index: its copies (LRU first) and budget, and what goes on there."""

    __slots__ = ("aside", "copies", "counts", "evicting", "evicting_bytes", "failing", "pending", "pins",
                 "ready", "reserved", "retry_at", "retry_heap", "space", "spec", "used")

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.copies: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> packed (gen, size), LRU first
        self.used = 0
        self.reserved = 0
        self.evicting: dict[ChunkKey, int] = {}
        self.evicting_bytes = 0
        self.pins: dict[ChunkKey, int] = {}
        self.ready: dict[ChunkKey, None] = {}  # write-backs due now, in order
        #: keys pending for this tier -> when they became pending, oldest first (its backlog and lag, counted
        #: as they change: stats never walk the keys)
        self.pending: OrderedDict[ChunkKey, float] = OrderedDict()
        self.retry_at: dict[ChunkKey, float] = {}
        self.retry_heap: list[tuple[float, int, ChunkKey]] = []
        self.space = SpaceLimit()
        #: victims that could not be evicted (their copy unreadable or unremovable): key -> (until, back-off s);
        #: no eviction names them again before ``until``
        self.aside: dict[ChunkKey, tuple[float, float]] = {}
        self.counts = {"evictions": 0, "eviction_failures": 0, "writeback_done": 0, "writeback_failed": 0,
                       "writeback_dropped": 0}
        self.failing = False  # a write into it kept failing, and none has succeeded since


class SpaceLimit:
    """How many bytes a tier may hold after its storage said ENOSPC: what it held then, until a probe of
    free space (after a back-off that doubles while the storage stays full) says more."""

    __slots__ = ("backoff", "bytes", "lifted", "recheck_at")

    def __init__(self) -> None:
        self.bytes: int | None = None
        self.recheck_at = 0.0
        self.backoff = 0.0
        self.lifted = False


__all__ = ["NOT_ASIDE", "KeyState", "TierIndex", "SpaceLimit"]
