"""The :class:`Tier` interface and the bookkeeping every tier shares.

A tier is one storage level (device, host, disk, remote). This base class owns the control plane —
the index of keys and sizes, LRU order, pins, byte accounting, eviction and counters — and leaves the
data plane to four primitives a subclass implements: ``_prepare`` (turn tensors into what is stored),
``_store``, ``_load`` and ``_drop``. Storage I/O always runs outside the tier's lock.

Capacity is exact: ``used_bytes + reserved`` never exceeds ``capacity``. A put first reserves its bytes,
evicting least-recently-used, unpinned keys synchronously until they fit; a victim is handed to
``before_evict`` (the tiered store writes a dirty chunk below there) and removed unless a reader pinned it
meanwhile. Mutations of one key (store, delete, drop) never overlap (see ``_exclusive``).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import ClosedError, CorruptObjectError, InvalidInputError, UnsupportedObjectError
from ..keys import ChunkKey, check_key
from ..objformat import validate_chunk
from ..policy import LRUPolicy
from ..tensors import TensorDict, fill_out

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("tierstore")

COUNTERS = ("hits", "misses", "puts", "evictions", "bytes_in", "bytes_out", "corrupt", "unsupported", "errors",
            "skipped", "enospc")
#: outcomes of reading one object (see ``Tier._read_checked``)
OK, MISSING, CORRUPT, UNSUPPORTED, ERROR = "ok", "missing", "corrupt", "unsupported", "error"


class Tier(ABC):
    """One storage level holding chunks (``Mapping[str, Tensor]``) by :class:`ChunkKey`.

    Batched methods (``get_many``, ``put_many``, ``contains_many``, ``delete_many``) are the interface;
    the single-key forms are conveniences over them. All methods are thread-safe.
    """

    kind: ClassVar[str] = ""
    #: whether a put of an existing key replaces its value (write-once remote tiers keep the first)
    overwrites: ClassVar[bool] = True
    #: seconds a put waits for pinned chunks to be released before it skips this tier
    pin_wait: float = 2.0
    #: storage other processes read and write (a remote prefix): a reader never deletes there, not even
    #: a damaged object; it forgets it in this process and leaves removal to ``verify_many(repair=True)``
    shared: ClassVar[bool] = False

    def __init__(self, name: str | None = None, capacity: int | None = None):
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0):
            raise InvalidInputError(f"capacity must be a non-negative int or None, got {capacity!r}")
        self.name = name or self.kind
        self.capacity = capacity
        self.before_evict: Callable[[Tier, ChunkKey], None] | None = None
        self._cond = threading.Condition(threading.Lock())
        self._lru: LRUPolicy[ChunkKey] = LRUPolicy()
        self._pins: Counter[ChunkKey] = Counter()
        self._evicting: set[ChunkKey] = set()
        self._busy: set[ChunkKey] = set()  # keys being stored, deleted or forgotten (see _exclusive)
        self._evicting_bytes = 0
        self._reserved = 0
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._logged: set[str] = set()
        self._closed = False

    # ------------------------------------------------------------------ primitives for subclasses
    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, int]:
        """Return ``(payload, size)``: what ``_store`` writes and the bytes it will occupy."""
        from ..tensors import nbytes
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
        """Remove a chunk from storage (missing is fine)."""

    def _probe(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """Sizes of ``keys`` found in storage but not in the index (other writers); default: none."""
        return [None] * len(keys)

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

    def _log_once(self, what: str, msg: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning("tier %s: " + msg, self.name, *args)

    def _index_add(self, key: ChunkKey, size: int) -> None:
        """Register an object found in storage (index rebuild, probe). Call with the lock held."""
        self._lru.add(key, size)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"kind": self.kind, "used_bytes": self._lru.currsize, "capacity_bytes": self.capacity,
                    "objects": len(self._lru), "reserved_bytes": self._reserved,
                    "pinned": sum(1 for v in self._pins.values() if v), **self._counts}

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"tier {self.name!r} is closed")

    # ------------------------------------------------------------------ pins (two-phase access)
    def pin(self, keys: Iterable[ChunkKey], touch: bool = True) -> list[int | None]:
        """Pin the keys this tier holds against eviction; return their sizes (``None`` = absent).

        Every key whose size is not ``None`` must later be passed to :meth:`unpin`. ``touch`` marks them
        recently used; internal copies (write-back, eviction) pass ``False`` so they leave LRU order alone.
        """
        keys = [check_key(k) for k in keys]
        sizes: list[int | None] = []
        with self._cond:
            for k in keys:
                if k in self._lru:
                    self._pins[k] += 1
                    if touch:
                        self._lru.touch(k)
                    sizes.append(self._lru.size(k))
                else:
                    sizes.append(None)
        return sizes

    def unpin(self, keys: Iterable[ChunkKey]) -> None:
        with self._cond:
            for k in keys:
                self._pins[k] -= 1
                if self._pins[k] <= 0:
                    del self._pins[k]
            self._cond.notify_all()

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

    # ------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[ChunkKey], probe: bool = True) -> list[bool]:
        """Whether each key is held. ``probe=False`` checks the in-memory index only (no I/O)."""
        keys = [check_key(k) for k in keys]
        with self._cond:
            found = [k in self._lru for k in keys]
        missing = [k for k, f in zip(keys, found, strict=True) if not f]
        if missing and probe:
            probed = dict(zip(missing, self._probe(missing), strict=True))
            with self._cond:
                for k, size in probed.items():
                    if size is not None and k not in self._lru:
                        self._index_add(k, size)
            found = [f or probed.get(k) is not None for k, f in zip(keys, found, strict=True)]
        return found

    def get_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """Return each key's tensors on ``device`` (fresh tensors the caller owns) or ``None``."""
        self._check_open()
        keys = list(keys)
        present = self.contains_many(keys)
        sizes = self.pin(k for k, p in zip(keys, present, strict=True) if p)
        size_of = {k: s for k, s in zip((k for k, p in zip(keys, present, strict=True) if p), sizes, strict=True)
                   if s is not None}
        try:
            results = self._map(lambda k: None if k not in size_of
                                else self._load_checked(k, size_of[k], device), keys)
        finally:
            self.unpin(size_of)
        hits = sum(r is not None for r in results)
        with self._cond:
            self._counts["hits"] += hits
            self._counts["misses"] += len(results) - hits
            self._counts["bytes_out"] += sum(size_of[k] for k, r in zip(keys, results, strict=True) if r is not None)
        return results

    def _load_checked(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False,
                      out: Mapping[str, torch.Tensor] | None = None) -> TensorDict | None:
        """Read a chunk; anything wrong with the stored object is a counted miss, never an exception."""
        return self._read_checked(key, size, device, borrow, out)[0]

    def _read_checked(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False,
                      out: Mapping[str, torch.Tensor] | None = None,
                      repair: bool = False) -> tuple[TensorDict | None, str]:
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
            data = self._load_into(key, size, out) if out is not None else self._load(key, size, device, borrow)
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
        being written, deleted or evicted is left to that operation, which replaces or removes it anyway.
        """
        with self._cond:
            if key in self._busy or key in self._evicting:
                return
            self._busy.add(key)
            if key in self._lru:
                self._lru.remove(key)
        try:
            if remove:
                self._drop(key)
        except OSError:
            pass
        finally:
            self._unclaim(key)

    @contextmanager
    def _exclusive(self, key: ChunkKey) -> Iterator[None]:
        """Serialise mutations of one key (store, delete) with each other and with its eviction or
        forgetting; eviction skips a key held here.

        Without this, a drop racing a store of the same key frees or deletes what the store just wrote.
        """
        with self._cond:
            while key in self._busy or key in self._evicting:
                self._cond.wait()
            self._busy.add(key)
        try:
            yield
        finally:
            self._unclaim(key)

    def _unclaim(self, key: ChunkKey) -> None:
        with self._cond:
            self._busy.discard(key)
            self._cond.notify_all()

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

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]]) -> list[bool]:
        """Store each ``(key, tensors)``; ``False`` where it was skipped (too big, no room, I/O error).

        Bad input (wrong key type, non-tensor values) raises before anything is written.
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
        with self._exclusive(key):
            if not self.overwrites and self.contains_many([key], probe=False)[0]:
                return True  # a concurrent put of the same key won
            return self._store_reserved(key, payload, size)

    def _store_reserved(self, key: ChunkKey, payload: Any, size: int) -> bool:
        for attempt in range(2):
            if not self._reserve(key, size):
                self._count("skipped")
                return False
            try:
                self._store(key, payload, size)
            except OSError as exc:
                self._release(size)
                if exc.errno == errno.ENOSPC and attempt == 0:
                    self._shrink_after_enospc()
                    continue
                self._count("errors")
                self._log_once("write", "write failed (%s); skipping", exc)
                return False
            except BaseException:
                self._release(size)
                raise
            with self._cond:
                self._reserved -= size
                self._lru.add(key, size)
                self._counts["puts"] += 1
                self._counts["bytes_in"] += size
                self._cond.notify_all()
            return True
        return False

    def _release(self, size: int) -> None:
        with self._cond:
            self._reserved -= size
            self._cond.notify_all()

    def _shrink_after_enospc(self) -> None:
        """The device is full below our capacity: take what we really hold as the capacity."""
        with self._cond:
            self._counts["enospc"] += 1
            self.capacity = self._lru.currsize + self._reserved
        self._log_once("enospc", "no space left on device; capacity lowered to %d bytes", self.capacity)

    def _reserve(self, key: ChunkKey, size: int) -> bool:
        """Reserve ``size`` bytes, evicting LRU victims synchronously; ``False`` if it cannot fit."""
        if self.capacity is not None and size > self.capacity:
            return False
        deadline = time.monotonic() + self.pin_wait
        with self._cond:
            while True:
                self._check_open()
                if self.capacity is None or self._lru.currsize + self._reserved + size <= self.capacity:
                    self._reserved += size
                    return True
                deficit = self._lru.currsize + self._reserved + size - self.capacity - self._evicting_bytes
                victims = self._select_victims(deficit, exclude=key) if deficit > 0 else []
                if victims:
                    self._cond.release()
                    try:
                        self._evict(victims)
                    finally:
                        self._cond.acquire()
                elif self._evicting_bytes or self._reserved or (self._pins and time.monotonic() < deadline):
                    # others are freeing space or finishing writes, or readers / write-back hold pins that
                    # are released within milliseconds; a pin held longer than pin_wait makes the put skip
                    self._cond.wait(0.05)
                else:
                    return False  # everything left is pinned

    def _select_victims(self, deficit: int, exclude: ChunkKey) -> list[tuple[ChunkKey, int]]:
        victims, freed = [], 0
        for k in self._lru.victims():
            if freed >= deficit:
                break
            if self._pins.get(k) or k in self._evicting or k in self._busy or k == exclude:
                continue
            size = self._lru.size(k)
            self._evicting.add(k)
            self._evicting_bytes += size
            victims.append((k, size))
            freed += size
        return victims

    def _evict(self, victims: list[tuple[ChunkKey, int]]) -> None:
        """Hand each victim to ``before_evict``, then remove it unless a reader pinned it meanwhile.

        Never waiting for readers keeps lock order acyclic: a reader may hold a pin here while it waits
        for a put into another tier whose eviction chain leads back to this one. Subclasses make a drop
        safe against a reader that pins during it (files are unlinked, pool slots freed on unpin).
        """
        for k, size in victims:
            try:
                if self.before_evict is not None:
                    self.before_evict(self, k)
            except Exception as exc:  # degrade: a failed write-back must not wedge the tier
                self._log_once("before_evict", "write-back before eviction failed: %s", exc)
            with self._cond:
                if self._pins.get(k):  # read after selection: keep it; the caller picks other victims
                    self._evicting.discard(k)
                    self._evicting_bytes -= size
                    self._cond.notify_all()
                    continue
            try:
                self._drop(k)
            except OSError as exc:
                self._log_once("drop", "could not remove %s: %s", k.hex(), exc)
            with self._cond:
                self._evicting.discard(k)
                self._evicting_bytes -= size
                if k in self._lru:
                    self._lru.remove(k)
                    self._counts["evictions"] += 1
                self._cond.notify_all()

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        """Remove keys; returns how many were present."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        n = 0
        for k in keys:
            with self._exclusive(k):
                with self._cond:
                    present = k in self._lru
                    if present:
                        self._lru.remove(k)
                if present:
                    n += 1
                    try:
                        self._drop(k)
                    except OSError as exc:
                        self._log_once("drop", "could not remove %s: %s", k.hex(), exc)
        return n

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key]) == 1

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.used_bytes}/{self.capacity} bytes, {len(self)} objects>"
