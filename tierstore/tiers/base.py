"""The :class:`Tier` interface and the bookkeeping every tier shares.

A tier is one storage level (device, host, disk, remote). This base class owns the control plane —
the index of keys and sizes, LRU order, byte accounting, eviction and counters — and leaves the data
plane to four primitives a subclass implements: ``_prepare`` (turn tensors into what is stored),
``_store``, ``_load`` and ``_drop``. Storage I/O always runs outside the tier's lock. Pins, exclusive
per-key claims and reservations live in :mod:`tierstore.tiers.claims`; the read path (batched gets,
``verify_many`` and what a damaged or unreadable object does) in :mod:`tierstore.tiers.reads`.

Capacity is exact: ``used_bytes + reserved`` never exceeds ``capacity``. A put first reserves its bytes,
evicting least-recently-used, unpinned keys synchronously until they fit; a victim is handed to
``before_evict`` (the tiered store writes a dirty chunk below there, and says to keep it if it cannot)
and removed unless it must stay. A put that cannot get room within ``pin_wait`` skips the tier; a
refused overwrite removes the old value, so a tier never serves a value older than its last put.
"""

from __future__ import annotations

import errno
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import objformat
from ..errors import InvalidInputError
from ..keys import ChunkKey, check_key
from ..objformat import validate_chunk
from ..policy import LRUPolicy
from ..telemetry import Failures, Latency
from ..tensors import TensorDict, fill_out, nbytes
from .claims import Claims
from .reads import CORRUPT, ERROR, FORGED, MISSING, OK, UNSUPPORTED, TierReads
from .space import SpaceLimit

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("tierstore")

COUNTERS = ("hits", "misses", "puts", "evictions", "bytes_in", "bytes_out", "corrupt", "unsupported", "forged",
            "errors", "skipped", "enospc", "touches")

#: ``before_evict(tier, key) -> bool``: ``False`` keeps the victim (a dirty chunk that could not be saved)
BeforeEvict = Callable[["Tier", ChunkKey], "bool | None"]

__all__ = ["COUNTERS", "CORRUPT", "ERROR", "FORGED", "MISSING", "OK", "UNSUPPORTED", "BeforeEvict", "Tier"]


