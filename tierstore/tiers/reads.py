"""The read path of a :class:`~tierstore.tiers.base.Tier`: batched gets, ``verify_many``, and what a
damaged, unsupported or vanished object does to the index (see :meth:`TierReads._read_checked`).

A mixin: :class:`~tierstore.tiers.base.Tier` supplies the index, claims, counters and storage
primitives it uses.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from .. import objformat
from ..errors import CorruptObjectError, ForgedObjectError, InvalidInputError, UnsupportedObjectError
from ..keys import ChunkKey, check_key
from ..policy import LRUPolicy
from ..telemetry import Latency
from ..tensors import TensorDict, check_outs, fill_out
from .claims import Claims

R = TypeVar("R")

#: outcomes of reading one object (see ``TierReads._read_checked``)
OK, MISSING, CORRUPT, UNSUPPORTED, FORGED, ERROR = "ok", "missing", "corrupt", "unsupported", "forged", "error"


class TierReads:
    """Reads of one tier; mixed into :class:`~tierstore.tiers.base.Tier`, which defines what is declared here."""

    shared: ClassVar[bool]
    #: whether the tier keeps encoded chunk objects (:mod:`tierstore.objformat`): another such tier with the same
    #: codec receives them as they are (:meth:`copy_encoded` / ``put_objects``: no decode, no re-encode)
    stores_objects: ClassVar[bool] = False
    #: whether reading an object the index lacks tells whether it exists (a remote GET: "not found" is the
    #: miss); batched reads then skip the separate existence probe (a HEAD per key) for such keys
    reads_probe: ClassVar[bool] = False
    _cond: threading.Condition
    _lru: LRUPolicy[ChunkKey]
    _claims: Claims
    _counts: dict[str, int]
    _discards: int
    latency: Latency

    if TYPE_CHECKING:  # provided by Tier
        @abstractmethod
        def pin(self, keys: Iterable[ChunkKey], touch: bool = True) -> list[int | None]: ...
        @abstractmethod
        def unpin(self, keys: Iterable[ChunkKey]) -> None: ...
        @abstractmethod
        def _check_open(self) -> None: ...
        @abstractmethod
        def _map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]: ...
        @abstractmethod
        def _load(self, key: ChunkKey, size: int, device: str | torch.device,
                  borrow: bool = False) -> TensorDict | None: ...
        @abstractmethod
        def _load_into(self, key: ChunkKey, size: int, out: Mapping[str, torch.Tensor]) -> TensorDict | None: ...
        @abstractmethod
        def _drop(self, key: ChunkKey) -> None: ...
        @abstractmethod
        def _probe(self, keys: Sequence[ChunkKey]) -> list[int | None]: ...
        @abstractmethod
        def _index_add(self, key: ChunkKey, size: int) -> None: ...
        @abstractmethod
        def _count(self, name: str, n: int = 1) -> None: ...
        @abstractmethod
        def _fail(self, what: str, msg: str, *args: Any) -> None: ...

    @contextmanager
    def borrowed(self, key: ChunkKey) -> Iterator[TensorDict | None]:
        """Pin ``key`` and yield its tensors without copying where the tier allows (read-only!).

        An internal access: it does not count as a hit or change LRU order (its bytes count as read).
        """
        (size,) = self.pin([key], touch=False)
        if size is None:
            yield None
            return
        try:
            tensors = self._load_checked(key, size, "cpu", borrow=True)
            if tensors is not None:
                self._count("bytes_out", size)
            yield tensors
        finally:
            self.unpin([key])

    def copy_out(self, key: ChunkKey) -> TensorDict | None:
        """The chunk as fresh CPU tensors the caller owns, or ``None``; holds no pin once it returns.

        An internal access like :meth:`borrowed` (no hit counted, LRU order unchanged), for copies that
        go to a tier whose eviction may need this one (promotion, write-back from a deeper tier).
        """
        return self._read_internally(key, lambda size: self._load_checked(key, size, "cpu"))

    def copy_encoded(self, key: ChunkKey) -> objformat.Encoded | None:
        """The stored object itself, verified but not decoded, or ``None`` (tiers that :attr:`stores_objects`:
        write-back hands it to another such tier as it is); holds no pin once it returns. An internal
        access like :meth:`copy_out`."""
        return self._read_internally(key, lambda size: self._read_checked(
            key, size, "cpu", reader=lambda: self._load_encoded(key, size))[0])

    def _read_internally(self, key: ChunkKey, read: Callable[[int], R | None]) -> R | None:
        """``read(size)`` with ``key`` pinned; its bytes count as read from this tier (promotion and
        write-back traffic shows in ``bytes_out``), not as a hit."""
        (size,) = self.pin([key], touch=False)
        if size is None:
            return None
        try:
            result = read(size)
        finally:
            self.unpin([key])
        if result is not None:
            self._count("bytes_out", size)
        return result

    def _load_encoded(self, key: ChunkKey, size: int) -> objformat.Encoded | None:
        """The stored object, verified, not decoded; ``None`` if it vanished. Raises like :meth:`_load`
        (tiers that :attr:`stores_objects` implement it)."""
        raise NotImplementedError

    def contains_many(self, keys: Sequence[ChunkKey], probe: bool = True) -> list[bool]:
        """Whether each key is held. ``probe=False`` checks the in-memory index only (no I/O)."""
        start = perf_counter()
        try:
            return self._contains_many(keys, probe)
        finally:
            self.latency.since("lookup", start)

    def _contains_many(self, keys: Sequence[ChunkKey], probe: bool = True) -> list[bool]:
        keys = [check_key(k) for k in keys]
        with self._cond:
            found = [k in self._lru for k in keys]
        missing = list(dict.fromkeys(k for k, f in zip(keys, found, strict=True) if not f))
        if missing and probe:
            discards = self._discards
            probed = dict(zip(missing, self._probe(missing), strict=True))
            with self._cond:
                for k, size in probed.items():
                    if size is not None:
                        self._index_found(k, size, discards)
            found = [f or probed.get(k) is not None for k, f in zip(keys, found, strict=True)]
        return found

    def get_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """Return each key's tensors on ``device`` (fresh tensors the caller owns) or ``None``.

        A repeated key is read once; each further slot gets its own copy.
        """
        start = perf_counter()
        try:
            return self._get_many(keys, device)
        finally:
            self.latency.since("get", start)

    def _get_many(self, keys: Sequence[ChunkKey], device: str | torch.device) -> list[TensorDict | None]:
        self._check_open()
        keys = list(keys)
        unique = list(dict.fromkeys(keys))
        present = self._contains_many(unique, probe=not self.reads_probe)
        held = [k for k, p in zip(unique, present, strict=True) if p]
        size_of = {k: s for k, s in zip(held, self.pin(held), strict=True) if s is not None}
        unseen = {k for k, p in zip(unique, present, strict=True) if not p} if self.reads_probe else set()

        def load(k: ChunkKey) -> TensorDict | None:
            if k in size_of:
                return self._load_checked(k, size_of[k], device)
            if k in unseen:
                data, size_of[k] = self._load_unseen(k, device)
                return data
            return None

        try:
            values = self._map(load, unique)
            loaded = dict(zip(unique, values, strict=True))
        finally:
            self.unpin(k for k in held if k in size_of)
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
        else is affected). A key may appear more than once (each with its own ``out``). ``outs`` tensors
        that overlap or carry the conjugate/negative bit raise :class:`InvalidInputError` before any read.
        """
        check_outs(outs)
        return self.fill_many(keys, outs)

    def fill_many(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]
                  ) -> list[TensorDict | InvalidInputError | None]:
        """:meth:`get_many_into` for a caller that checked ``outs`` with
        :func:`~tierstore.tensors.check_outs` already (the tiered store, once for the whole batch)."""
        start = perf_counter()
        try:
            return self._fill_many(keys, outs)
        finally:
            self.latency.since("get", start)

    def _fill_many(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]
                   ) -> list[TensorDict | InvalidInputError | None]:
        self._check_open()
        keys = [check_key(k) for k in keys]
        sizes = self.pin(keys)  # index hits pinned in one pass; a key listed twice is pinned twice
        try:
            absent = [i for i, s in enumerate(sizes) if s is None]
            if absent and not self.reads_probe:  # objects other writers stored: probe, then pin what joined
                found = [i for i, f in zip(absent, self._contains_many([keys[i] for i in absent]), strict=True) if f]
                for i, s in zip(found, self.pin([keys[i] for i in found]), strict=True):
                    sizes[i] = s
            results: list[TensorDict | InvalidInputError | None] = [None] * len(keys)
            todo = [i for i, s in enumerate(sizes) if s is not None]
            unseen = absent if self.reads_probe else []
            found_sizes: dict[ChunkKey, int] = {}  # of unseen keys, as their reads find them
            if unseen:  # reading probes: indexed and unseen keys in one batch on the tier's pool
                todo += unseen
                loaded = self._map(lambda i: self._fill_one(keys[i], sizes[i], outs[i], found_sizes), todo)
            else:
                loaded = self._load_many_into([(keys[i], sizes[i], outs[i]) for i in todo])  # type: ignore[misc]
            for i, r in zip(todo, loaded, strict=True):
                results[i] = r
        finally:  # one unpin per pin
            self.unpin([k for k, s in zip(keys, sizes, strict=True) if s is not None])
        hits = [i for i, r in enumerate(results) if isinstance(r, dict)]
        with self._cond:
            self._counts["hits"] += len(hits)
            self._counts["misses"] += len(results) - len(hits)
            self._counts["bytes_out"] += sum(sizes[i] or found_sizes.get(keys[i], 0) for i in hits)
        return results

    def _load_many_into(self, work: list[tuple[ChunkKey, int, Mapping[str, torch.Tensor]]]
                        ) -> list[TensorDict | InvalidInputError | None]:
        """Fill each ``(key, size, out)`` of pinned keys (see :meth:`get_many_into`). Tiers with a faster
        batched read path override this."""
        return self._map(lambda item: self._fill_one(*item), work)

    def _fill_one(self, key: ChunkKey, size: int | None, out: Mapping[str, torch.Tensor],
                  sizes: dict[ChunkKey, int] | None = None) -> TensorDict | InvalidInputError | None:
        """One item of :meth:`get_many_into`: a pinned key of ``size``, or (``size`` is ``None``) one the
        index lacks on a :attr:`reads_probe` tier, whose stored size is then recorded in ``sizes``."""
        try:
            if size is not None:
                return self._load_checked(key, size, "cpu", out=out)
            data, found = self._load_unseen(key, "cpu", out)
            if data is not None and sizes is not None:
                sizes[key] = found
            return data
        except InvalidInputError as exc:
            return exc

    def _fetch(self, key: ChunkKey, device: str | torch.device) -> tuple[TensorDict, int] | None:
        """``(tensors, stored size)`` of a key the index lacks, ``None`` if storage does not have it; raises
        like :meth:`_load`. Only :attr:`reads_probe` tiers implement it."""
        raise NotImplementedError

    def _load_unseen(self, key: ChunkKey, device: str | torch.device, out: Mapping[str, torch.Tensor] | None = None
                     ) -> tuple[TensorDict | None, int]:
        """Read a key the index lacks on a :attr:`reads_probe` tier, without probing first: ``(tensors or
        None, stored size)``, ``out`` filled on a hit. A hit joins the index; anything wrong with the
        object is a counted miss (as :meth:`_read_checked`), a mismatched ``out`` raises
        :class:`InvalidInputError`."""
        size = 0

        def reader() -> TensorDict | None:
            nonlocal size
            got = self._fetch(key, device)
            if got is None:
                return None
            data, size = got
            return data if out is None else fill_out(out, data)

        discards = self._discards
        data = self._load_checked(key, 0, device, out=out, reader=reader)
        if data is not None:
            with self._cond:
                self._index_found(key, size, discards)
        return data, size

    def _index_found(self, key: ChunkKey, size: int, discards: int) -> None:
        """Index an object a probe or read found in storage (lock held), unless a delete ran since the
        probe began (``discards`` was :attr:`_discards` then) or one of the key is running now: the
        object it found may be the one deleted, which must not come back into the index."""
        if key not in self._lru and discards == self._discards and key not in self._claims.busy:
            self._index_add(key, size)

    def _load_checked(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False,
                      out: Mapping[str, torch.Tensor] | None = None,
                      reader: Callable[[], TensorDict | None] | None = None) -> TensorDict | None:
        """Read a chunk (through ``reader`` when given: a key the index lacks); anything wrong with the
        stored object is a counted miss, never an exception."""
        data: TensorDict | None = self._read_checked(key, size, device, borrow, out, reader=reader)[0]
        return data

    def _read_checked(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False,
                      out: Mapping[str, torch.Tensor] | None = None, repair: bool = False,
                      reader: Callable[[], Any] | None = None) -> tuple[Any, str]:
        """``(tensors or None, outcome)``: read a chunk (or what ``reader`` returns) and classify what went wrong.

        * damaged (:class:`CorruptObjectError`): counted ``corrupt``, forgotten; removed from storage on
          a private tier, on a :attr:`shared` one only with ``repair``;
        * forged (:class:`ForgedObjectError`: a tier with keys found it unsealed, sealed with a key it lacks,
          or its seal does not match): counted ``forged``, forgotten, never removed;
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
        except ForgedObjectError as exc:
            self._count("forged")
            self._fail("forged", "refusing object %s (left in place): %s", key.hex(), exc)
            self._forget(key, remove=False)
            return None, FORGED
        except UnsupportedObjectError as exc:
            self._count("unsupported")
            self._fail("unsupported", "cannot read object %s (left in place): %s", key.hex(), exc)
            if self.shared:
                self._forget(key, remove=False)
            return None, UNSUPPORTED
        except CorruptObjectError as exc:
            self._count("corrupt")
            remove = repair or not self.shared
            self._fail("corrupt", "%s damaged object %s: %s", "removing" if remove else "skipping",
                           key.hex(), exc)
            self._forget(key, remove=remove)
            return None, CORRUPT
        except FileNotFoundError:  # removed by another process or a racing delete
            self._forget(key, remove=False)
            return None, MISSING
        except (OSError, MemoryError) as exc:
            self._count("errors")
            self._fail("read", "read failed (%s: %s); treating as a miss", type(exc).__name__, exc)
            return None, ERROR

    def verify_many(self, keys: Sequence[ChunkKey], repair: bool = False) -> list[str]:
        """Read and check each key's stored object; return each outcome (``"ok"``, ``"missing"``,
        ``"corrupt"``, ``"unsupported"``, ``"forged"``, ``"error"``).

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
        check_outs([out])
        self._check_open()
        present = self.contains_many([key], probe=not self.reads_probe)[0]
        size = self.pin([key])[0] if present else None
        result = None
        if size is not None:
            try:
                result = self._load_checked(key, size, "cpu", out=out)
            finally:
                self.unpin([key])
        elif not present and self.reads_probe:
            result, size = self._load_unseen(key, "cpu", out)
        with self._cond:
            self._counts["hits" if result is not None else "misses"] += 1
            self._counts["bytes_out"] += size if result is not None and size is not None else 0
        return result

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

