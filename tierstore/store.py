"""The tiered store: ordered tiers, write-back, retain-prefetch, and the public ``tierstore.open``.

Control plane here, data plane in the tiers, write-back bookkeeping in :mod:`tierstore.writeback`:

* **put**: ``write_back`` lands a chunk in the highest tier that takes it and marks it dirty for the
  tiers below, which writer threads fill in batches; ``write_through`` writes every tier before returning.
* **dirty eviction**: each tier asks :meth:`WriteBack.before_evict` before it drops a victim; a dirty one
  is written below first, or kept.
* **promotion**: a ``get`` (``retain``) or ``prefetch`` copies a chunk into the tiers above the one
  that served it. Puts and promotions of one key take turns (a per-key claim), so a promotion never
  installs a value older than the latest put.
* **close**: flushes with a deadline and never raises for write-back failures; a store still open at
  interpreter exit is closed then (bounded by the same deadline).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from .batch import BatchedStoreMixin
from .config import PrefetchPolicy, StoreConfig, WritePolicy, parse_config
from .errors import ClosedError, TierTimeoutError, WriteBackError
from .keys import ChunkKey, check_key
from .objformat import validate_chunk
from .tensors import TensorDict
from .tiers import Tier, tier_class
from .writeback import STAT_KEYS, WriteBack

log = logging.getLogger("tierstore")

#: seconds ``close()`` (and the flush at interpreter exit) waits for write-back by default
CLOSE_TIMEOUT = 10.0


class TieredStore(BatchedStoreMixin):
    """A content-addressed chunk store over ordered tiers (fastest first).

    Build one with :func:`tierstore.open`. All methods are thread-safe; no lock is held across I/O.
    Read-only tiers serve reads and are never written. Batched and asynchronous forms (``get_many``,
    ``put_many``, ``contains_many``, ``lookup``, ``*_async``) come from
    :class:`~tierstore.batch.BatchedStoreMixin`.
    """

    def __init__(self, tiers: Sequence[Tier], write_policy: WritePolicy = WritePolicy.WRITE_BACK,
                 prefetch_policy: PrefetchPolicy = PrefetchPolicy.RETAIN, max_in_flight: int = 8,
                 close_timeout: float = CLOSE_TIMEOUT):
        self.tiers: list[Tier] = list(tiers)
        self.write_policy = WritePolicy(write_policy)
        self.prefetch_policy = PrefetchPolicy(prefetch_policy)
        self.max_in_flight = max_in_flight
        self.close_timeout = close_timeout
        self._by_name = {t.name: t for t in self.tiers}
        self._lock = threading.Condition()
        self._cond = self._lock  # the name the batched mixin uses
        self._counts = {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "promotions": 0, "prefetch_errors": 0}
        self._active = 0  # calls in progress (close waits for them)
        self._closing = False
        self._closed = threading.Event()
        self._wb = WriteBack(self.tiers, max_in_flight)
        for t in self.tiers:
            t.before_evict = self._wb.before_evict
        self._prefetcher = ThreadPoolExecutor(max_in_flight, thread_name_prefix="tierstore-prefetch")
        _track(self)

    # ------------------------------------------------------------------ writes
    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store a chunk. Returns once the top tier holds it (``write_back``) or every tier does
        (``write_through``). A chunk larger than a tier skips that tier.

        Under ``write_back`` the chunk is then written to the tiers below in the background; it is never
        dropped from a tier before a tier below holds it. :meth:`flush` waits for that and reports failures.
        """
        check_key(key)
        validate_chunk(tensors)  # before any tier: a chunk the object format cannot hold is refused whole
        with self._operation():
            self._count("puts")
            landed = self._put_claimed(key, tensors)
        if not landed:
            log.warning("put %s: no tier accepted the chunk", key.hex())

    def _put_claimed(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Store one validated chunk under its key's claim; whether some tier took it."""
        with self._wb.claim(key):
            if self.write_policy is WritePolicy.WRITE_THROUGH:
                return self._put_through(key, tensors)
            return self._put_back(key, tensors)

    def _put_back(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        self._wb.begin_put(key)  # dirty before any tier holds it
        landed = False
        try:
            for level, tier in enumerate(self.tiers):
                if tier.read_only:
                    continue
                self._wb.landing(key, level)
                if tier.put(key, tensors):  # a tier that refuses no longer holds an older value either
                    landed = True
                    break
        finally:
            self._wb.end_put(key, landed)
        return landed

    def _put_through(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        return any([t.put(key, tensors) for t in self.tiers])  # a read-only tier skips it (and counts that)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until write-back has brought every chunk put so far to every tier below it.

        A write that fails is retried with back-off while the chunk is held; ``flush`` first grants
        failing writes a fresh round of retries. A chunk counts as safely written below once a ``flush``
        that began after its ``put`` returns without raising.

        Raises:
            WriteBackError: some chunks could not be written; ``failed`` maps each key to the names of
                the tiers it did not reach (they are still retried, and reported again by the next flush).
            TierTimeoutError: ``timeout`` seconds passed with writes still in progress.
        """
        self._wb.flush(timeout)

    # ------------------------------------------------------------------ reads
    def get(self, key: ChunkKey, device: str | torch.device = "cpu",
            out: Mapping[str, torch.Tensor] | None = None) -> TensorDict | None:
        """The chunk's tensors from the highest tier holding it, or ``None`` (a miss, never wrong data).

        With ``out``, the tensors are copied into those caller-owned buffers (names, shapes and dtypes
        must match) and ``out`` is returned. Under ``retain`` the chunk is admitted to every tier above
        the one that served it before this returns.
        """
        check_key(key)
        with self._operation():
            self._count("gets")
            data, level = self._read(key, device, out, self.tiers[:1])
            if data is None and len(self.tiers) > 1:
                if self.prefetch_policy is PrefetchPolicy.RETAIN:
                    with self._wb.claim(key):  # read and promote with no put of this key in between
                        data, level = self._read(key, device, out, self.tiers)
                        if data is not None and level > 0:
                            self._promote(key, data, level)
                else:
                    data, level = self._read(key, device, out, self.tiers)
            self._count("hits" if data is not None else "misses")
            return data

    def _read(self, key: ChunkKey, device: str | torch.device, out: Mapping[str, torch.Tensor] | None,
              tiers: Sequence[Tier]) -> tuple[TensorDict | None, int]:
        """``(value, level)`` from the first of ``tiers`` holding the current value, or ``(None, -1)``.

        Staleness is checked just before each level is read: an eviction writes a tier below before it
        drops its copy, so a miss above is followed by an up-to-date view of the tier below.
        """
        for level, tier in enumerate(tiers):
            if level in self._wb.stale_levels(key):
                continue
            data = tier.get(key, device=device, out=out)
            if data is not None:
                return data, level
        return None, -1

    def _promote(self, key: ChunkKey, data: Mapping[str, torch.Tensor], level: int) -> None:
        """Copy the current value (caller holds the key's claim) into the writable tiers above ``level``."""
        for upper, tier in enumerate(self.tiers[:level]):
            if not tier.read_only and tier.put(key, data):
                self._wb.mark_written(key, upper)
        self._count("promotions")

    def _promote_read(self, hits: list[tuple[ChunkKey, TensorDict]], level: int, puts_before: int) -> None:
        """Promote values a batched read found at ``level`` (read under no claim). If any put began since
        the read, a value may be older than its key's latest: those keys are promoted from a fresh read."""
        for key, data in dict(hits).items():
            with self._wb.claim(key):
                if self._wb.puts_since(puts_before):
                    self._promote_current(key)
                elif level not in self._wb.stale_levels(key):
                    self._promote(key, data, level)

    def _stale_at(self, keys: Sequence[ChunkKey], level: int) -> list[bool]:
        return self._wb.stale_at(keys, level)

    def _puts_begun(self) -> int:
        return self._wb.put_count()

    def _holders(self, key: ChunkKey) -> Iterator[Tier]:
        return (t for level, t in enumerate(self.tiers)
                if level not in self._wb.stale_levels(key) and t.contains(key))

    def contains(self, key: ChunkKey) -> bool:
        check_key(key)
        return next(self._holders(key), None) is not None

    def where(self, key: ChunkKey) -> str | None:
        """Name of the highest tier holding ``key``, or ``None``."""
        check_key(key)
        tier = next(self._holders(key), None)
        return None if tier is None else tier.name

    def prefetch(self, keys: Iterable[ChunkKey]) -> Future[int]:
        """Promote ``keys`` toward the top tier in the background, at most ``max_in_flight`` at a time.

        The returned future resolves to the number of keys now held by the top tier. If a promotion
        raised, the future raises the first such exception once all keys are done (each one is also
        logged and counted in ``stats()["prefetch_errors"]``).
        """
        keys = [check_key(k) for k in keys]
        done: Future[int] = Future()
        with self._operation():
            if not keys:
                done.set_result(0)
                return done
            remaining, held, errors, lock = [len(keys)], [0], [], threading.Lock()

            def finished(f: Future[bool]) -> None:
                exc = ClosedError("store closed before the prefetch ran") if f.cancelled() else f.exception()
                if exc is not None:
                    self._count("prefetch_errors")
                    log.log(logging.DEBUG if isinstance(exc, ClosedError) else logging.WARNING,
                            "prefetch failed: %s: %s", type(exc).__name__, exc)
                with lock:
                    if exc is not None:
                        errors.append(exc)
                    else:
                        held[0] += bool(f.result())
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    if errors:
                        done.set_exception(errors[0])
                    else:
                        done.set_result(held[0])

            try:
                for k in keys:
                    self._prefetcher.submit(self._promote_one, k).add_done_callback(finished)
            except RuntimeError:  # the pool was shut down by a racing close()
                raise ClosedError("store is closed") from None
        return done

    def _promote_one(self, key: ChunkKey) -> bool:
        with self._operation(), self._wb.claim(key):
            return self._promote_current(key)

    def _promote_current(self, key: ChunkKey) -> bool:
        """Copy the current value into the tiers above its highest holder (caller holds the claim)."""
        stale = self._wb.stale_levels(key)
        for level, tier in enumerate(self.tiers):
            if level in stale or not tier.contains(key):
                continue
            if level == 0:
                return True
            data = tier.copy_out(key)  # no pin held below while the tiers above evict into it
            if data is None:
                continue
            self._promote(key, data, level)
            return self.tiers[0].contains(key)
        return False

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        """Per-tier counters and sizes plus the store's own totals (what a dashboard needs)."""
        dirty, per_level = self._wb.stats()
        tiers = {t.name: {**t.stats(), **{k: per_level[i][k] for k in STAT_KEYS}} for i, t in enumerate(self.tiers)}
        with self._lock:
            counts = dict(self._counts)
        return {"tiers": tiers, "pending_writeback": dirty, **counts,
                "write_policy": self.write_policy.value, "prefetch_policy": self.prefetch_policy.value}

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _check_open(self) -> None:
        if self._closing:
            raise ClosedError("store is closed")

    @contextmanager
    def _operation(self) -> Iterator[None]:
        """Run a public call: refused once ``close()`` began, waited for by it."""
        with self._lock:
            if self._closing:
                raise ClosedError("store is closed")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Flush write-back for up to ``timeout`` seconds (default ``close_timeout``), then stop and close.

        New calls are refused from the start; calls already running get the deadline to finish. Never
        raises for write-back failures or the deadline: it logs one warning naming what it abandoned.
        Idempotent and thread-safe; a second caller waits for the first.
        """
        timeout = self.close_timeout if timeout is None else timeout
        with self._lock:
            first, self._closing = not self._closing, True
            if first:
                deadline = time.monotonic() + timeout
                self._lock.wait_for(lambda: self._active == 0, timeout)
        if not first:
            self._closed.wait(timeout)
            return
        try:
            self._flush_for_close(deadline)
            self._wb.stop(max(0.1, deadline - time.monotonic()))
            self._prefetcher.shutdown(wait=False, cancel_futures=True)
            self._close_async()
            for t in self.tiers:
                t.close(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            _untrack(self)
            self._closed.set()

    def _flush_for_close(self, deadline: float) -> None:
        try:
            self._wb.flush(max(0.0, deadline - time.monotonic()))
        except WriteBackError as exc:
            log.warning("close: abandoning write-back of %d chunks: %s", len(exc.failed), exc)
        except TierTimeoutError as exc:
            log.warning("close: deadline passed; abandoning pending write-back (%s)", exc)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TieredStore {' > '.join(t.name for t in self.tiers)} {self.write_policy.value}>"


# ---------------------------------------------------------------------- closing at interpreter exit
_open_stores: set[TieredStore] = set()  # strong refs: a store nobody closed still gets flushed at exit
_open_lock = threading.Lock()


def _track(store: TieredStore) -> None:
    with _open_lock:
        _open_stores.add(store)


def _untrack(store: TieredStore) -> None:
    with _open_lock:
        _open_stores.discard(store)


def _close_open_stores() -> None:
    with _open_lock:
        stores = list(_open_stores)
    for s in stores:
        s.close()


# Run before the interpreter joins non-daemon threads and shuts thread pools down (the tiers' I/O pools
# are needed to flush); plain atexit handlers run only after that.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_open_stores)
else:  # pragma: no cover - CPython < 3.9
    import atexit
    atexit.register(_close_open_stores)


def build_tiers(config: StoreConfig) -> list[Tier]:
    tiers: list[Tier] = []
    try:
        for tc in config.tiers:
            tiers.append(tier_class(tc.kind)(name=tc.name, **tc.options))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def open(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> TieredStore:  # noqa: A001 - public name
    """Open a store from a dict, a YAML/JSON file, ``$TIERSTORE_CONFIG`` or the embedded default.

    The whole configuration is validated first; a bad key raises :class:`~tierstore.ConfigError`
    naming it before any tier touches storage.
    """
    cfg = parse_config(config)
    return TieredStore(build_tiers(cfg), cfg.write_policy, cfg.prefetch_policy, cfg.max_in_flight,
                       cfg.close_timeout)
