"""The tiered store: ordered tiers, write-back, retain-prefetch, and the public ``tierstore.open``.

Control plane here, data plane in the tiers. The store keeps one piece of state of its own — which
lower tiers a chunk still has to reach (``_pending``, the dirty set) — and three mechanisms:

* **write-back**: a ``put`` lands in the highest tier that takes it; one writer thread per lower tier
  copies it down in batches of up to ``max_in_flight``, reading it pinned from the tier above.
* **dirty eviction**: each tier calls :meth:`_before_evict` on a victim; if no lower tier holds it yet,
  the victim is written to the next tier synchronously before it is dropped.
* **promotion**: a ``get`` (``retain``) or ``prefetch`` copies a chunk into the tiers above the one
  that served it; those copies are clean.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import torch

from .config import PrefetchPolicy, StoreConfig, WritePolicy, parse_config
from .errors import ClosedError, TierTimeoutError
from .keys import ChunkKey, check_key
from .objformat import validate_chunk
from .tensors import TensorDict
from .tiers import Tier, tier_class

log = logging.getLogger("tierstore")
_STOP = object()


class TieredStore:
    """A content-addressed chunk store over ordered tiers (fastest first).

    Build one with :func:`tierstore.open`. All methods are thread-safe; no lock is held across I/O.
    """

    def __init__(self, tiers: Sequence[Tier], write_policy: WritePolicy = WritePolicy.WRITE_BACK,
                 prefetch_policy: PrefetchPolicy = PrefetchPolicy.RETAIN, max_in_flight: int = 8):
        self.tiers: list[Tier] = list(tiers)
        self.write_policy = WritePolicy(write_policy)
        self.prefetch_policy = PrefetchPolicy(prefetch_policy)
        self.max_in_flight = max_in_flight
        self._by_name = {t.name: t for t in self.tiers}
        self._level = {id(t): i for i, t in enumerate(self.tiers)}
        self._cond = threading.Condition()
        self._pending: dict[ChunkKey, set[int]] = {}  # key -> levels it still has to be written to
        self._wb = {i: {"writeback_pending": 0, "writeback_done": 0, "writeback_failed": 0}
                    for i in range(len(self.tiers))}
        self._counts = {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "promotions": 0}
        self._closed = False
        for t in self.tiers:
            t.before_evict = self._before_evict
        self._queues: dict[int, queue.Queue[Any]] = {i: queue.Queue() for i in range(1, len(self.tiers))}  # keys, _STOP
        self._writers = [threading.Thread(target=self._writer, args=(i,), name=f"tierstore-writeback-{t.name}",
                                          daemon=True)
                         for i, t in enumerate(self.tiers) if i > 0]
        for w in self._writers:
            w.start()
        self._prefetcher = ThreadPoolExecutor(max_in_flight, thread_name_prefix="tierstore-prefetch")

    # ------------------------------------------------------------------ writes
    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store a chunk. Returns once the top tier holds it (``write_back``) or every tier does
        (``write_through``). A chunk larger than a tier skips that tier."""
        self._check_open()
        check_key(key)
        validate_chunk(tensors)  # before any tier: a chunk the object format cannot hold is refused whole
        self._count("puts")
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            stored = [t.put(key, tensors) for t in self.tiers]
            if not any(stored):
                log.warning("put %s: no tier accepted the chunk", key.hex())
            return
        for level, tier in enumerate(self.tiers):
            if tier.put(key, tensors):
                self._schedule(key, level)
                return
        log.warning("put %s: no tier accepted the chunk", key.hex())

    def _schedule(self, key: ChunkKey, level: int) -> None:
        below = set(range(level + 1, len(self.tiers)))
        if not below:
            return
        with self._cond:
            new = below - self._pending.get(key, set())
            self._pending.setdefault(key, set()).update(below)
            for j in new:
                self._wb[j]["writeback_pending"] += 1
        for j in sorted(new):
            self._queues[j].put(key)

    def _writer(self, level: int) -> None:
        q = self._queues[level]
        while True:
            batch = [q.get()]
            while len(batch) < self.max_in_flight:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            keys = [k for k in batch if k is not _STOP]
            try:
                self._write_down(keys, level)
            except Exception as exc:  # a writer must never die: count and carry on
                log.warning("write-back to %s failed: %s", self.tiers[level].name, exc)
                for k in keys:
                    self._written(k, level, ok=False)
            if stop:
                return

    def _write_down(self, keys: list[ChunkKey], level: int) -> None:
        """Copy ``keys`` into tier ``level`` from the nearest tier above that holds them."""
        with self._cond:
            keys = [k for k in dict.fromkeys(keys) if level in self._pending.get(k, ())]
        if not keys:
            return
        with ExitStack() as stack:
            items: list[tuple[ChunkKey, TensorDict]] = []
            lost: list[ChunkKey] = []
            for k in keys:
                data = None
                for upper in self.tiers[:level]:
                    data = stack.enter_context(upper.borrowed(k))
                    if data is not None:
                        break
                if data is not None:
                    items.append((k, data))
                else:
                    lost.append(k)
            results = self.tiers[level].put_many(items) if items else []
        for (k, _), ok in zip(items, results, strict=True):
            self._written(k, level, ok)
        for k in lost:
            self._written(k, level, ok=False)

    def _written(self, key: ChunkKey, level: int, ok: bool) -> None:
        with self._cond:
            levels = self._pending.get(key)
            if levels is None or level not in levels:
                return
            levels.discard(level)
            if not levels:
                del self._pending[key]
            stats = self._wb[level]
            stats["writeback_pending"] -= 1
            stats["writeback_done" if ok else "writeback_failed"] += 1
            self._cond.notify_all()
        if not ok:
            log.warning("write-back of %s to tier %s failed", key.hex(), self.tiers[level].name)

    def _before_evict(self, tier: Tier, key: ChunkKey) -> None:
        """Called by ``tier`` before it drops ``key``: make sure some lower tier holds it."""
        level = self._level[id(tier)]
        with self._cond:
            targets = sorted(j for j in self._pending.get(key, ()) if j > level)
        if not targets:
            return  # clean: every lower tier has it, or it was never meant to go lower
        for j in range(level + 1, len(self.tiers)):
            if j not in targets and self.tiers[j].contains_many([key], probe=False)[0]:
                return  # a lower tier already holds it; the rest of the write-back reads from there
        with tier.borrowed(key) as data:
            if data is None:
                return
            for j in targets:
                ok = self.tiers[j].put(key, data)
                self._written(key, j, ok)
                if ok:
                    return

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pending write-back has reached its tier (or failed and been counted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TierTimeoutError(f"flush: {len(self._pending)} chunks still pending after {timeout}s")
                self._cond.wait(remaining if remaining is not None else 1.0)

    # ------------------------------------------------------------------ reads
    def get(self, key: ChunkKey, device: str | torch.device = "cpu",
            out: Mapping[str, torch.Tensor] | None = None) -> TensorDict | None:
        """The chunk's tensors from the highest tier holding it, or ``None`` (a miss, never wrong data).

        With ``out``, the tensors are copied into those caller-owned buffers (names, shapes and dtypes
        must match) and ``out`` is returned. Under ``retain`` the chunk is admitted to every tier above
        the one that served it before this returns.
        """
        self._check_open()
        check_key(key)
        self._count("gets")
        for level, tier in enumerate(self.tiers):
            data = tier.get(key, device=device, out=out)
            if data is None:
                continue
            self._count("hits")
            if level and self.prefetch_policy is PrefetchPolicy.RETAIN:
                self._promote(key, data, level)
            return data
        self._count("misses")
        return None

    def _promote(self, key: ChunkKey, data: Mapping[str, torch.Tensor], level: int) -> None:
        for upper in self.tiers[:level]:
            upper.put(key, data)
        self._count("promotions")

    def contains(self, key: ChunkKey) -> bool:
        check_key(key)
        return any(t.contains(key) for t in self.tiers)

    def where(self, key: ChunkKey) -> str | None:
        """Name of the highest tier holding ``key``, or ``None``."""
        check_key(key)
        for t in self.tiers:
            if t.contains(key):
                return t.name
        return None

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """Length of the leading run of ``keys`` held by some tier (index checks, no data read).

        Keys past the local tiers' run are probed on shared tiers (a HEAD each) until the first miss.
        """
        keys = list(keys)
        found = [False] * len(keys)
        for t in self.tiers:
            rest = [i for i, f in enumerate(found) if not f]
            if not rest:
                break
            for i, hit in zip(rest, t.contains_many([keys[i] for i in rest], probe=False), strict=True):
                found[i] = hit
        n = found.index(False) if False in found else len(found)
        while n < len(keys) and (found[n] or any(t.contains(keys[n]) for t in self.tiers)):
            n += 1
        return n

    def prefetch(self, keys: Iterable[ChunkKey]) -> Future[int]:
        """Promote ``keys`` toward the top tier in the background, at most ``max_in_flight`` at a time.

        The returned future resolves to the number of keys now held by the top tier.
        """
        self._check_open()
        keys = [check_key(k) for k in keys]
        done: Future[int] = Future()
        if not keys:
            done.set_result(0)
            return done
        remaining, held, lock = [len(keys)], [0], threading.Lock()

        def finished(f: Future[bool]) -> None:
            with lock:
                held[0] += bool(not f.exception() and f.result())
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                done.set_result(held[0])

        for k in keys:
            self._prefetcher.submit(self._promote_one, k).add_done_callback(finished)
        return done

    def _promote_one(self, key: ChunkKey) -> bool:
        for level, tier in enumerate(self.tiers):
            if not tier.contains(key):
                continue
            if level == 0:
                return True
            with tier.borrowed(key) as data:
                if data is None:
                    continue
                self._promote(key, data, level)
            return self.tiers[0].contains(key)
        return False

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        """Per-tier counters and sizes plus the store's own totals (what a dashboard needs)."""
        tiers = {t.name: {**t.stats(), **self._wb[i]} for i, t in enumerate(self.tiers)}
        with self._cond:
            pending = len(self._pending)
            counts = dict(self._counts)
        return {"tiers": tiers, "pending_writeback": pending, **counts,
                "write_policy": self.write_policy.value, "prefetch_policy": self.prefetch_policy.value}

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    def _count(self, name: str) -> None:
        with self._cond:
            self._counts[name] += 1

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store is closed")

    def close(self) -> None:
        """Flush pending write-back, stop background threads and close every tier."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for q in self._queues.values():
                q.put(_STOP)
            for w in self._writers:
                w.join()
            self._prefetcher.shutdown(wait=True)
            for t in self.tiers:
                t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TieredStore {' > '.join(t.name for t in self.tiers)} {self.write_policy.value}>"


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
    return TieredStore(build_tiers(cfg), cfg.write_policy, cfg.prefetch_policy, cfg.max_in_flight)
