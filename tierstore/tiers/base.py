"""The :class:`Tier` interface and the bookkeeping every tier shares.

A tier is one storage level (device, host, disk, remote). This base class owns the control plane —
the index of keys and sizes, LRU order, byte accounting, eviction and counters — and leaves the data
plane to four primitives a subclass implements: ``_prepare`` (turn tensors into what is stored),
``_store``, ``_load`` and ``_drop``. Storage I/O always runs outside the tier's lock. Pins, exclusive
per-key claims and reservations live in :mod:`tierstore.tiers.claims`.

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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import CorruptObjectError, InvalidInputError, UnsupportedObjectError
from ..keys import ChunkKey, check_key
from ..objformat import validate_chunk
from ..policy import LRUPolicy
from ..tensors import TensorDict, fill_out, nbytes
from .claims import Claims
from .space import SpaceLimit

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("tierstore")

COUNTERS = ("hits", "misses", "puts", "evictions", "bytes_in", "bytes_out", "corrupt", "unsupported", "errors",
            "skipped", "enospc")
#: outcomes of reading one object (see ``Tier._read_checked``)
OK, MISSING, CORRUPT, UNSUPPORTED, ERROR = "ok", "missing", "corrupt", "unsupported", "error"

#: ``before_evict(tier, key) -> bool``: ``False`` keeps the victim (a dirty chunk that could not be saved)
BeforeEvict = Callable[["Tier", ChunkKey], "bool | None"]


class Tier(ABC):
    """One storage level holding chunks (``Mapping[str, Tensor]``) by :class:`ChunkKey`.

    Batched methods (``get_many``, ``put_many``, ``contains_many``, ``delete_many``) are the interface;
    the single-key forms are conveniences over them. Repeated keys are fine in every batched call. All
    methods are thread-safe.
    """

    kind: ClassVar[str] = ""
    #: whether a put of an existing key replaces its value (write-once remote tiers keep the first)
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
        self._logged: set[str] = set()
        self._space = SpaceLimit()

    # ------------------------------------------------------------------ primitives for subclasses
    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, int]:
        """Return ``(payload, size)``: what ``_store`` writes and the bytes it will occupy."""
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

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning("tier %s: " + msg, self.name, *args)

    def _index_add(self, key: ChunkKey, size: int) -> None:
        """Register an object found in storage (index rebuild, probe). Call with the lock held."""
        self._lru.add(key, size)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"kind": self.kind, "used_bytes": self._lru.currsize, "capacity_bytes": self.capacity,
                    "space_limit_bytes": self._space.bytes, "objects": len(self._lru),
                    "reserved_bytes": self._claims.reserved, "pinned": len(self._claims.pins), **self._counts}

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

    @contextmanager
    def borrowed(self, key: ChunkKey) -> Iterator[TensorDict | None]:
        """Pin ``key`` and yield its tensors without copying where the tier allows (read-only!).

        An internal access: it does not count as a hit or change LRU order.
        """
        (size,) = self.pin([key], touch=False)
        if size is None:
            yield None
            return
        try:
            yield self._load_checked(key, size, "cpu", borrow=True)
        finally:
            self.unpin([key])

    def copy_out(self, key: ChunkKey) -> TensorDict | None:
        """The chunk as fresh CPU tensors the caller owns, or ``None``; holds no pin once it returns.

        An internal access like :meth:`borrowed` (no hit counted, LRU order unchanged), for copies that
        go to a tier whose eviction may need this one (promotion, write-back from a deeper tier).
        """
        (size,) = self.pin([key], touch=False)
        if size is None:
            return None
        try:
            return self._load_checked(key, size, "cpu")
        finally:
            self.unpin([key])

    # ------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[ChunkKey], probe: bool = True) -> list[bool]:
        """Whether each key is held. ``probe=False`` checks the in-memory index only (no I/O)."""
        keys = [check_key(k) for k in keys]
        with self._cond:
            found = [k in self._lru for k in keys]
        missing = list(dict.fromkeys(k for k, f in zip(keys, found, strict=True) if not f))
        if missing and probe:
            probed = dict(zip(missing, self._probe(missing), strict=True))
            with self._cond:
                for k, size in probed.items():
                    if size is not None and k not in self._lru:
                        self._index_add(k, size)
            found = [f or probed.get(k) is not None for k, f in zip(keys, found, strict=True)]
        return found

    def get_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """Return each key's tensors on ``device`` (fresh tensors the caller owns) or ``None``.

        A repeated key is read once; each further slot gets its own copy.
        """
        self._check_open()
        keys = list(keys)
        unique = list(dict.fromkeys(keys))
        held = [k for k, p in zip(unique, self.contains_many(unique), strict=True) if p]
        size_of = {k: s for k, s in zip(held, self.pin(held), strict=True) if s is not None}
        try:
            values = self._map(lambda k: None if k not in size_of else self._load_checked(k, size_of[k], device),
                               unique)
            loaded = dict(zip(unique, values, strict=True))
        finally:
            self.unpin(size_of)
        results: list[TensorDict | None] = []
        seen: set[ChunkKey] = set()
        for k in keys:
            value = loaded[k]
            if value is not None and k in seen:
                value = {name: t.clone() for name, t in value.items()}
            seen.add(k)
            results.append(value)
        hits = sum(r is not None for r in results)
        with self._cond:
            self._counts["hits"] += hits
            self._counts["misses"] += len(results) - hits
            self._counts["bytes_out"] += sum(size_of[k] for k, r in zip(keys, results, strict=True) if r is not None)
        return results

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]
                      ) -> list[TensorDict | InvalidInputError | None]:
        """Fill ``outs[i]`` from ``keys[i]`` for every key held, on the tier's I/O parallelism.

        Returns per key ``outs[i]`` as a dict (a hit), ``None`` (a miss) or the
        :class:`InvalidInputError` raised because ``outs[i]`` does not match the stored chunk (nothing
        else is affected). A key may appear more than once (each with its own ``out``).
        """
        self._check_open()
        keys = list(keys)
        present = self.contains_many(keys)
        pinned = [k for k, p in zip(keys, present, strict=True) if p]
        size_of = {k: s for k, s in zip(pinned, self.pin(pinned), strict=True) if s is not None}
        try:
            results: list[TensorDict | InvalidInputError | None] = [None] * len(keys)
            todo = [i for i, k in enumerate(keys) if k in size_of]
            loaded = self._load_many_into([(keys[i], size_of[keys[i]], outs[i]) for i in todo])
            for i, r in zip(todo, loaded, strict=True):
                results[i] = r
        finally:  # one unpin per pin: a key listed twice was pinned twice
            self.unpin(k for k in pinned if k in size_of)
        hits = [i for i, r in enumerate(results) if isinstance(r, dict)]
        with self._cond:
            self._counts["hits"] += len(hits)
            self._counts["misses"] += len(results) - len(hits)
            self._counts["bytes_out"] += sum(size_of[keys[i]] for i in hits)
        return results

    def _load_many_into(self, work: list[tuple[ChunkKey, int, Mapping[str, torch.Tensor]]]
                        ) -> list[TensorDict | InvalidInputError | None]:
        """Fill each ``(key, size, out)`` of pinned keys (see :meth:`get_many_into`). Tiers with a faster
        batched read path override this."""
        def one(item: tuple[ChunkKey, int, Mapping[str, torch.Tensor]]) -> TensorDict | InvalidInputError | None:
            try:
                return self._load_checked(*item[:2], "cpu", out=item[2])
            except InvalidInputError as exc:
                return exc

        return self._map(one, work)

    def _load_checked(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False,
                      out: Mapping[str, torch.Tensor] | None = None,
                      reader: Callable[[], TensorDict | None] | None = None) -> TensorDict | None:
        """Read a chunk (through ``reader`` when given, e.g. a batched fast path); anything wrong with the
        stored object is a counted miss, never an exception."""
        return self._read_checked(key, size, device, borrow, out, reader=reader)[0]

    def _read_checked(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False,
                      out: Mapping[str, torch.Tensor] | None = None, repair: bool = False,
                      reader: Callable[[], TensorDict | None] | None = None) -> tuple[TensorDict | None, str]:
        """``(tensors or None, outcome)``: read a chunk and classify what went wrong.

        * damaged (:class:`CorruptObjectError`): counted ``corrupt``, forgotten; removed from storage on
          a private tier, on a :attr:`shared` one only with ``repair``;
        * unsupported (:class:`UnsupportedObjectError`: newer format, dtype this torch lacks): counted
          ``unsupported``, never removed (another reader may need it); a shared tier forgets it, a private
          one keeps it indexed so its bytes stay accounted for until it is evicted;
        * gone (``FileNotFoundError``): forgotten;
        * an I/O error or an object too large for memory right now: counted ``errors``, kept.

        :class:`InvalidInputError` (``out`` does not match an intact chunk) propagates.
        """
        try:
            if reader is not None:
                data = reader()
            elif out is not None:
                data = self._load_into(key, size, out)
            else:
                data = self._load(key, size, device, borrow)
            return data, OK if data is not None else MISSING
        except UnsupportedObjectError as exc:
            self._count("unsupported")
            self._log_once("unsupported", "cannot read object %s (left in place): %s", key.hex(), exc)
            if self.shared:
                self._forget(key, remove=False)
            return None, UNSUPPORTED
        except CorruptObjectError as exc:
            self._count("corrupt")
            remove = repair or not self.shared
            self._log_once("corrupt", "%s damaged object %s: %s", "removing" if remove else "skipping",
                           key.hex(), exc)
            self._forget(key, remove=remove)
            return None, CORRUPT
        except FileNotFoundError:  # removed by another process or a racing delete
            self._forget(key, remove=False)
            return None, MISSING
        except (OSError, MemoryError) as exc:
            self._count("errors")
            self._log_once("read", "read failed (%s: %s); treating as a miss", type(exc).__name__, exc)
            return None, ERROR

    def verify_many(self, keys: Sequence[ChunkKey], repair: bool = False) -> list[str]:
        """Read and check each key's stored object; return each outcome (``"ok"``, ``"missing"``,
        ``"corrupt"``, ``"unsupported"``, ``"error"``).

        Outcomes are handled as on any read; ``repair`` also removes damaged objects from a shared tier
        (``tierstore verify --repair``). Unsupported objects are never removed. No hit/miss counting.
        """
        self._check_open()
        keys = [check_key(k) for k in keys]
        unique = list(dict.fromkeys(keys))
        self.contains_many(unique)  # a shared tier also checks objects this process has not indexed
        held = [(k, size) for k, size in zip(unique, self.pin(unique, touch=False), strict=True) if size is not None]
        try:
            outcomes = self._map(lambda kv: self._read_checked(kv[0], kv[1], "cpu", True, None, repair)[1], held)
        finally:
            self.unpin(k for k, _ in held)
        outcome = dict(zip((k for k, _ in held), outcomes, strict=True))
        return [outcome.get(k, MISSING) for k in keys]

    def _forget(self, key: ChunkKey, remove: bool = True) -> None:
        """Drop a key whose object is gone, damaged or unreadable from the index, and with ``remove``
        from storage.

        Never waits: the caller may itself be evicting the key (``before_evict`` reads it). A key that is
        being written, deleted or evicted is left to that operation, which replaces or removes it anyway;
        one stored again since the reader pinned it is left alone (the failure may be the old object's).
        """
        if not self._claims.try_claim_to_forget(key):
            return
        try:
            with self._cond:
                if key in self._lru:
                    self._lru.remove(key)
            if remove:
                try:
                    self._drop(key)
                except OSError:
                    pass
        finally:
            self._claims.unclaim(key)

    def _discard(self, key: ChunkKey, drop_absent: bool = False) -> bool:
        """Remove ``key`` from index and storage (the caller holds its exclusive claim); whether it was indexed.

        Storage is touched only for an indexed key unless ``drop_absent`` (a damaged object found by a read).
        """
        with self._cond:
            present = key in self._lru
            if present:
                self._lru.remove(key)
        if present or drop_absent:
            try:
                self._drop(key)
            except OSError as exc:
                self._log_once("drop", "could not remove %s: %s", key.hex(), exc)
        return present

    def get(self, key: ChunkKey, device: str | torch.device = "cpu",
            out: Mapping[str, torch.Tensor] | None = None) -> TensorDict | None:
        """One chunk as fresh tensors on ``device``, or copied into caller-owned ``out``."""
        if out is None:
            return self.get_many([key], device=device)[0]
        return self.get_into(key, out)

    def get_into(self, key: ChunkKey, out: Mapping[str, torch.Tensor]) -> TensorDict | None:
        """Fill ``out`` (same names, shapes, dtypes) from the stored chunk; ``None`` on a miss.

        Memory tiers copy straight from their own tensors: no allocation on this path.
        """
        self._check_open()
        size = self.pin([key])[0] if self.contains(key) else None
        result = None
        if size is not None:
            try:
                result = self._load_checked(key, size, "cpu", out=out)
            finally:
                self.unpin([key])
        with self._cond:
            self._counts["hits" if result is not None else "misses"] += 1
            self._counts["bytes_out"] += size if result is not None and size is not None else 0
        return result

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def holds(self, key: ChunkKey) -> bool:
        """Whether the index has ``key`` and no eviction of it is under way (no I/O).

        Write-back's test for "another tier keeps a copy": a copy being evicted does not count.
        """
        with self._cond:
            return key in self._lru and key not in self._claims.evicting

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]]) -> list[bool]:
        """Store each ``(key, tensors)``; ``False`` where it was skipped (too big, no room, I/O error).

        Bad input (wrong key type, non-tensor values) raises before anything is written. After ``False``
        an overwriting tier no longer holds the key at all (never its older value).
        """
        self._check_open()
        items = list(items)
        for key, tensors in items:
            check_key(key)
            validate_chunk(tensors)
        return self._map(lambda item: self._put_one(*item), items)

    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        return self.put_many([(key, tensors)])[0]

    def _put_one(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        if not self.overwrites and self.contains(key):
            return True
        payload, size = self._prepare(key, tensors)
        with self._claims.exclusive(key):
            if not self.overwrites and self.contains_many([key], probe=False)[0]:
                return True  # a concurrent put of the same key won
            if self._store_reserved(key, payload, size):
                return True
            if self.overwrites:
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
                self._log_once("write", "write failed (%s); skipping", exc)
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
        self._log_once("enospc", "no space left on device; holding at most %d bytes, re-probing free space "
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
                    self._log_once("before_evict", "write-back before eviction failed: %s", exc)
            with self._cond:
                keep = keep or self._claims.pinned(k)
            if keep:
                self._claims.end_eviction(k, size, removed=False)
                kept.add(k)
                continue
            try:
                self._drop(k)
            except OSError as exc:
                self._log_once("drop", "could not remove %s: %s", k.hex(), exc)
            if self._claims.end_eviction(k, size, removed=True):
                self._count("evictions")
        return kept

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        """Remove keys; returns how many were present (a repeated key counts once)."""
        self._check_open()
        n = 0
        for k in dict.fromkeys(check_key(k) for k in keys):
            with self._claims.exclusive(k):
                n += self._discard(k)
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
