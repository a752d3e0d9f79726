"""The tiered store — the facade over the control plane, the data plane and the backends — and ``tierstore.open``.

Four parts, each one concept (``docs/design.md`` draws who may call whom):

* :mod:`tierstore.residency` — *where every chunk lives*: copies per tier with their generations, LRU order,
  byte budgets, pins, pending write-backs, one storage mutation per key and tier. Pure, no I/O.
* :mod:`tierstore.backends` — *plain storage* per tier (memory, a disk directory, any fsspec URL), registered
  by kind, described by capability flags.
* :mod:`tierstore.transfers` — *every move of bytes* as a job: batched reads, landings with their evictions,
  write-back, promotion.
* this module — the public API. Batched methods are the implementation and the single-key ones wrap them;
  every call runs under one lifecycle guard (:mod:`tierstore.lifecycle`).

What a call does:

* **put**: ``write_back`` lands a chunk in the highest tier that takes it, and the tiers below it are
  written in the background; ``write_through`` writes every tier before returning (one that refuses is
  retried by write-back). ``put`` says whether some tier took the chunk.
* **get**: each key from the highest tier holding its current value, never an older one; under ``retain``
  what came from below is promoted to the top by a job once the caller has its bytes.
* **pressure**: a tier full of chunks that are not yet written below evicts them after writing them down;
  when no tier below can take them (a remote outage), ``on_pressure: drop`` drops them (counted, named by
  ``flush``) and ``keep`` keeps them (the put that needed the room skips the tier).
* **close**: refuses new calls, waits for running ones, flushes with a deadline and never raises for write-back
  failures; a store still open at interpreter exit is closed then.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from .backends import backend_class
from .backends.base import Backend
from .config import MetricsConfig, PrefetchPolicy, StoreConfig, WritePolicy, parse_config, read_config
from .errors import ClosedError, ConfigError, InvalidInputError, InvalidTypeError, TierTimeoutError, WriteBackError
from .keys import ChunkKey, check_key
from .lifecycle import Lifecycle, track, untrack
from .objformat import Encoded, validate_chunk
from .outcomes import Eviction
from .promotion import Promoter
from .residency import Hold, Pressure, Residency
from .telemetry import Counters, Latency
from .tensors import TensorDict, check_device, check_outs
from .transfers import Tier, Transfers
from .writeback import FlushReport, WriteBack

if TYPE_CHECKING:
    from .api import Store
    from .metrics import MetricsServer
    from .reservation import Reservation

log = logging.getLogger("tierstore")

#: seconds ``close()`` (and the flush at interpreter exit) waits for write-back by default
CLOSE_TIMEOUT = 10.0
#: first window of keys past the local run that ``lookup`` probes on shared tiers at once (doubles per round)
LOOKUP_WINDOW = 32
#: threads of the executor behind the ``*_async`` methods (each call fans out further on the backends' pools)
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
    _held: list[Hold] = field(default_factory=list, repr=False)


@dataclass
class Loan:
    """What :meth:`TieredStore.lend` lent: per key the top tier's own tensors (views of its memory, no copy)
    or ``None``; valid until :meth:`close`, which gives them back (a second close does nothing). ``marks``:
    per key, in a shared pool, ``(stamp, byte offset of its stamp word)`` (see :mod:`tierstore.backends.memory`)."""

    tensors: list[TensorDict | None]
    marks: list[tuple[int, int] | None] = field(default_factory=list)
    _stack: ExitStack = field(default_factory=ExitStack, repr=False)

    def changed(self) -> list[int]:
        """Indices of lent chunks whose memory went to another value while lent: none (the loan pins them; a node
        server's loans, whose leases can expire, say otherwise)."""
        return []

    def close(self) -> None:
        self._stack.close()


class TieredStore:
    """A content-addressed chunk store over ordered tiers (fastest first).

    Build one with :func:`tierstore.open`. All methods are thread-safe; no lock is held across I/O.
    Read-only tiers serve reads and are never written. Batches never raise for one key: a miss is
    ``None``/``False``; only a malformed call or a closed store raises.

    Attributes:
        tiers: the tiers, fastest first (:class:`~tierstore.transfers.Tier`: ``name``, ``kind``,
            ``backend``, ``capacity``).
        residency: the control plane (:class:`~tierstore.residency.Residency`).
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
        self._by_name = {tr.name: tr for tr in self.tiers}
        self._shared = [tr.index for tr in self.tiers if tr.index and tr.shared]
        self._lock = threading.Lock()
        self._counts = {"puts": 0, "gets": 0, "hits": 0, "misses": 0}
        self.latency = Latency()  # seconds per get_many / put_many / locate call, as the caller sees them
        self.counters = Counters()  # what the layers above count in this store (KV tokens, weight bytes)
        self.residency = Residency([tr.spec for tr in self.tiers],
                                   self.on_pressure)
        self._transfers = Transfers(self.tiers, self.residency)
        self._adopt()
        self._life = Lifecycle()
        self._closed = threading.Event()
        self._writeback = WriteBack(self._transfers, max_in_flight)
        self._promoter = Promoter(self._transfers, max_in_flight)
        self._async_pool = ThreadPoolExecutor(ASYNC_WORKERS, thread_name_prefix="tierstore-batch")
        #: the ``/metrics`` server when the config asks for one (``metrics.port`` is the port it got)
        self.metrics: MetricsServer | None = None
        if metrics is not None:
            from .metrics import MetricsServer

            try:
                self.metrics = MetricsServer(self, metrics.port, metrics.host)
            except BaseException:
                self._writeback.stop(1.0)
                self._async_pool.shutdown(wait=False)
                raise
        track(self)

    @classmethod
    def from_backends(cls, backends: Sequence[Backend | tuple[Backend, int | None]], **options: Any) -> TieredStore:
        """A store over backends opened by the caller, fastest first: each a backend, or ``(backend,
        capacity)``; tiers are named after the backends' ``name`` (else their ``kind``). ``options`` are the
        constructor's (``write_policy``, ``prefetch_policy``, ``on_pressure`` …). The store closes them."""
        tiers = []
        for i, entry in enumerate(backends):
            backend, capacity = entry if isinstance(entry, tuple) else (entry, None)
            if capacity is not None and backend.capabilities.shared and backend.capabilities.writable:
                from .config import REMOTE_CAPACITY_REFUSED

                raise ConfigError(f"tier {getattr(backend, 'name', backend.kind)!r}: {REMOTE_CAPACITY_REFUSED}")
            if backend.capacity is not None:
                capacity = backend.capacity if capacity is None else min(capacity, backend.capacity)
            tiers.append(Tier(i, getattr(backend, "name", None) or backend.kind, backend.kind, backend, capacity))
        return cls(tiers, **options)

    def _adopt(self) -> None:
        """Index what the persistent tiers hold (least recently used first) and trim any that holds more than
        its budget (a capacity lowered since, or files placed there by hand)."""
        for tr in self.tiers:
            if tr.caps.persistent and tr.backend.list_on_open:
                self.residency.adopt(tr.index, ((f.key, f.size) for f in tr.backend.list()))
            if tr.writable:
                deadline = time.monotonic() + 60.0
                for victim in self.residency.trim(tr.index):
                    self._transfers.evict(victim, deadline)

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Iterable[Item]) -> list[bool]:
        """Store each ``(key, tensors)``; per item ``True`` once the top tier that takes it holds it
        (``write_back``, then written below in the background) or some tier does (``write_through``).

        ``False`` where no tier accepted the chunk or the item is malformed (logged); never raises for one
        item. A chunk larger than a tier skips that tier.
        """
        items, valid = check_items(items)
        return self._put_valid(items, valid)

    def put(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Store one chunk; whether some tier took it (see :meth:`put_many`). Bad input raises
        (:class:`~tierstore.InvalidTypeError` / :class:`~tierstore.InvalidInputError`) before any tier."""
        check_key(key)
        validate_chunk(tensors)
        return self._put_valid([(key, tensors)], [0])[0]

    def _put_valid(self, items: list[Item], valid: list[int]) -> list[bool]:
        start = perf_counter()
        try:
            with self._life.call(acknowledges=True):
                self._count(puts=len(valid))
                ok = self._land_puts(items, valid)
        finally:
            self.latency.since("put", start)
        refused = sum(1 for i in valid if not ok[i])
        if refused:
            log.warning("put_many: no tier accepted %d of %d chunks", refused, len(valid))
        return ok

    def _land_puts(self, items: list[Item], valid: list[int]) -> list[bool]:
        """Each valid item into the highest tier that takes it (``write_back``) or into every tier
        (``write_through``); per item whether some tier holds it (or a newer put of its key superseded it)."""
        through = self.write_policy is WritePolicy.WRITE_THROUGH
        gens = {i: self.residency.next_gen() for i in valid}
        ok = [False] * len(items)
        todo = list(valid)
        for tr in self.tiers:
            if not todo:
                break
            if not tr.writable:
                continue
            landed = self._transfers.land_many(tr.index, [(items[i][0], gens[i], items[i][1]) for i in todo],
                                               put=True, queue=not through)
            rest = []
            for i, outcome in zip(todo, landed, strict=True):
                if outcome is not False:
                    ok[i] = True
                if outcome is False or (through and outcome):
                    rest.append(i)
            todo = rest
        return ok

    def delete(self, keys: ChunkKey | Sequence[ChunkKey]) -> int:
        """Remove ``keys`` from every tier this store writes (pending write-back included); returns how many
        were held somewhere and are gone from every tier now. A tier that cannot remove its copy (a shared tier
        that cannot be reached) keeps it, and so does the index: that key is not counted (logged; see
        :meth:`delete_many` for the answer per key)."""
        keys = check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        with self._life.call():
            return sum(held and gone for held, gone in map(self._delete_one, dict.fromkeys(keys)))

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Remove each key from every tier this store writes; per key whether no tier holds a copy of it now.

        ``False``: some tier could not remove its copy (a shared tier that cannot be reached): the key is not
        deleted. Tiers are cleared slowest first, and the one that failed and every tier above it keep their
        copies, and write-back restores the tiers below it, so readers (here, in other processes, after a
        restart) find the key's latest value, never an older one that tier held. Try again later."""
        keys = check_keys(keys)
        with self._life.call():
            gone = {k: self._delete_one(k)[1] for k in dict.fromkeys(keys)}
            return [gone[k] for k in keys]

    def _delete_one(self, k: ChunkKey) -> tuple[bool, bool]:
        """Delete ``k``: ``(whether some tier held it, whether every tier that was asked removed it)``."""
        res = self.residency
        res.wait_until(partial(_true_or_none, res.begin_delete, k))
        tiers = res.wait_until(partial(res.delete_ready, k))
        assert tiers is not None
        kept: list[int] = []
        for n, tier in enumerate(reversed(tiers)):  # slowest first: a tier that keeps its copy keeps those above
            tr = self.tiers[tier]
            (err,) = tr.backend.delete_many([k])
            if err is not None and not isinstance(err, FileNotFoundError):
                tr.failures.report("delete", "could not delete %s (kept, and the tiers above keep theirs): %s",
                                   k.hex(), err)
                kept = tiers[:len(tiers) - n]
                break
        return res.end_delete(k, kept) > 0, not kept

    def evict(self, keys: ChunkKey | Sequence[ChunkKey], tier: str) -> int:
        """Remove ``keys``' copies from tier ``tier`` as an eviction would (a chunk not yet written below is
        written there first; a pinned or busy one stays); returns how many copies went. The other tiers keep
        theirs: a demotion, not a delete. A shared tier is refused (:class:`~tierstore.InvalidInputError`):
        its objects are every process's (remove them with :meth:`delete`, or ``tierstore gc``)."""
        keys = check_keys([keys] if isinstance(keys, ChunkKey) else keys)
        tr = self.tier(tier)
        if tr.shared:
            raise InvalidInputError(f"tier {tier!r} is shared with other processes: evict only demotes from "
                                    "this store's own tiers (delete() removes a key everywhere)")
        index = tr.index
        with self._life.call():
            n = 0
            deadline = time.monotonic() + self._transfers.pin_wait
            for k in dict.fromkeys(keys):
                victim = self.residency.choose(k, index)
                if victim is not None:
                    n += self._transfers.evict(victim, deadline) is Eviction.REMOVED
            return n

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until write-back has brought every chunk put so far to every tier below it.

        A write that fails is retried with back-off while the chunk is held; ``flush`` first grants failing
        writes a fresh round of retries. Promotions under way when it begins (after a read, a prefetch) finish
        first, and the tiers they fill are waited for too. A chunk counts as safely written below once a
        ``flush`` that began after its ``put`` returns without raising and without naming it in ``dropped``.

        Returns:
            a :class:`~tierstore.writeback.FlushReport`: the chunks the ``drop`` pressure policy gave up
            (named by every flush until the key is put again).
        Raises:
            WriteBackError: some chunks could not be written; ``failed`` maps each key to the names of the
                tiers it did not reach (still retried while held), ``dropped`` is as in the report.
            TierTimeoutError: ``timeout`` seconds passed with writes still in progress.
        """
        with self._life.call():
            deadline = None if timeout is None else time.monotonic() + timeout
            self._promoter.wait(deadline)  # promotions under way: the tiers they fill count as put
            return self._writeback.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[ChunkKey], *, out: Outs | None = None,
                 device: str | torch.device = "cpu") -> list[TensorDict | None]:
        """Each key's tensors from the highest tier holding it, or ``None`` (a miss, never wrong data).

        With ``out`` (one caller-owned mapping per key, names/shapes/dtypes as stored), ``out[i]`` is filled
        and returned for a hit; an ``out[i]`` that does not match its chunk yields ``None`` and a warning.
        ``out`` tensors that overlap one another or carry the conjugate/negative bit raise
        :class:`~tierstore.InvalidInputError` before any I/O. Under ``retain`` the hits from lower tiers are
        promoted to the top tier by a background job once this returns. Duplicate keys each get their own
        result.
        """
        results = self._read_many(keys, out, device)
        if out is not None and any(issubclass(t, InvalidInputError) for t in set(map(type, results))):
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
        keys = check_keys(keys)
        device = check_device(device)  # a caller's mistake, not a tier's read failure
        if out is not None:
            if isinstance(out, Mapping) or not isinstance(out, Sequence):
                raise InvalidTypeError("out must be a sequence with one Mapping[str, Tensor] per key")
            if len(out) != len(keys):
                raise InvalidInputError(f"out has {len(out)} entries for {len(keys)} keys")
            check_outs(out)
        top = self._transfers.top if self._transfers.top is not None else len(self.tiers)
        retain = self.prefetch_policy is PrefetchPolicy.RETAIN and top < len(self.tiers) - 1  # a tier below top
        # objects read from a shared tier are decoded here, so a promotion writes them without reading again
        objects = [tr.index for tr in self.tiers if retain and tr.shared and tr.caps.objects and tr.index > top]
        with self._life.call():
            results, source = self._transfers.read(keys, out, device, objects_from=objects)
            if retain:
                results = self._admit_below(keys, results, source, top)
            self._note_use_below(keys, source)
        hits = len(keys) - source.count(None)  # a key read from no tier missed (or its out did not fit)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits)
        return results

    def _admit_below(self, keys: list[ChunkKey], values: list[Any], source: list[tuple[int, int] | None],
                     top: int) -> list[Any]:
        """Hand the hits read from below ``top`` to the promoter (``retain``); returns the values, each object
        read along (a ``(value, Encoded)`` pair) replaced by its value."""
        results: list[Any] = []
        admit: list[tuple[ChunkKey, int, int, Encoded | None]] = []
        seen: set[ChunkKey] = set()
        for k, value, src in zip(keys, values, source, strict=True):
            obj = None
            if isinstance(value, tuple):
                value, obj = value
            results.append(value)
            if src is not None and src[0] > top and src[1] >= 0 and k not in seen:
                seen.add(k)
                admit.append((k, src[0], src[1], obj))
        if admit:
            self._promoter.admit(admit)
        return results

    def _note_use_below(self, keys: list[ChunkKey], source: list[tuple[int, int] | None]) -> None:
        """Tell each shared tier which keys a tier above it served: their objects there are in use too."""
        for tier in self._shared:
            above = [k for k, s in zip(keys, source, strict=True) if s is not None and s[0] < tier]
            if above:
                self.tiers[tier].backend.note_use(above)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether some tier holds each key; shared tiers are probed concurrently for keys the index lacks."""
        keys = check_keys(keys)
        with self._life.call():
            return [f is not None for f in self._tiers(keys, probe=True)]

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([check_key(key)])[0]

    def _tiers(self, keys: list[ChunkKey], probe: bool, local: bool = False) -> list[int | None]:
        """Per key, the first tier holding its current value, or ``None``: from the index, then (``probe``)
        asking the shared tiers about the keys it lacks. ``local``: tiers that are not shared only."""
        res = self.residency
        tiers = [tr.index for tr in self.tiers if not (local and tr.shared)]
        found = res.locate(keys, tiers)
        if not probe or local:
            return found
        token = res.deletes
        for tier in self._shared_tiers():
            tr = self.tiers[tier]
            ask = [i for i, f in enumerate(found) if f is None and tier in res.probe_tiers(keys[i])]
            if not ask:
                continue
            start = perf_counter()
            sizes = tr.backend.stat_many([keys[i] for i in ask])
            tr.latency.since("lookup", start)
            for i, size in zip(ask, sizes, strict=True):
                if size is not None and res.found(tier, keys[i], size, token) is not None:
                    found[i] = tier
        return found

    def _shared_tiers(self) -> list[int]:
        return [tr.index for tr in self.tiers if tr.shared]

    def lookup(self, keys: Sequence[ChunkKey], *, probe: bool = True) -> int:
        """Length of the leading run of ``keys`` held by some tier (see :meth:`locate`)."""
        return len(self.locate(keys, probe=probe))

    def locate(self, keys: Sequence[ChunkKey], *, probe: bool = True, local: bool = False) -> list[str]:
        """Name of the highest tier holding each key of the leading run of ``keys`` that some tier holds
        (the run's length is :meth:`lookup`'s answer).

        The index is checked first (no I/O); keys past that run are probed on shared tiers in concurrent
        windows (32, 64, ... keys), so a cold prefix costs a few round trips, not one per key. ``probe=False``
        stops at the index: no I/O at all (what a caller on an engine's forward thread wants); ``local`` asks
        only the tiers that are not shared (no I/O either).
        """
        start = perf_counter()
        keys = check_keys(keys)
        with self._life.call():
            found = self._tiers(keys, probe=False, local=local)
            n = _leading(found)
            window = LOOKUP_WINDOW
            while probe and not local and n < len(keys):
                end = min(len(keys), n + window)
                missing = [i for i in range(n, end) if found[i] is None]
                for i, tier in zip(missing, self._tiers([keys[i] for i in missing], probe=True), strict=True):
                    found[i] = tier
                n = _leading(found, n)
                if n < end:
                    break
                window *= 2
            self.latency.since("lookup", start)
            return [self.tiers[tier].name for tier in found[:n] if tier is not None]

    def readiness(self, keys: Sequence[ChunkKey], *, promote: bool = True) -> Readiness:
        """How much of ``keys`` can be loaded now, without any I/O on the caller's thread.

        ``ready``: the leading run held in local (not shared) tiers, from the index. ``pending``: the run after
        it that is being promoted now. With ``promote``, a background job probes the shared tiers for the keys
        after ``ready`` and promotes the run they hold; those keys are pending meanwhile.
        """
        keys = check_keys(keys)
        with self._life.call():
            ready = len(self.locate(keys, local=True))
            rest = keys[ready:]
            if promote and rest and self._shared_tiers():
                self._promoter.promote_shared(rest, self.lookup)
            return Readiness(ready, self._promoter.pending(rest) if rest else 0)

    def where(self, key: ChunkKey) -> str | None:
        """Name of the highest tier holding ``key``'s current value, or ``None``."""
        check_key(key)
        with self._life.call():
            (tier,) = self._tiers([key], probe=True)
            return None if tier is None else self.tiers[tier].name

    def holders(self, key: ChunkKey) -> list[str]:
        """Names of every tier whose index holds ``key``'s current value, fastest first (no I/O)."""
        check_key(key)
        with self._life.call():
            return [tr.name for tr in self.tiers if self.residency.current_gen(key, tr.index) is not None]

    def prefetch(self, keys: Iterable[ChunkKey]) -> Future[int]:
        """Promote ``keys`` toward the top tier in the background, at most ``max_in_flight`` at a time.

        The returned future resolves to the number of keys now held by the top tier. If a promotion raised,
        the future raises the first such exception once all keys are done (each one is also logged and
        counted in ``stats()["prefetch_errors"]``).
        """
        keys = [check_key(k) for k in keys]
        with self._life.call():
            return self._promoter.prefetch(keys)

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Sequence[ChunkKey]) -> Pin:
        """Hold each key in the highest tier holding its current value against eviction (no I/O), until
        :meth:`release` (engine-style prepare/complete around a load). ``Pin.ready`` is the leading run
        pinned."""
        keys = check_keys(keys)
        with self._life.call():
            holds = self.residency.pin(list(dict.fromkeys(keys)))
            pinned = {h.key for h in holds if h is not None}
            return Pin(tuple(keys), _leading([k in pinned for k in keys]), [h for h in holds if h is not None])

    def release(self, pin: Pin) -> None:
        """Give back what :meth:`pin` held (a second release does nothing)."""
        held, pin._held = pin._held, []
        self.residency.unpin(held)

    def lend(self, keys: Sequence[ChunkKey]) -> Loan:
        """Each key's tensors as a top tier that lends its memory holds them (the ``host`` pool): views, no
        copy, held against eviction and against reuse by an overwrite until :meth:`Loan.close`. ``None``
        where that tier does not hold the key's current value (read those with :meth:`get_many`); all
        ``None`` if the top tier does not lend. What a node server hands its clients."""
        keys = check_keys(keys)
        with self._life.call():
            loan = Loan([None] * len(keys))
            top = self.tiers[0] if self.tiers else None
            if top is None or not top.caps.zero_copy:
                return loan
            holds = self.residency.pin(keys, [0])
            loan._stack.callback(self.residency.unpin, holds)
            held = [k for k, h in zip(keys, holds, strict=True) if h is not None]
            lend = getattr(top.backend, "lend_many", None)
            if lend is not None:  # the host pool: one pass under its lock
                tensors, runs, marks = lend(held)
                loan._stack.callback(top.backend.give_back, runs)  # type: ignore[attr-defined]
            else:
                tensors = [loan._stack.enter_context(top.backend.borrow(k)) for k in held]
                marks = [None] * len(held)
            got, marked = iter(tensors), iter(marks)
            loan.marks = [None] * len(keys)
            lent = 0
            for i, h in enumerate(holds):
                if h is not None:
                    loan.tensors[i] = t = next(got)
                    loan.marks[i] = next(marked)
                    lent += t is not None
            if lent:
                top.count(hits=lent)
                self._count(gets=lent, hits=lent)
            return loan

    def reserve(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]], *,
                wait: bool = True) -> Reservation:
        """Pool memory of the top tier set aside for each ``(key, like)`` — a chunk shaped like ``like`` — to be
        filled in place and committed: a put without the copy in (see :mod:`tierstore.reservation`).
        ``wait=False``: never blocks (free memory and clean victims only; the rest get ``None``)."""
        from .reservation import Owner, reservable, reserve

        items = [(check_key(k), like) for k, like in items]
        owner = Owner(self.residency, self._transfers, self._life, lambda n: self._count(puts=n))
        return reserve(owner, reservable(self), items, wait)

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
        self._life.check_fork()  # the parent's threads may have held the locks at the fork
        tiers = {tr.name: {**tr.snapshot(), **self.residency.tier_stats(tr.index)} for tr in self.tiers}
        with self._lock:
            counts = {**self._counts, **self._promoter.counts}
        return {"tiers": tiers, "pending_writeback": self.residency.dirty(), **counts,
                "counters": self.counters.snapshot(), "jobs": self._transfers.jobs.summary(),
                "write_policy": self.write_policy.value, "prefetch_policy": self.prefetch_policy.value,
                "on_pressure": self.on_pressure.value}

    def tier(self, name: str) -> Tier:
        """The tier named ``name`` (its ``backend``, ``capacity``, ``kind``); an unknown name raises
        :class:`~tierstore.InvalidInputError` naming the tiers there are."""
        tr = self._by_name.get(name)
        if tr is None:
            raise InvalidInputError(f"no tier named {name!r} (tiers: {', '.join(self._by_name)})")
        return tr

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def close(self, timeout: float | None = None) -> None:
        """Refuse new calls, wait for running ones, flush, then stop and close the tiers.

        The flush goes on while write-back makes progress: it gives up once ``timeout`` seconds (default
        ``close_timeout``) pass with no chunk written, so a healthy tier below that is slower than the timeout
        still receives every chunk; waiting for running calls and promotions is bounded by ``timeout`` in all.

        Never raises for write-back failures or the deadline: it logs one warning naming what it abandoned
        (a write still running past the deadline raises :class:`~tierstore.ClosedError` to its caller instead
        of acknowledging). Idempotent and thread-safe; a second caller waits for the first.
        """
        if self._life.forked_from is not None:
            return  # inherited across a fork: the parent closes it
        timeout = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._life.begin_close(timeout):
            self._closed.wait(timeout)
            return
        try:
            self._promoter.stop(deadline)
            settled = self._flush_for_close(timeout)
            self._writeback.stop(max(0.1, timeout if settled else 0.0))
            self._async_pool.shutdown(wait=False, cancel_futures=True)
            for tr in self.tiers:
                try:
                    tr.backend.close()
                except Exception as exc:  # noqa: BLE001 - close the others anyway
                    log.warning("close: tier %s: %s", tr.name, exc)
        finally:
            if self.metrics is not None:
                self.metrics.close()
            untrack(self)
            self._closed.set()

    def _flush_for_close(self, timeout: float) -> bool:
        """Flush while write-back makes progress (``timeout`` s without any: give up); whether it settled."""
        try:
            report = self._writeback.flush(timeout, stall=True)
            if report.dropped:
                log.info("close: %d chunks were dropped under pressure since the last flush", len(report.dropped))
        except WriteBackError as exc:
            log.warning("close: abandoning write-back of %d chunks: %s", len(exc.failed), exc)
        except TierTimeoutError as exc:
            log.warning("close: write-back made no progress for %ss; abandoning what is pending (%s)", timeout, exc)
            return False
        return True

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TieredStore {' > '.join(lv.name for lv in self.tiers)} {self.write_policy.value}>"


