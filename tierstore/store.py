"""The tiered store: ordered tiers, write-back, promotion, and the public ``tierstore.open``.

The batched methods are the implementation; the single-key ones wrap them. Every public call runs under
one lifecycle guard (:mod:`tierstore.lifecycle`). Write-back bookkeeping lives in :mod:`tierstore.writeback`,
promotion in :mod:`tierstore.promotion`:

* **put**: ``write_back`` lands a chunk in the highest tier that takes it and marks it dirty for the
  tiers below, which writer threads fill in batches; ``write_through`` writes every tier before returning.
* **dirty eviction**: each tier asks :meth:`WriteBack.before_evict` before it drops a victim; a dirty one
  is written below first, then kept or dropped as ``on_pressure`` says.
* **reads**: each key from the highest tier holding its current value; under ``retain`` what came from
  below is admitted to the top tier once it is in the caller's hands, and the tiers in between are filled
  by write-back.
* **close**: refuses new calls, waits for running ones, flushes with a deadline and never raises for
  write-back failures; a store still open at interpreter exit is closed then (bounded by the same deadline).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from .config import MetricsConfig, PrefetchPolicy, Pressure, StoreConfig, WritePolicy, parse_config
from .errors import ClosedError, InvalidInputError, InvalidTypeError, TierTimeoutError, WriteBackError
from .keys import ChunkKey, check_key
from .lifecycle import Lifecycle, track, untrack
from .objformat import validate_chunk
from .promotion import Promoter
from .telemetry import Counters, Latency
from .tensors import TensorDict, check_outs
from .tiers import Tier, tier_class
from .writeback import STAT_KEYS, FlushReport, WriteBack

if TYPE_CHECKING:
    from .metrics import MetricsServer

log = logging.getLogger("tierstore")

#: seconds ``close()`` (and the flush at interpreter exit) waits for write-back by default
CLOSE_TIMEOUT = 10.0
#: first window of keys past the local run that ``lookup`` probes on shared tiers at once (doubles per round)
LOOKUP_WINDOW = 32
#: threads of the executor behind the ``*_async`` methods (each call fans out further on the tiers' pools)
ASYNC_WORKERS = 4

Item = tuple[ChunkKey, Mapping[str, torch.Tensor]]
Outs = Sequence[Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Readiness:
    """What :meth:`TieredStore.readiness` found: the leading ``ready`` keys are in local tiers; the
    ``pending`` keys after them are being promoted now (ask again soon)."""

    ready: int
    pending: int


@dataclass
class Pin:
    """Keys held against eviction by :meth:`TieredStore.pin`; give it back with :meth:`TieredStore.release`.

    ``ready`` is the length of the leading run of ``keys`` pinned in some tier."""

    keys: tuple[ChunkKey, ...]
    ready: int
    _held: list[tuple[Tier, list[ChunkKey]]] = field(default_factory=list, repr=False)


class TieredStore:
    """A content-addressed chunk store over ordered tiers (fastest first).

    Build one with :func:`tierstore.open`. All methods are thread-safe; no lock is held across I/O.
    Read-only tiers serve reads and are never written. Batches never raise for one key: a miss is
    ``None``/``False``; only a malformed call or a closed store raises.
    """

    def __init__(self, tiers: Sequence[Tier], write_policy: WritePolicy = WritePolicy.WRITE_BACK,
                 prefetch_policy: PrefetchPolicy = PrefetchPolicy.RETAIN, max_in_flight: int = 8,
                 close_timeout: float = CLOSE_TIMEOUT, on_pressure: Pressure = Pressure.DROP,
                 metrics: MetricsConfig | None = None):
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.write_policy = WritePolicy(write_policy)
        self.prefetch_policy = PrefetchPolicy(prefetch_policy)
        self.on_pressure = Pressure(on_pressure)
        self.max_in_flight = max_in_flight
        self.close_timeout = close_timeout
        self._by_name = {t.name: t for t in self.tiers}
        self._shared_levels = [level for level, t in enumerate(self.tiers) if level and t.shared]
        self._lock = threading.Lock()
        self._counts = {"puts": 0, "gets": 0, "hits": 0, "misses": 0}
        self.latency = Latency()  # seconds per get_many / put_many / locate call, as the caller sees them
        self.counters = Counters()  # what the layers above count in this store (KV tokens, weight bytes)
        self._life = Lifecycle()
        self._closed = threading.Event()
        self._wb = WriteBack(self.tiers, max_in_flight, self.on_pressure)
        for t in self.tiers:
            t.before_evict = self._wb.before_evict
        self._promoter = Promoter(self.tiers, self._wb, max_in_flight, self._life.call)
        self._async_pool = ThreadPoolExecutor(ASYNC_WORKERS, thread_name_prefix="tierstore-batch")
        #: the ``/metrics`` server when the config asks for one (``metrics.port`` is the port it got)
        self.metrics: MetricsServer | None = None
        if metrics is not None:
            from .metrics import MetricsServer

            try:
                self.metrics = MetricsServer(self, metrics.port, metrics.host)
            except BaseException:
                self._wb.stop(1.0)
                self._async_pool.shutdown(wait=False)
                raise
        track(self)

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Iterable[Item]) -> list[bool]:
        """Store each ``(key, tensors)``; per item ``True`` once the top tier that takes it holds it
        (``write_back``, then written below in the background) or some tier does (``write_through``).

        ``False`` where no tier accepted the chunk or the item is malformed (logged); never raises for one
        item. A chunk larger than a tier skips that tier.
        """
        if isinstance(items, (Mapping, str, bytes)) or not isinstance(items, Iterable):
            raise InvalidTypeError("put_many takes an iterable of (ChunkKey, Mapping[str, Tensor]) pairs")
        items = list(items)
        valid: list[int] = []
        for i, item in enumerate(items):
            try:
                if not isinstance(item, tuple) or len(item) != 2:
                    raise InvalidTypeError(f"item is {type(item).__name__}, not a (key, tensors) pair")
                check_key(item[0])
                validate_chunk(item[1])  # exactly what put() refuses
            except (TypeError, ValueError) as exc:
                log.warning("put_many: item %d rejected: %s", i, exc)
                continue
            valid.append(i)
        return self._put_valid(items, valid)

    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Store one chunk; whether some tier took it (see :meth:`put_many`). Bad input raises
        (:class:`~tierstore.InvalidTypeError` / :class:`~tierstore.InvalidInputError`) before any tier."""
        check_key(key)
        validate_chunk(tensors)
        return self._put_valid([(key, tensors)], [0])[0]

    def _put_valid(self, items: list[Item], valid: list[int]) -> list[bool]:
        """Store ``items[i]`` for each validated ``i``; per item whether some tier took it."""
        start = perf_counter()
        try:
            return self._put_checked(items, valid)
        finally:
            self.latency.since("put", start)

    def _put_checked(self, items: list[Item], valid: list[int]) -> list[bool]:
        with self._life.call(acknowledges=True):
            self._count(puts=len(valid))
            # one item at a time per key (dirty before held, one write of a key at a time), on the top
            # tier's parallelism
            stored = self.tiers[0]._map(lambda i: self._put_claimed(*items[i]), valid)
            ok = [False] * len(items)
            for i, s in zip(valid, stored, strict=True):
                ok[i] = s
            refused = len(valid) - sum(stored)
            if refused:
                log.warning("put_many: no tier accepted %d of %d chunks", refused, len(valid))
            return ok

    def _put_claimed(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Store one validated chunk under its key's claim; whether some tier took it."""
        through = self.write_policy is WritePolicy.WRITE_THROUGH
        with self._wb.claim(key):
            self._wb.begin_put(key)  # dirty before any tier holds it
            landed, stale = False, []
            try:
                for level, tier in enumerate(self.tiers):
                    if tier.read_only:
                        if through:  # asked like every tier: it skips the chunk and counts that
                            tier.put_many([(key, tensors)])
                        continue
                    if not through:
                        self._wb.landing(key, level)
                    # a tier that refuses keeps its value for now: if no tier takes the chunk, that stays the
                    # key's value; if one does, what a refusing tier holds is older and must not be read
                    ok = tier.put_many([(key, tensors)], keep_on_failure=True)[0]
                    landed |= ok
                    if through:  # every tier now; one below the top that refuses is retried by write-back
                        self._wb.wrote(key, level, ok)  # meanwhile (and skipped by reads)
                        if not ok and level == 0:
                            stale.append(tier)
                    elif ok:
                        break
                    else:
                        stale.append(tier)
                if landed:
                    for tier in stale:
                        tier.delete(key)
            finally:
                self._wb.end_put(key, landed)
            return landed

    def delete(self, keys: ChunkKey | Sequence[ChunkKey]) -> int:
        """Remove ``keys`` from every tier this store writes (pending write-back included); returns how
        many were held somewhere. A shared tier that cannot be reached keeps its copy."""
        keys = _check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        with self._life.call():
            n = 0
            for k in dict.fromkeys(keys):
                with self._wb.claim(k):
                    n += any([t.delete(k) for t in self.tiers if not t.read_only])
                    self._wb.forget(k)  # after the tiers: a read that began meanwhile admits nothing
            return n

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until write-back has brought every chunk put so far to every tier below it.

        A write that fails is retried with back-off while the chunk is held; ``flush`` first grants
        failing writes a fresh round of retries. A chunk counts as safely written below once a ``flush``
        that began after its ``put`` returns without raising and without naming it in ``dropped``.

        Returns:
            a :class:`~tierstore.writeback.FlushReport`: the chunks the ``drop`` pressure policy gave up
            (named by every flush until the key is put again).
        Raises:
            WriteBackError: some chunks could not be written; ``failed`` maps each key to the names of
                the tiers it did not reach (still retried while held), ``dropped`` is as in the report.
            TierTimeoutError: ``timeout`` seconds passed with writes still in progress.
        """
        with self._life.call():
            return self._wb.flush(timeout)

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[ChunkKey], *, out: Outs | None = None,
                 device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """Each key's tensors from the highest tier holding it, or ``None`` (a miss, never wrong data).

        With ``out`` (one caller-owned mapping per key, names/shapes/dtypes as stored), ``out[i]`` is
        filled and returned for a hit; an ``out[i]`` that does not match its chunk yields ``None`` and a
        warning. ``out`` tensors that overlap one another or carry the conjugate/negative bit raise
        :class:`~tierstore.InvalidInputError` before any I/O. Under ``retain`` the hits from lower tiers
        are admitted to the top tier before this returns (the tiers in between follow in the background).
        Duplicate keys each get their own result.
        """
        results = self._read_many(keys, out, device)
        for i, r in enumerate(results):
            if isinstance(r, InvalidInputError):
                log.warning("get_many: out[%d] does not fit its chunk: %s", i, r)
                results[i] = None
        return results  # type: ignore[return-value]  # errors replaced just above

    def get(self, key: ChunkKey, *, out: Mapping[str, torch.Tensor] | None = None,
            device: str | torch.device = "cpu") -> TensorDict | None:
        """One chunk (see :meth:`get_many`); an ``out`` that does not match it raises
        :class:`~tierstore.InvalidInputError`."""
        check_key(key)
        (r,) = self._read_many([key], None if out is None else [out], device)
        if isinstance(r, InvalidInputError):
            raise r
        return r

    def _read_many(self, keys: Sequence[ChunkKey], out: Outs | None, device: str | torch.device
                   ) -> list[TensorDict | InvalidInputError | None]:
        start = perf_counter()
        try:
            return self._read_checked(keys, out, device)
        finally:
            self.latency.since("get", start)

    def _read_checked(self, keys: Sequence[ChunkKey], out: Outs | None, device: str | torch.device
                      ) -> list[TensorDict | InvalidInputError | None]:
        keys = _check_keys(keys)
        if out is not None:
            if isinstance(out, Mapping) or not isinstance(out, Sequence):
                raise InvalidTypeError("out must be a sequence with one Mapping[str, Tensor] per key")
            if len(out) != len(keys):
                raise InvalidInputError(f"out has {len(out)} entries for {len(keys)} keys")
            check_outs(out)
        with self._life.call():
            retain = self.prefetch_policy is PrefetchPolicy.RETAIN and len(self.tiers) > 1
            token = self._wb.read_begin() if retain else 0
            try:
                results, admit = self._read_levels(keys, out, device, retain)
                if admit:
                    self._promoter.admit(admit, token)
            finally:
                if retain:
                    self._wb.read_end(token)
        hits = sum(isinstance(r, dict) for r in results)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits)
        return results

    def _read_levels(self, keys: list[ChunkKey], out: Outs | None, device: str | torch.device, retain: bool
                     ) -> tuple[list[TensorDict | InvalidInputError | None], dict[ChunkKey, tuple[int, TensorDict]]]:
        """Read each key from the first tier holding its current value; also the hits below the top."""
        results: list[TensorDict | InvalidInputError | None] = [None] * len(keys)
        hit_level: list[int | None] = [None] * len(keys)
        admit: dict[ChunkKey, tuple[int, TensorDict]] = {}
        todo = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not todo:
                break
            # skip tiers that may hold an older value; checked per level (an eviction writes below first)
            stale = self._wb.stale_at([keys[i] for i in todo], level)
            rest = [i for i, s in zip(todo, stale, strict=True) if s]
            todo = [i for i, s in zip(todo, stale, strict=True) if not s]
            sub = [keys[i] for i in todo]
            got: Sequence[Any] = (tier.get_many(sub, device=device) if out is None
                                  else tier.fill_many(sub, [out[i] for i in todo]))
            for i, r in zip(todo, got, strict=True):
                if r is None:
                    rest.append(i)
                    continue
                results[i] = r
                if isinstance(r, dict):
                    hit_level[i] = level
                    if level and retain:
                        admit.setdefault(keys[i], (level, r))
            todo = rest
        self._note_use_below(keys, hit_level)
        return results, admit

    def _note_use_below(self, keys: list[ChunkKey], hit_level: list[int | None]) -> None:
        """Tell each shared tier which keys a tier above it served: their objects there are in use too."""
        for level in self._shared_levels:
            above = [k for k, h in zip(keys, hit_level, strict=True) if h is not None and h < level]
            if above:
                self.tiers[level].note_use(above)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether some tier holds each key; shared tiers are probed concurrently for keys the local
        indexes lack."""
        keys = _check_keys(keys)
        with self._life.call():
            return self._held(keys, probe=True)

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([check_key(key)])[0]

    def _levels(self, keys: list[ChunkKey], probe: bool, tiers: Sequence[Tier] | None = None) -> list[int | None]:
        """Per key, the level of the first of ``tiers`` (default: all) holding its current value, or ``None``;
        each tier is asked only for the keys not found above it. ``probe=False`` checks the in-memory indexes
        only."""
        found: list[int | None] = [None] * len(keys)
        for level, tier in enumerate(self.tiers):
            if tiers is not None and tier not in tiers:
                continue
            rest = [i for i, f in enumerate(found) if f is None]
            if not rest:
                break
            stale = self._wb.stale_at([keys[i] for i in rest], level)
            rest = [i for i, s in zip(rest, stale, strict=True) if not s]
            for i, hit in zip(rest, tier.contains_many([keys[i] for i in rest], probe=probe), strict=True):
                if hit:
                    found[i] = level
        return found

    def _held(self, keys: list[ChunkKey], probe: bool, tiers: Sequence[Tier] | None = None) -> list[bool]:
        return [f is not None for f in self._levels(keys, probe, tiers)]

    def lookup(self, keys: Sequence[ChunkKey], *, probe: bool = True) -> int:
        """Length of the leading run of ``keys`` held by some tier (see :meth:`locate`)."""
        return len(self.locate(keys, probe=probe))

    def locate(self, keys: Sequence[ChunkKey], *, probe: bool = True, local: bool = False) -> list[str]:
        """Name of the highest tier holding each key of the leading run of ``keys`` that some tier holds
        (the run's length is :meth:`lookup`'s answer).

        The in-memory indexes are checked first (no I/O); keys past that run are probed on shared tiers
        in concurrent windows (32, 64, ... keys), so a cold prefix costs a few round trips, not one per key.
        ``probe=False`` stops at the indexes: no I/O at all (what a caller on an engine's forward thread
        wants); ``local`` asks only the tiers that are not shared (no I/O either).
        """
        start = perf_counter()
        keys = _check_keys(keys)
        tiers = [t for t in self.tiers if not t.shared] if local else None
        probe = probe and not local
        with self._life.call():
            found = self._levels(keys, probe=False, tiers=tiers)
            n = _leading(found)
            window = LOOKUP_WINDOW
            while probe and n < len(keys):
                end = min(len(keys), n + window)
                missing = [i for i in range(n, end) if found[i] is None]
                for i, level in zip(missing, self._levels([keys[i] for i in missing], probe=True), strict=True):
                    found[i] = level
                n = _leading(found, n)
                if n < end:
                    break
                window *= 2
            self.latency.since("lookup", start)
            return [self.tiers[level].name for level in found[:n] if level is not None]

    def readiness(self, keys: Sequence[ChunkKey], *, promote: bool = True) -> Readiness:
        """How much of ``keys`` can be loaded now, without any I/O on the caller's thread.

        ``ready``: the leading run held in local (not shared) tiers, from their indexes. ``pending``: the
        run after it that is being promoted now. With ``promote``, a background job probes the shared tiers
        for the keys after ``ready`` and promotes the run they hold; those keys are pending meanwhile.
        """
        keys = _check_keys(keys)
        with self._life.call():
            ready = len(self.locate(keys, local=True))
            rest = keys[ready:]
            if promote and rest and any(t.shared for t in self.tiers):
                self._promoter.promote_shared(rest, self.lookup)
            return Readiness(ready, self._promoter.pending(rest) if rest else 0)

    def where(self, key: ChunkKey) -> str | None:
        """Name of the highest tier holding ``key``'s current value, or ``None``."""
        check_key(key)
        with self._life.call():
            for level, tier in enumerate(self.tiers):
                if not self._wb.stale_at([key], level)[0] and tier.contains(key):
                    return tier.name
            return None

    def prefetch(self, keys: Iterable[ChunkKey]) -> Future[int]:
        """Promote ``keys`` toward the top tier in the background, at most ``max_in_flight`` at a time.

        The returned future resolves to the number of keys now held by the top tier. If a promotion
        raised, the future raises the first such exception once all keys are done (each one is also
        logged and counted in ``stats()["prefetch_errors"]``).
        """
        keys = [check_key(k) for k in keys]
        with self._life.call():
            return self._promoter.prefetch(keys)

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Sequence[ChunkKey]) -> Pin:
        """Hold each key in the highest tier whose index has its current value against eviction (no I/O),
        until :meth:`release` (engine-style prepare/complete around a load). ``Pin.ready`` is the leading
        run pinned."""
        keys = _check_keys(keys)
        with self._life.call():
            todo = list(dict.fromkeys(keys))
            pinned: set[ChunkKey] = set()
            held: list[tuple[Tier, list[ChunkKey]]] = []
            for level, tier in enumerate(self.tiers):
                if not todo:
                    break
                fresh = [k for k, s in zip(todo, self._wb.stale_at(todo, level), strict=True) if not s]
                got = [k for k, size in zip(fresh, tier.pin(fresh), strict=True) if size is not None]
                if got:
                    held.append((tier, got))
                    pinned.update(got)
                    todo = [k for k in todo if k not in pinned]
            return Pin(tuple(keys), _leading([k in pinned for k in keys]), held)

    def release(self, pin: Pin) -> None:
        """Give back what :meth:`pin` held (a second release does nothing)."""
        held, pin._held = pin._held, []
        for tier, keys in held:
            tier.unpin(keys)

    # ------------------------------------------------------------------ async forms
    def get_many_async(self, keys: Sequence[ChunkKey], *, out: Outs | None = None,
                       device: str | torch.device = "cpu") -> Future[list[TensorDict | None]]:
        """:meth:`get_many` in the background; ``out`` buffers must stay alive until the future is done."""
        keys = list(keys)
        return self._submit(lambda: self.get_many(keys, out=out, device=device))

    def put_many_async(self, items: Iterable[Item]) -> Future[list[bool]]:
        """:meth:`put_many` in the background; the tensors must not change until the future is done."""
        items = list(items)
        return self._submit(lambda: self.put_many(items))

    def contains_many_async(self, keys: Sequence[ChunkKey]) -> Future[list[bool]]:
        keys = list(keys)
        return self._submit(lambda: self.contains_many(keys))

    def _submit(self, fn: Any) -> Future[Any]:
        """Run ``fn`` on the async executor; it counts as a running call from now until its future is done
        (so ``close()`` waits for it, and one submitted after ``close()`` began is refused)."""
        self._life.enter()
        try:
            future = self._async_pool.submit(fn)
        except RuntimeError:  # the pool was shut down by a racing close()
            self._life.leave()
            raise ClosedError("store is closed") from None
        future.add_done_callback(lambda _: self._life.leave())
        return future

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        """Per-tier counters and sizes plus the store's own totals (what a dashboard needs)."""
        self._life.check_fork()  # the parent's threads may have held the tiers' locks at the fork
        dirty, per_level = self._wb.stats()
        tiers = {t.name: {**t.stats(), **{k: per_level[i][k] for k in STAT_KEYS}} for i, t in enumerate(self.tiers)}
        with self._lock:
            counts = {**self._counts, **self._promoter.counts}
        return {"tiers": tiers, "pending_writeback": dirty, **counts, "counters": self.counters.snapshot(),
                "write_policy": self.write_policy.value,
                "prefetch_policy": self.prefetch_policy.value, "on_pressure": self.on_pressure.value}

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def close(self, timeout: float | None = None) -> None:
        """Refuse new calls, wait for running ones, flush for up to ``timeout`` seconds in all (default
        ``close_timeout``), then stop and close the tiers.

        Never raises for write-back failures or the deadline: it logs one warning naming what it
        abandoned (a write still running past the deadline raises :class:`~tierstore.ClosedError` to its
        caller instead of acknowledging). Idempotent and thread-safe; a second caller waits for the first.
        """
        if self._life.forked_from is not None:
            return  # inherited across a fork: the parent closes it
        timeout = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._life.begin_close(timeout):
            self._closed.wait(timeout)
            return
        try:
            self._promoter.stop()
            self._flush_for_close(deadline)
            self._wb.stop(max(0.1, deadline - time.monotonic()))
            self._async_pool.shutdown(wait=False, cancel_futures=True)
            for t in self.tiers:
                t.close(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            if self.metrics is not None:
                self.metrics.close()
            untrack(self)
            self._closed.set()

    def _flush_for_close(self, deadline: float) -> None:
        try:
            report = self._wb.flush(max(0.0, deadline - time.monotonic()))
            if report.dropped:
                log.info("close: %d chunks were dropped under pressure since the last flush", len(report.dropped))
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


def _check_keys(keys: Sequence[ChunkKey]) -> list[ChunkKey]:
    if isinstance(keys, (ChunkKey, str, bytes)) or not isinstance(keys, Iterable):
        raise InvalidTypeError("expected a sequence of ChunkKey")
    return [check_key(k) for k in keys]


def _leading(found: Sequence[object], start: int = 0) -> int:
    """End of the run of entries that are neither ``None`` nor ``False`` from ``start`` on."""
    for i in range(start, len(found)):
        if found[i] is None or found[i] is False:
            return i
    return len(found)


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
    tiers = build_tiers(cfg)
    try:
        return TieredStore(tiers, cfg.write_policy, cfg.prefetch_policy, cfg.max_in_flight, cfg.close_timeout,
                           cfg.on_pressure, cfg.metrics)
    except BaseException:
        for t in tiers:
            t.close()
        raise
