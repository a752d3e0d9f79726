"""The batched, asynchronous half of :class:`~tierstore.TieredStore`.

An engine step moves many chunks at once. These methods take a list of keys, group them by the tier
that serves them and hand each group to that tier's batched call, so every tier works at its own
parallelism (the disk tier's I/O pool, concurrent requests on the remote, memcpy on host). Results come
back per key, in the caller's order:

* a miss is ``None`` / ``False``, never an exception;
* one bad item (a ``put_many`` entry that is not ``(ChunkKey, Mapping[str, Tensor])``, an ``out`` that
  does not match the stored chunk) gives that item ``False`` / ``None`` and a logged warning, and does
  not affect the others; a malformed call as a whole (not a list, ``out`` of the wrong length) raises
  :class:`~tierstore.InvalidTypeError` / :class:`~tierstore.InvalidInputError` before any I/O;
* a key may appear more than once in one batch.

The ``*_async`` forms run the same call on a small store-owned executor and return a
:class:`concurrent.futures.Future` at once: an engine's worker thread submits a step's loads, keeps
computing, and waits on (or adds a callback to) the future when it needs the bytes. Futures never carry
a per-key failure; they fail only for a malformed call or a closed store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .config import PrefetchPolicy, WritePolicy
from .errors import InvalidInputError, InvalidTypeError
from .keys import ChunkKey, check_key
from .objformat import validate_chunk
from .tensors import TensorDict

if TYPE_CHECKING:
    from .tiers import Tier

log = logging.getLogger("tierstore")

#: first window of keys past the local run that ``lookup`` probes on shared tiers at once (doubles per round)
LOOKUP_WINDOW = 32
#: threads of the executor behind the ``*_async`` methods (each call fans out further on the tiers' pools)
ASYNC_WORKERS = 4

Item = tuple[ChunkKey, Mapping[str, torch.Tensor]]


class BatchedStoreMixin:
    """``get_many``, ``put_many``, ``contains_many``, a batched ``lookup`` and their async forms.

    Mixed into :class:`~tierstore.TieredStore`; it uses the store's tiers, counters and lock and its
    write-back hooks, and keeps the single-key semantics: ``put_many`` stores each item exactly as
    ``put`` does (``_put_claimed``), ``get_many`` skips tiers not yet written for a key and promotes a
    hit from below as ``get`` does, under the key's claim (``_promote_read``).
    """

    tiers: list[Tier]
    write_policy: WritePolicy
    prefetch_policy: PrefetchPolicy
    _cond: threading.Condition
    _counts: dict[str, int]
    _async_pool: ThreadPoolExecutor | None = None

    if TYPE_CHECKING:
        def _check_open(self) -> None: ...
        def _put_claimed(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool: ...
        def _stale_at(self, keys: Sequence[ChunkKey], level: int) -> list[bool]: ...
        def _puts_begun(self) -> int: ...
        def _promote_read(self, hits: list[tuple[ChunkKey, TensorDict]], level: int, puts_before: int) -> None: ...

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[ChunkKey], out: Sequence[Mapping[str, torch.Tensor]] | None = None,
                 device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """Each key's tensors from the highest tier holding it, or ``None`` (a miss, never wrong data).

        With ``out`` (one caller-owned mapping per key, names/shapes/dtypes as stored), ``out[i]`` is
        filled and returned for a hit; an ``out[i]`` that does not match its chunk yields ``None`` and a
        warning. Under ``retain`` the hits from lower tiers are admitted to the tiers above before this
        returns. Duplicate keys each get their own result.
        """
        self._check_open()
        keys = _check_keys(keys)
        if out is not None:
            if isinstance(out, Mapping) or not isinstance(out, Sequence):
                raise InvalidTypeError("out must be a sequence with one Mapping[str, Tensor] per key")
            if len(out) != len(keys):
                raise InvalidInputError(f"out has {len(out)} entries for {len(keys)} keys")
        results: list[TensorDict | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        promote: list[tuple[int, list[tuple[ChunkKey, TensorDict]]]] = []
        puts_before = self._puts_begun()
        for level, tier in enumerate(self.tiers):
            if not todo:
                break
            # skip tiers that may hold an older value; checked per level (an eviction writes below first)
            stale = self._stale_at([keys[i] for i in todo], level)
            skipped = [i for i, s in zip(todo, stale, strict=True) if s]
            todo = [i for i, s in zip(todo, stale, strict=True) if not s]
            sub = [keys[i] for i in todo]
            got: list[Any] = (tier.get_many(sub, device=device) if out is None
                              else tier.get_many_into(sub, [out[i] for i in todo]))
            rest, hits = list(skipped), []
            for i, r in zip(todo, got, strict=True):
                if isinstance(r, InvalidInputError):
                    log.warning("get_many: out[%d] does not fit chunk %s: %s", i, keys[i].hex(), r)
                elif r is None:
                    rest.append(i)
                else:
                    results[i] = r
                    hits.append((keys[i], r))
            if hits and level and self.prefetch_policy is PrefetchPolicy.RETAIN:
                promote.append((level, hits))
            todo = rest
        for level, hits in promote:
            self._promote_read(hits, level, puts_before)
        n_hits = sum(r is not None for r in results)
        with self._cond:
            self._counts["gets"] += len(keys)
            self._counts["hits"] += n_hits
            self._counts["misses"] += len(keys) - n_hits
        return results

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether some tier holds each key; shared tiers are probed concurrently for keys the local
        indexes lack."""
        return self._held_by_some_tier(_check_keys(keys), probe=True)

    def _held_by_some_tier(self, keys: list[ChunkKey], probe: bool) -> list[bool]:
        """Per key, whether some tier holds it; each tier is asked only for the keys not found above it.
        ``probe=False`` checks the in-memory indexes only (see :meth:`Tier.contains_many`)."""
        found = [False] * len(keys)
        for tier in self.tiers:
            rest = [i for i, f in enumerate(found) if not f]
            if not rest:
                break
            for i, hit in zip(rest, tier.contains_many([keys[i] for i in rest], probe=probe), strict=True):
                found[i] = hit
        return found

    def lookup(self, keys: Sequence[ChunkKey], *, probe: bool = True) -> int:
        """Length of the leading run of ``keys`` held by some tier.

        The in-memory indexes are checked first (no I/O); keys past that run are probed on shared tiers
        in concurrent windows (32, 64, ... keys), so a cold prefix costs a few round trips, not one per key.
        ``probe=False`` stops at the indexes: no I/O at all (what a caller on an engine's forward thread wants).
        """
        keys = _check_keys(keys)
        found = self._held_by_some_tier(keys, probe=False)
        n = found.index(False) if False in found else len(found)
        if not probe:
            return n
        window = LOOKUP_WINDOW
        while n < len(keys):
            end = min(len(keys), n + window)
            probe = [i for i in range(n, end) if not found[i]]
            for i, hit in zip(probe, self.contains_many([keys[i] for i in probe]), strict=True):
                found[i] = hit
            while n < end and found[n]:
                n += 1
            if n < end:
                break
            window *= 2
        return n

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Iterable[Item]) -> list[bool]:
        """Store each ``(key, tensors)``; per item ``True`` once the top tier that takes it holds it
        (``write_back``, then written below in the background) or some tier does (``write_through``).

        ``False`` where no tier accepted the chunk or the item is malformed (logged); never raises for
        one item.
        """
        self._check_open()
        if isinstance(items, (Mapping, str, bytes)) or not isinstance(items, Iterable):
            raise InvalidTypeError("put_many takes an iterable of (ChunkKey, Mapping[str, Tensor]) pairs")
        items = list(items)
        ok = [False] * len(items)
        todo: list[int] = []
        for i, item in enumerate(items):
            try:
                if not isinstance(item, tuple) or len(item) != 2:
                    raise InvalidTypeError(f"item is {type(item).__name__}, not a (key, tensors) pair")
                check_key(item[0])
                validate_chunk(item[1])  # exactly what put() refuses
            except (TypeError, ValueError) as exc:
                log.warning("put_many: item %d rejected: %s", i, exc)
                continue
            todo.append(i)
        valid = list(todo)
        with self._cond:
            self._counts["puts"] += len(todo)
        # one item at a time per key, exactly as put() (dirty before held, one write of a key at a time),
        # on the top tier's parallelism
        stored = self.tiers[0]._map(lambda i: self._put_claimed(*items[i]), todo)
        for i, s in zip(todo, stored, strict=True):
            ok[i] = s
        refused = sum(not ok[i] for i in valid)
        if refused:
            log.warning("put_many: no tier accepted %d of %d chunks", refused, len(valid))
        return ok

    # ------------------------------------------------------------------ async forms
    def get_many_async(self, keys: Sequence[ChunkKey], out: Sequence[Mapping[str, torch.Tensor]] | None = None,
                       device: str | torch.device = "cpu") -> Future[list[TensorDict | None]]:
        """:meth:`get_many` in the background; ``out`` buffers must stay alive until the future is done."""
        return self._submit(self.get_many, list(keys), out, device)

    def put_many_async(self, items: Iterable[Item]) -> Future[list[bool]]:
        """:meth:`put_many` in the background; the tensors must not change until the future is done."""
        return self._submit(self.put_many, list(items))

    def contains_many_async(self, keys: Sequence[ChunkKey]) -> Future[list[bool]]:
        return self._submit(self.contains_many, list(keys))

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        self._check_open()
        with self._cond:
            if self._async_pool is None:
                self._async_pool = ThreadPoolExecutor(ASYNC_WORKERS, thread_name_prefix="tierstore-batch")
            pool = self._async_pool
        return pool.submit(fn, *args)

    def _close_async(self) -> None:
        """Wait for submitted batches and stop the executor (called by ``close`` before the tiers close)."""
        with self._cond:
            pool, self._async_pool = self._async_pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _check_keys(keys: Sequence[ChunkKey]) -> list[ChunkKey]:
    if isinstance(keys, (ChunkKey, str, bytes)) or not isinstance(keys, Iterable):
        raise InvalidTypeError("expected a sequence of ChunkKey")
    return [check_key(k) for k in keys]