def check_keys(keys: Sequence[ChunkKey]) -> list[ChunkKey]:
    if isinstance(keys, (ChunkKey, str, bytes)) or not isinstance(keys, Iterable):
        raise InvalidTypeError("expected a sequence of ChunkKey")
    keys = list(keys)
    if set(map(type, keys)) <= {ChunkKey}:  # the common case, checked in C
        return keys
    return [check_key(k) for k in keys]


def check_items(items: Iterable[Item]) -> tuple[list[Item], list[int]]:
    """``items`` as a list and the indexes of those well formed (exactly what :meth:`TieredStore.put` refuses
    is left out, logged); raises only if ``items`` is not an iterable of items at all."""
    if isinstance(items, (Mapping, str, bytes)) or not isinstance(items, Iterable):
        raise InvalidTypeError("put_many takes an iterable of (ChunkKey, Mapping[str, Tensor]) pairs")
    items = list(items)
    valid: list[int] = []
    for i, item in enumerate(items):
        try:
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidTypeError(f"item is {type(item).__name__}, not a (key, tensors) pair")
            check_key(item[0])
            validate_chunk(item[1])
        except (TypeError, ValueError) as exc:
            log.warning("put_many: item %d rejected: %s", i, exc)
            continue
        valid.append(i)
    return items, valid