class Tier(TierReads, ABC):
    """One storage level holding chunks (``Mapping[str, Tensor]``) by :class:`ChunkKey`.

    Batched methods (``get_many``, ``put_many``, ``contains_many``, ``delete_many``) are the interface;
    the single-key forms are conveniences over them. Repeated keys are fine in every batched call. All
    methods are thread-safe.
    """

    kind: ClassVar[str] = ""
    #: whether a put of an existing key replaces its value (a tier that keeps the first must say so)
    overwrites: ClassVar[bool] = True
    #: seconds a put waits for room (pins released, others' evictions and writes finished) before it skips
    pin_wait: float = 2.0
    #: seconds after ENOSPC before free space is probed again (doubling while the storage stays full)
    enospc_recheck: float = 1.0
    max_enospc_recheck: ClassVar[float] = 60.0
    #: a read-only tier serves reads and refuses writes; the tiered store never writes to one
    read_only: bool = False
    #: storage other processes read and write (a remote prefix): a reader never deletes there, not even
    #: a damaged object; it forgets it in this process and leaves removal to ``verify_many(repair=True)``
    shared: ClassVar[bool] = False

    def __init__(self, name: str | None = None, capacity: int | None = None):
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0):
            raise InvalidInputError(f"capacity must be a non-negative int or None, got {capacity!r}")
        self.name = name or self.kind
        self.capacity = capacity
        self.before_evict: BeforeEvict | None = None
        self._lru: LRUPolicy[ChunkKey] = LRUPolicy()
        self._claims = Claims(self._lru, self.name)
        self._cond = self._claims.cond
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._failures = Failures(log, f"tier {self.name}: ")
        self.latency = Latency()  # seconds per batched get, put and lookup (contains) call
        self._space = SpaceLimit()
        self._discards = 0  # deletes finished so far: a reader indexes what it found only if none ran meanwhile

    # ------------------------------------------------------------------ primitives for subclasses
    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor] | objformat.Encoded) -> tuple[Any, int]:
        """Return ``(payload, size)``: what ``_store`` writes and the bytes it will occupy (an encoded
        object comes only to tiers that :attr:`stores_objects`)."""
        assert not isinstance(tensors, objformat.Encoded)
        return tensors, nbytes(tensors)

    @abstractmethod
    def _store(self, key: ChunkKey, payload: Any, size: int) -> None:
        """Write ``payload`` so that a reader sees all of it or nothing."""

    @abstractmethod
    def _load(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False) -> TensorDict | None:
        """Read a chunk. ``None`` if it vanished; raise :class:`CorruptObjectError` if it is bad.

        With ``borrow``, memory tiers may return their own tensors (the caller holds a pin and must not
        modify them); other tiers return fresh tensors either way.
        """

    def _load_into(self, key: ChunkKey, size: int, out: Mapping[str, torch.Tensor]) -> TensorDict | None:
        """Fill caller-owned ``out`` from storage; ``None`` if the object vanished.

        Default: borrow and copy. Tiers that can read straight into ``out`` override it (disk). Raises
        like :meth:`_load`, plus :class:`InvalidInputError` when ``out`` does not match the chunk; after
        :class:`CorruptObjectError` ``out`` holds unspecified bytes.
        """
        data = self._load(key, size, "cpu", borrow=True)
        return None if data is None else fill_out(out, data)

    @abstractmethod
    def _drop(self, key: ChunkKey) -> None:
        """Remove a chunk from storage (missing is fine).

        Must be safe while a reader that pinned the key during the drop still copies it: files are
        unlinked, memory that may still be read is released by :meth:`_last_unpin`.
        """

    def _last_unpin(self, key: ChunkKey) -> None:
        """Called under the lock when ``key``'s last pin is released (memory tiers free retired memory)."""

    def _probe(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """Sizes of ``keys`` found in storage but not in the index (other writers); default: none."""
        return [None] * len(keys)

    def _free_space(self) -> int | None:
        """Bytes free on the underlying storage after ENOSPC; ``None`` = unknown (just try again)."""
        return None

    def _close(self) -> None:
        """Release resources; called once."""

    def _map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """Run per-key data-plane work; I/O-bound tiers override this with a bounded pool."""
        return [fn(x) for x in items]

    # ------------------------------------------------------------------ accounting
    @property
    def used_bytes(self) -> int:
        return self._lru.currsize

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[ChunkKey]:
        with self._cond:
            return list(self._lru)

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    def _fail(self, what: str, msg: str, *args: Any) -> None:
        """Count a failure of kind ``what`` and log it (rate-limited, see :class:`~tierstore.telemetry.Failures`)."""
        self._failures.report(what, msg, *args)

    def _index_add(self, key: ChunkKey, size: int) -> None:
        """Register an object found in storage (index rebuild, probe). Call with the lock held."""
        self._lru.add(key, size)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"kind": self.kind, "used_bytes": self._lru.currsize, "capacity_bytes": self.capacity,
                    "space_limit_bytes": self._space.bytes, "objects": len(self._lru),
                    "reserved_bytes": self._claims.reserved, "pinned": len(self._claims.pins), **self._counts,
                    "failures": self._failures.counts()}

    def _check_open(self) -> None:
        self._claims.check_open()

    # ------------------------------------------------------------------ pins (two-phase access)
    def pin(self, keys: Iterable[ChunkKey], touch: bool = True) -> list[int | None]:
        """Pin the keys this tier holds against eviction; return their sizes (``None`` = absent).

        Every key whose size is not ``None`` must later be passed to :meth:`unpin`, once per time it was
        pinned. ``touch`` marks them recently used; internal copies (write-back, eviction) pass ``False``
        so they leave LRU order alone.
        """
        return self._claims.pin([check_key(k) for k in keys], touch)

    def unpin(self, keys: Iterable[ChunkKey]) -> None:
        self._claims.unpin(keys, self._last_unpin)

    def note_use(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` were just served by a tier above this one. A shared tier refreshes their last use (what
        ``gc --max-size`` orders by, see :class:`~tierstore.tiers.remote.RemoteTier`); others need not."""

    def holds(self, key: ChunkKey) -> bool:
        """Whether the index has ``key`` and no eviction of it is under way (no I/O).

        Write-back's test for "another tier keeps a copy": a copy being evicted does not count.
        """
        with self._cond:
            return key in self._lru and key not in self._claims.evicting

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]], *,
                 keep_on_failure: bool = False) -> list[bool]:
        """Store each ``(key, tensors)``; ``False`` where it was skipped (too big, no room, I/O error).

        Bad input (wrong key type, non-tensor values) raises before anything is written. After ``False``
        a private tier no longer holds the key at all (never its older value), unless ``keep_on_failure``
        (the tiered store, which then decides itself what must go: a put that lands nowhere keeps the
        previous value).
        """
        start = perf_counter()
        try:
            return self._put_many(items, keep_on_failure)
        finally:
            self.latency.since("put", start)

    def _put_many(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]], keep_on_failure: bool
                  ) -> list[bool]:
        self._check_open()
        items = list(items)
        for key, tensors in items:
            check_key(key)
            validate_chunk(tensors)
        return self._map(lambda item: self._put_one(item[0], item[1], keep_on_failure), items)

    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        return self.put_many([(key, tensors)])[0]

    def put_objects(self, items: Sequence[tuple[ChunkKey, objformat.Encoded]]) -> list[bool]:
        """Store verified objects another tier read with :meth:`copy_encoded`, as they are (tiers that
        :attr:`stores_objects`, with the objects' codec); ``False`` as for :meth:`put_many`."""
        start = perf_counter()
        try:
            self._check_open()
            if not self.stores_objects:
                raise InvalidInputError(f"tier {self.name!r} does not store encoded objects")
            return self._map(lambda item: self._put_one(*item), list(items))
        finally:
            self.latency.since("put", start)

    def _put_one(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor] | objformat.Encoded,
                 keep_on_failure: bool = False) -> bool:
        payload, size = self._prepare(key, tensors)
        with self._claims.exclusive(key):
            if self._store_reserved(key, payload, size):
                return True
            if not (self.shared or keep_on_failure):  # a shared tier keeps what others may read
                self._discard(key)
            return False

    def _store_reserved(self, key: ChunkKey, payload: Any, size: int) -> bool:
        for attempt in range(2):
            limit = self._limit()
            reserved = None
            if limit is None or size <= limit:
                reserved = self._claims.reserve(key, size, limit, self._evict, time.monotonic() + self.pin_wait)
            if reserved is None:
                self._count("skipped")
                return False
            try:
                self._store(key, payload, size)
            except OSError as exc:
                self._claims.release(reserved)
                if exc.errno == errno.ENOSPC and attempt == 0:
                    self._after_enospc()
                    continue
                self._count("errors")
                self._fail("write", "write failed (%s); skipping", exc)
                return False
            except BaseException:
                self._claims.release(reserved)
                raise
            self._claims.commit(key, size, reserved)
            with self._cond:
                self._counts["puts"] += 1
                self._counts["bytes_in"] += size
                self._space.stored()
            return True
        return False

    # ------------------------------------------------------------------ a full device (ENOSPC)
    def _after_enospc(self) -> None:
        """The storage is full below our capacity: hold at most what we hold now (see :mod:`.space`)."""
        with self._cond:
            self._counts["enospc"] += 1
            held = self._lru.currsize + self._claims.reserved
            backoff = self._space.full(held, self.enospc_recheck, self.max_enospc_recheck)
        self._fail("enospc", "no space left on device; holding at most %d bytes, re-probing free space "
                       "in %.1fs (doubling while full)", held, backoff)

    def _limit(self) -> int | None:
        """The bytes this tier may hold now: its capacity, lowered after ENOSPC until free space returns."""
        if self._space.due():
            free = self._free_space()
            with self._cond:
                self._space.probed(self._lru.currsize + self._claims.reserved, free)
        with self._cond:
            return self._space.apply(self.capacity)

    # ------------------------------------------------------------------ eviction and deletes
    def _discard(self, key: ChunkKey, drop_absent: bool = False) -> bool:
        """Remove ``key`` from index and storage (the caller holds its exclusive claim); whether it was indexed.

        Storage is touched only for an indexed key unless ``drop_absent`` (a damaged object found by a read).
        """
        with self._cond:
            present = key in self._lru
            if present:
                self._lru.remove(key)
        try:
            if present or drop_absent:
                try:
                    self._drop(key)
                except OSError as exc:
                    self._fail("drop", "could not remove %s: %s", key.hex(), exc)
        finally:
            with self._cond:
                self._discards += 1
        return present

    def _evict(self, victims: list[tuple[ChunkKey, int]]) -> set[ChunkKey]:
        """Hand each victim to ``before_evict``, then remove it unless it must stay; return the kept keys.

        A victim stays when ``before_evict`` says so (a dirty chunk it could not write below) or a reader
        pinned it after selection. Never waiting for readers keeps lock order acyclic: a reader may hold
        a pin here while it waits for a put into another tier whose eviction chain leads back to this one.
        """
        kept: set[ChunkKey] = set()
        for k, size in victims:
            keep = False
            if self.before_evict is not None:
                try:
                    keep = self.before_evict(self, k) is False
                except Exception as exc:  # never drop what could not be saved
                    keep = True
                    self._count("errors")
                    self._fail("before_evict", "write-back before eviction failed: %s", exc)
            with self._cond:
                keep = keep or self._claims.pinned(k)
            if keep:
                self._claims.end_eviction(k, size, removed=False)
                kept.add(k)
                continue
            try:
                self._drop(k)
            except OSError as exc:
                self._fail("drop", "could not remove %s: %s", k.hex(), exc)
            if self._claims.end_eviction(k, size, removed=True):
                self._count("evictions")
        return kept

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        """Remove keys; returns how many the index held (a repeated key counts once). On a shared tier,
        whose index knows only what this process saw, storage is asked to remove every key."""
        self._check_open()
        n = 0
        for k in dict.fromkeys(check_key(k) for k in keys):
            with self._claims.exclusive(k):
                n += self._discard(k, drop_absent=self.shared)
        return n

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key]) == 1

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float = 5.0) -> None:
        """Refuse new work, wait up to ``timeout`` s for running puts and deletes, release resources.

        Idempotent and thread-safe.
        """
        if self._claims.close(timeout):
            self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.used_bytes}/{self.capacity} bytes, {len(self)} objects>"