def _true_or_none(fn: Any, *args: Any) -> bool | None:
    """``True`` if ``fn(*args)`` is, else ``None`` (what :meth:`Residency.wait_until` waits past)."""
    return True if fn(*args) else None


def _leading(found: Sequence[object], start: int = 0) -> int:
    """End of the run of entries that are neither ``None`` nor ``False`` from ``start`` on."""
    for i in range(start, len(found)):
        if found[i] is None or found[i] is False:
            return i
    return len(found)


def build_tiers(config: StoreConfig) -> list[Tier]:
    """One :class:`~tierstore.transfers.Tier` per tier entry, its backend opened (closed again on failure)."""
    tiers: list[Tier] = []
    try:
        for i, tc in enumerate(config.tiers):
            cls = backend_class(tc.kind)
            options = dict(tc.options)
            capacity = options.pop("capacity", None)
            if "capacity" in inspect.signature(cls.__init__).parameters:
                options["capacity"] = capacity
            backend = cls(name=tc.name, **options)  # type: ignore[call-arg]  # every backend takes a name
            cap = backend.capacity if backend.capacity is not None else capacity
            tiers.append(Tier(i, tc.name, tc.kind, backend, cap))
    except BaseException:
        for tr in tiers:
            tr.backend.close()
        raise
    return tiers


def open(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Store:  # noqa: A001 - public name
    """Open a store from a dict, a YAML/JSON file, ``$TIERSTORE_CONFIG`` or the embedded default.

    ``{"server": "unix:///run/tierstore/tierstore.sock"}`` opens a node's ``tierstore serve`` instead: a
    :class:`~tierstore.serve.client.ServerStore`, with the same methods (optional keys: ``timeout``,
    ``connections``, ``server_uid``). Both are a :class:`tierstore.Store`; ``isinstance(store,
    tierstore.TieredStore)`` reaches what only the embedded store has (``tier()``, ``lend()``).

    The whole configuration is validated first; a bad key raises :class:`~tierstore.ConfigError`
    naming it before any tier touches storage.
    """
    raw = read_config(config)
    if "server" in raw:  # a node's `tierstore serve`: the same API, through its socket
        from .serve.client import ServerStore

        return ServerStore.from_config(raw)
    return open_tiered(raw)


def open_tiered(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> TieredStore:
    """:func:`open` for a config of tiers (never a node server's client): the embedded
    :class:`TieredStore`, typed as such (``tier()``, ``lend()``). A ``server`` key is refused."""
    raw = read_config(config)
    if "server" in raw:
        raise ConfigError("server: this needs an embedded store (tiers); tierstore.open() opens a server's client")
    cfg = parse_config(raw)
    tiers = build_tiers(cfg)
    try:
        return TieredStore(tiers, cfg.write_policy, cfg.prefetch_policy, cfg.max_in_flight, cfg.close_timeout,
                           cfg.on_pressure, cfg.metrics)
    except BaseException:
        for tr in tiers:
            tr.backend.close()
        raise
