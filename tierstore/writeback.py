"""Write-back: which lower tiers each chunk still has to reach, and the threads that take it there.

A chunk a ``put`` left in a tier above is *dirty* for every writable tier below that one. Per dirty key
the store keeps the generation of its latest put and, per pending tier, how many writes have failed.
The rules, each checked by the store's tests:

1. **Dirty before held.** A put marks its key dirty before any tier holds the new value
   (:meth:`begin_put`), so no eviction can mistake the only copy for a clean one.
2. **One writer of a key at a time.** Every write of a key into any tier — a put, a promotion, a
   write-back or an eviction's write — holds the key's claim, and checks under it which tiers still
   need the current value. So no older value can land after a newer one. Puts and promotions wait for
   the claim; writers and evictions never wait for one (a writer tries again shortly, an eviction keeps
   its victim), so claims form no cycle.
3. **Any current copy is a source.** A writer reads the chunk from any tier that holds the current
   value, above its target first, then deeper ones. A tier still pending for a key may hold an older
   value: readers skip it (:meth:`stale_levels`).
4. **Retry while held.** A failed write is retried with exponential back-off for as long as the chunk
   is held. After ``fast_retries`` failures the level is *failing*: :meth:`flush` reports it, after
   granting it a fresh round of retries. A level is given up only when no tier holds the current value;
   flushes report it until the key is put again.
5. **Dirty eviction is synchronous.** A victim is written to the nearest pending tier that is not backing
   off before it is dropped. If no write succeeds and no other tier holds the current value, the
   pressure policy decides: ``keep`` keeps the victim (the put that needed room skips the tier),
   ``drop`` drops it (counted, named by every flush as *dropped*, not failed, until the key is put again) unless a tier
   below still holds an older value of the key, which must not become readable.
6. **A read never admits an older value.** A read that found a chunk below the top may admit it into
   the tiers above (promotion); it does so under the key's claim, and only if no put or delete of the key
   ended since the read began (:meth:`read_begin`, :meth:`changed_since`).

One writer thread per lower tier takes up to ``max_in_flight`` keys at a time and writes them with one
``put_many``. The store's lock is a leaf: no tier is called while it is held.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from . import objformat
from .config import Pressure
from .errors import TierTimeoutError, WriteBackError
from .keys import ChunkKey
from .tensors import TensorDict
from .tiers import Tier

log = logging.getLogger("tierstore")

STAT_KEYS = ("writeback_pending", "writeback_lag_s", "writeback_done", "writeback_failed", "writeback_dropped")
#: keys whose losses (levels given up, chunks dropped) flush keeps naming; older ones are only counted
LOSSES_KEPT = 1 << 16


def _remember(losses: OrderedDict[ChunkKey, set[int]], key: ChunkKey, level: int) -> None:
    losses.setdefault(key, set()).add(level)
    losses.move_to_end(key)
    while len(losses) > LOSSES_KEPT:
        losses.popitem(last=False)


@dataclass(frozen=True)
class FlushReport:
    """What a :meth:`~tierstore.TieredStore.flush` that raised nothing has to say: the chunks the ``drop``
    pressure policy gave up (key -> names of the tiers they never reached). Every flush names a dropped
    chunk until its key is put again or deleted, so each caller that flushes learns of it."""

    dropped: dict[ChunkKey, tuple[str, ...]] = field(default_factory=dict)


Chunk = TensorDict | objformat.Encoded


def _moves_objects(src: Tier, dst: Tier) -> bool:
    """Whether write-back from ``src`` to ``dst`` moves the stored object as it is (both keep encoded objects
    with the same codec: one checksum pass, on the read)."""
    return src.stores_objects and dst.stores_objects and getattr(src, "codec", None) == getattr(dst, "codec", None)


def _put_all(tier: Tier, items: list[tuple[ChunkKey, Chunk]]) -> list[bool]:
    """``tier.put_many`` of tensor chunks and ``tier.put_objects`` of encoded ones, results in item order."""
    objects = [(i, k, c) for i, (k, c) in enumerate(items) if isinstance(c, objformat.Encoded)]
    chunks = [(i, k, c) for i, (k, c) in enumerate(items) if not isinstance(c, objformat.Encoded)]
    results = [False] * len(items)
    if objects:
        for (i, _, _), ok in zip(objects, tier.put_objects([(k, c) for _, k, c in objects]), strict=True):
            results[i] = ok
    if chunks:
        for (i, _, _), ok in zip(chunks, tier.put_many([(k, c) for _, k, c in chunks]), strict=True):
            results[i] = ok
    return results


@dataclass
class _Dirty:
    gen: int
    pending: dict[int, int] = field(default_factory=dict)  # level -> failed attempts since the last success
    since: float = field(default_factory=time.monotonic)  # when this generation became dirty (write-back lag)


class WriteBack:
    """Dirty-chunk bookkeeping, per-key write claims and the writer threads of one store."""

    #: failures after which a level counts as failing (reported by ``flush``); retries go on meanwhile
    fast_retries = 4
    retry_delay = 0.05
    max_retry_delay = 5.0

    def __init__(self, tiers: Sequence[Tier], max_in_flight: int, on_pressure: Pressure = Pressure.DROP) -> None:
        self.tiers = list(tiers)
        self.max_in_flight = max_in_flight
        self.on_pressure = Pressure(on_pressure)
        self._writable = [i for i, t in enumerate(self.tiers) if not t.read_only]
        self._cond = threading.Condition()
        self._gen = 0  # bumped when a put begins and when a put or delete ends
        self._dirty: dict[ChunkKey, _Dirty] = {}
        self._superseded: dict[ChunkKey, _Dirty] = {}  # the pending record of a put's predecessor, while it runs
        # levels given up (no tier could be read for them) and dropped by the drop policy: every flush names
        # them until the key is put again or deleted (the newest LOSSES_KEPT keys of each)
        self._given_up: OrderedDict[ChunkKey, set[int]] = OrderedDict()
        self._dropped: OrderedDict[ChunkKey, set[int]] = OrderedDict()
        self._readers: dict[int, int] = {}  # generation a running read began at -> how many such reads
        self._changed: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> generation its last put/delete ended
        self._ready: dict[int, dict[ChunkKey, None]] = {j: {} for j in self._writable}
        self._retry_at: dict[int, dict[ChunkKey, float]] = {j: {} for j in self._writable}
        self._retry_heap: dict[int, list[tuple[float, int, ChunkKey]]] = {j: [] for j in self._writable}
        self._seq = itertools.count()  # heap tie-breaker
        self._counts = {j: {"writeback_done": 0, "writeback_failed": 0, "writeback_dropped": 0}
                        for j in range(len(self.tiers))}
        self._failing_logged: set[int] = set()
        self._stopping = False
        self._claim_cond = threading.Condition()
        self._claimed: set[ChunkKey] = set()
        self._threads = [threading.Thread(target=self._run, args=(j,), daemon=True,  # at exit: see store.py
                                          name=f"tierstore-writeback-{self.tiers[j].name}")
                         for j in self._writable if j > 0]
        for th in self._threads:
            th.start()

    # ------------------------------------------------------------------ claims (one writer per key)
    @contextmanager
    def claim(self, key: ChunkKey) -> Iterator[None]:
        """Hold ``key`` against every other write of it; call holding no other claim (it waits)."""
        with self._claim_cond:
            while key in self._claimed:
                self._claim_cond.wait()
            self._claimed.add(key)
        try:
            yield
        finally:
            self.release(key)

    def try_claim(self, key: ChunkKey) -> bool:
        with self._claim_cond:
            if key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def release(self, key: ChunkKey) -> None:
        with self._claim_cond:
            self._claimed.discard(key)
            self._claim_cond.notify_all()

    # ------------------------------------------------------------------ puts
    def begin_put(self, key: ChunkKey) -> None:
        """A put of ``key`` starts (caller holds its claim): dirty for every writable tier below the top."""
        with self._cond:
            self._gen += 1
            previous = self._dirty.get(key)
            if previous is not None:  # back in place if this put lands nowhere (its value is still pending)
                self._superseded[key] = previous
            self._dirty[key] = _Dirty(self._gen, dict.fromkeys((j for j in self._writable if j > 0), 0))
            self._given_up.pop(key, None)
            self._dropped.pop(key, None)
            for j in self._writable:
                self._retry_at[j].pop(key, None)

    # ------------------------------------------------------------------ reads that may promote
    def read_begin(self) -> int:
        """A read that may admit what it finds into the tiers above starts; pass the token to
        :meth:`changed_since` and then to :meth:`read_end`."""
        with self._cond:
            self._readers[self._gen] = self._readers.get(self._gen, 0) + 1
            return self._gen

    def read_end(self, token: int) -> None:
        with self._cond:
            left = self._readers[token] - 1
            if left:
                self._readers[token] = left
                return
            del self._readers[token]
            oldest = min(self._readers, default=None)
            changed = self._changed
            while changed and (oldest is None or next(iter(changed.values())) <= oldest):
                changed.popitem(last=False)  # no running read began before that change

    def changed_since(self, key: ChunkKey, token: int) -> bool:
        """Whether a put or delete of ``key`` ended after the read holding ``token`` began."""
        with self._cond:
            return self._changed.get(key, -1) > token

    def wrote(self, key: ChunkKey, level: int, ok: bool) -> None:
        """A ``write_through`` put (caller holds the claim) wrote ``level``: done, or retried like a write-back."""
        with self._cond:
            rec = self._dirty.get(key)
        if rec is not None:
            self._settle(key, level, rec.gen, ok)

    def _mark_changed(self, key: ChunkKey) -> None:
        """A put or delete of ``key`` ended (lock held): reads running now must not admit what they read."""
        self._gen += 1
        if self._readers:
            self._changed[key] = self._gen
            self._changed.move_to_end(key)

    def request_fill(self, key: ChunkKey, levels: Sequence[int]) -> None:
        """A read admitted ``key`` above ``levels`` (caller holds its claim): have write-back copy the current
        value into those tiers too, as for a put (promotion into the tiers in between)."""
        with self._cond:
            levels = [j for j in levels if j in self._ready]
            if not levels:
                return
            rec = self._dirty.get(key)
            if rec is None:
                rec = self._dirty[key] = _Dirty(self._gen)
            for j in levels:
                if j not in rec.pending:
                    rec.pending[j] = 0
                    self._ready[j][key] = None
            self._cond.notify_all()

    def forget(self, key: ChunkKey) -> None:
        """``key`` is being deleted (caller holds its claim): nothing of it is pending any more."""
        with self._cond:
            self._dirty.pop(key, None)
            self._given_up.pop(key, None)
            self._dropped.pop(key, None)
            for j in self._writable:
                self._retry_at[j].pop(key, None)
            for ready in self._ready.values():
                ready.pop(key, None)
            self._mark_changed(key)
            self._cond.notify_all()

    def landing(self, key: ChunkKey, level: int) -> None:
        """The put tries tier ``level`` next: only the tiers below it stay pending."""
        with self._cond:
            rec = self._dirty[key]
            rec.pending = {j: 0 for j in rec.pending if j > level}

    def end_put(self, key: ChunkKey, landed: bool) -> None:
        """The put is over; queue the pending levels. If no tier took it (the put itself reported that, so
        flush does not), the key keeps its previous value, and what of that value was pending still is."""
        with self._cond:
            previous = self._superseded.pop(key, None)
            self._mark_changed(key)
            rec = self._dirty.pop(key, None)  # None: a write_through put wrote every level already
            if not landed:  # the key keeps its previous value: what of it was pending still is
                rec = previous
            if rec is not None and rec.pending:
                self._dirty[key] = rec
                for j in rec.pending:
                    self._ready[j][key] = None
            self._cond.notify_all()

    def stale_levels(self, key: ChunkKey) -> frozenset[int]:
        """Levels that may hold an older value of ``key`` than the current one (skip them when reading)."""
        with self._cond:
            rec = self._dirty.get(key)
            return frozenset(rec.pending) if rec is not None else frozenset()

    def stale_at(self, keys: Sequence[ChunkKey], level: int) -> list[bool]:
        """Per key, whether ``level`` may hold an older value of it (:meth:`stale_levels`, one lock for all)."""
        with self._cond:
            if not self._dirty:
                return [False] * len(keys)
            dirty = self._dirty
            return [(rec := dirty.get(k)) is not None and level in rec.pending for k in keys]

    def mark_written(self, key: ChunkKey, level: int) -> None:
        """A promotion (caller holds the claim) copied the current value into ``level``."""
        with self._cond:
            rec = self._dirty.get(key)
            gen = rec.gen if rec is not None else -1
        self._settle(key, level, gen, ok=True)

    # ------------------------------------------------------------------ writing
    def _run(self, level: int) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    nxt = self._take_due(level)
                    if self._ready[level]:
                        break
                    self._cond.wait(None if nxt is None else max(0.0, nxt - time.monotonic()))
                ready = self._ready[level]
                keys = list(itertools.islice(ready, self.max_in_flight))
                for k in keys:
                    del ready[k]
            try:
                self._write(keys, level)
            except Exception as exc:  # a writer must never die: count the batch as failed and carry on
                log.warning("write-back to %s failed: %s", self.tiers[level].name, exc)
                for k in keys:
                    self._settle(k, level, self._gen_of(k), ok=False)

    def _retry_later(self, key: ChunkKey, level: int, at: float) -> None:
        """Queue ``key`` for ``level`` again at ``at`` (lock held; an earlier due time wins)."""
        if self._retry_at[level].get(key, float("inf")) > at:
            self._retry_at[level][key] = at
            heapq.heappush(self._retry_heap[level], (at, next(self._seq), key))

    def _take_due(self, level: int) -> float | None:
        """Move retries that are due to the ready queue (lock held); the next due time, if any."""
        heap, due_at, now = self._retry_heap[level], self._retry_at[level], time.monotonic()
        while heap:
            at, _, key = heap[0]
            if due_at.get(key) != at:
                heapq.heappop(heap)  # superseded or cancelled
            elif at <= now:
                heapq.heappop(heap)
                del due_at[key]
                self._ready[level][key] = None
            else:
                return at
        return None

    def _gen_of(self, key: ChunkKey) -> int:
        with self._cond:
            rec = self._dirty.get(key)
            return rec.gen if rec is not None else -1

    def _plan(self, keys: Sequence[ChunkKey], level: int) -> list[tuple[ChunkKey, int, list[int]]]:
        """``(key, generation, source levels)`` for each claimed key still pending at ``level``."""
        plan = []
        with self._cond:
            for k in keys:
                rec = self._dirty.get(k)
                if rec is not None and level in rec.pending:
                    plan.append((k, rec.gen, self._sources(rec, level)))
        return plan

    def _sources(self, rec: _Dirty, level: int) -> list[int]:
        above = [i for i in range(level) if i not in rec.pending]
        below = [i for i in range(level + 1, len(self.tiers)) if i not in rec.pending]
        return above + below

    def _read(self, stack: ExitStack, key: ChunkKey, sources: list[int], level: int) -> Chunk | None:
        for i in sources:
            tier = self.tiers[i]
            if _moves_objects(tier, self.tiers[level]):
                data: Chunk | None = tier.copy_encoded(key)  # the object's bytes as they are: no decode, no re-encode
            else:  # a deeper source is copied out unpinned: writing into `level` may evict into that tier
                data = stack.enter_context(tier.borrowed(key)) if i < level else tier.copy_out(key)
            if data is not None:
                return data
        return None

    def _write(self, keys: Sequence[ChunkKey], level: int) -> None:
        claimed = [k for k in dict.fromkeys(keys) if self.try_claim(k)]
        if len(claimed) < len(keys):
            with self._cond:  # another write of those keys is running: look again shortly
                soon = time.monotonic() + self.retry_delay
                for k in set(keys) - set(claimed):
                    self._retry_later(k, level, soon)
                self._cond.notify_all()
        try:
            self._write_claimed(claimed, level)
        finally:
            for k in claimed:
                self.release(k)

    def _write_claimed(self, keys: Sequence[ChunkKey], level: int) -> None:
        plan = self._plan(keys, level)
        if not plan:
            return
        tier = self.tiers[level]
        with ExitStack() as stack:
            items, gens, missing = [], [], []
            for k, gen, sources in plan:
                data = self._read(stack, k, sources, level)
                if data is None:
                    missing.append((k, gen, sources))
                else:
                    items.append((k, data))
                    gens.append(gen)
            results = _put_all(tier, items)
        for (k, _), gen, ok in zip(items, gens, results, strict=True):
            self._settle(k, level, gen, ok)
        for k, gen, sources in missing:
            if any(self.tiers[i].contains_many([k], probe=False)[0] for i in sources):
                self._settle(k, level, gen, ok=False)  # held but unreadable right now: try again later
            else:
                self._give_up(k, level, gen)

    def _settle(self, key: ChunkKey, level: int, gen: int, ok: bool) -> None:
        """Record the outcome of writing generation ``gen`` of ``key`` to ``level``."""
        with self._cond:
            rec = self._dirty.get(key)
            if rec is None or level not in rec.pending or rec.gen != gen:
                return  # already written, or a newer put owns the level now
            counts = self._counts[level]
            if ok:
                del rec.pending[level]
                self._retry_at[level].pop(key, None)
                counts["writeback_done"] += 1
                if not rec.pending:
                    del self._dirty[key]
                self._failing_logged.discard(level)
                self._cond.notify_all()
                return
            attempts = rec.pending[level] = rec.pending[level] + 1
            counts["writeback_failed"] += 1
            delay = min(self.retry_delay * 2 ** (attempts - 1), self.max_retry_delay)
            self._retry_at[level].pop(key, None)
            self._retry_later(key, level, time.monotonic() + delay)
            first = attempts == self.fast_retries and level not in self._failing_logged
            if first:
                self._failing_logged.add(level)
            self._cond.notify_all()
        if first:
            log.warning("write-back to tier %s keeps failing (e.g. %s); retrying while the chunks are held",
                        self.tiers[level].name, key.hex())

    def _give_up(self, key: ChunkKey, level: int, gen: int) -> None:
        """No tier holds the current value any more: stop retrying ``level`` and report it."""
        with self._cond:
            rec = self._dirty.get(key)
            if rec is None or level not in rec.pending or rec.gen != gen:
                return
            del rec.pending[level]
            if not rec.pending:
                del self._dirty[key]
            _remember(self._given_up, key, level)
            self._counts[level]["writeback_failed"] += 1
            self._cond.notify_all()
        tier = self.tiers[level]
        log.warning("write-back of %s to tier %s given up: no tier holds the chunk any more", key.hex(), tier.name)
        if tier.overwrites and not tier.shared:
            tier.delete(key)  # whatever older value it holds must not be served as the current one

    def _backing_off(self, rec: _Dirty, key: ChunkKey, level: int) -> bool:
        """Whether writes of ``key`` to ``level`` failed and the next retry is not due yet (lock held)."""
        return rec.pending.get(level, 0) > 0 and key in self._retry_at[level]

    # ------------------------------------------------------------------ eviction hook
    def before_evict(self, tier: Tier, key: ChunkKey) -> bool:
        """``tier`` is about to drop ``key``: write it below if it is dirty; ``False`` = keep it."""
        level = self.tiers.index(tier)
        if self._nothing_pending_below(key, level):
            return True  # a put that begins now waits for this eviction before it lands in this tier
        # under the key's claim even when this copy looks stale: a write of the current value may be landing
        # in this very tier right now (an eviction's write-down, not settled yet)
        if not self.try_claim(key):
            return False  # another write of this key is running: keep the copy, evict something else
        try:
            return self._save_victim(tier, key, level)
        finally:
            self.release(key)

    def _nothing_pending_below(self, key: ChunkKey, level: int) -> bool:
        with self._cond:
            rec = self._dirty.get(key)
            return rec is None or not any(j > level for j in rec.pending)


    def _save_victim(self, tier: Tier, key: ChunkKey, level: int) -> bool:
        if self._nothing_pending_below(key, level) or self.stale_at([key], level)[0]:
            return True  # clean below, or this copy is an older value anyway
        with self._cond:
            rec = self._dirty[key]
            gen = rec.gen
            targets = [j for j in sorted(rec.pending) if j > level and not self._backing_off(rec, key, j)]
        outcomes: list[tuple[int, bool]] = []
        with ExitStack() as stack:
            read: dict[bool, Chunk | None] = {}  # the victim as an object or as tensors, each read once
            for j in targets:
                as_object = _moves_objects(tier, self.tiers[j])
                if as_object not in read:
                    read[as_object] = tier.copy_encoded(key) if as_object else stack.enter_context(tier.borrowed(key))
                data = read[as_object]
                if data is None:
                    return True  # it vanished (or was damaged) meanwhile: nothing left to save
                try:
                    ok = _put_all(self.tiers[j], [(key, data)])[0]
                except Exception as exc:  # noqa: BLE001 - any failure: try the next tier, keep the victim
                    log.debug("write-back of %s to %s before eviction failed: %s", key.hex(), self.tiers[j].name, exc)
                    ok = False
                outcomes.append((j, ok))
                if ok:
                    break
        for j, ok in outcomes:  # once the victim's pin is gone: a flush this wakes sees no pin left behind
            self._settle(key, j, gen, ok)
        if outcomes and outcomes[-1][1]:
            return True
        with self._cond:
            rec = self._dirty[key]
            sources, pending = self._sources(rec, level), [j for j in rec.pending if j > level]
        # no write succeeded: drop it if another tier keeps the current value (and is not dropping it too)
        if any(self.tiers[i].holds(key) for i in sources):
            return True
        if self.on_pressure is Pressure.KEEP or any(self.tiers[j].holds(key) for j in pending):
            return False  # keep it (an older value below must never become the one a read finds)
        self._drop(key, gen, pending)
        return True

    def _drop(self, key: ChunkKey, gen: int, levels: list[int]) -> None:
        """The drop policy gives up generation ``gen`` of ``key`` for ``levels`` (its only copy is evicted)."""
        with self._cond:
            rec = self._dirty.get(key)
            if rec is None or rec.gen != gen:
                return
            for j in levels:
                rec.pending.pop(j, None)
                self._retry_at[j].pop(key, None)
                self._counts[j]["writeback_dropped"] += 1
                _remember(self._dropped, key, j)
            if not rec.pending:
                del self._dirty[key]
            self._cond.notify_all()
        log.debug("write-back of %s dropped under pressure (on_pressure: drop)", key.hex())

    # ------------------------------------------------------------------ flush, stats, stop
    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until every chunk put so far reached every tier below it, is failing there, or was dropped.

        Failing levels first get a fresh round of retries. Raises :class:`WriteBackError` naming the keys
        and tiers that could not be written (with ``dropped`` as in the report), :class:`TierTimeoutError`
        if ``timeout`` passed first. Levels given up and chunks dropped are named until the key is put again.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            watched: deque[tuple[ChunkKey, int, int]] = deque()  # what was put so far: (key, level, gen)
            for k, rec in self._dirty.items():
                for j, attempts in rec.pending.items():
                    watched.append((k, j, rec.gen))
                    if attempts >= self.fast_retries:
                        rec.pending[j] = 0
                        self._retry_at[j].pop(k, None)
                        self._ready[j][k] = None
            self._cond.notify_all()
            while watched:
                if self._settled(*watched[0]):
                    watched.popleft()
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TierTimeoutError(f"flush: {len(watched)} write-backs still pending after {timeout}s")
                self._cond.wait(remaining)
            failed = {k: set(js) for k, js in self._given_up.items()}
            dropped = dict(self._dropped)
            for k, rec in self._dirty.items():
                failing = {j for j, attempts in rec.pending.items() if attempts >= self.fast_retries}
                if failing:
                    failed.setdefault(k, set()).update(failing)
        report = FlushReport(self._named(dropped))
        if failed:
            raise WriteBackError(self._named(failed), report.dropped)
        return report

    def _named(self, levels: dict[ChunkKey, set[int]]) -> dict[ChunkKey, tuple[str, ...]]:
        return {k: tuple(self.tiers[j].name for j in sorted(js)) for k, js in levels.items()}

    def _settled(self, key: ChunkKey, level: int, gen: int) -> bool:
        """Whether the write of generation ``gen`` of ``key`` to ``level`` is over: written, superseded by
        a newer put, given up, or failing (lock held)."""
        rec = self._dirty.get(key)
        return rec is None or rec.gen != gen or rec.pending.get(level, self.fast_retries) >= self.fast_retries

    def stats(self) -> tuple[int, dict[int, dict[str, float]]]:
        """``(dirty keys, {level: writeback_pending/lag_s/done/failed/dropped})``; ``writeback_lag_s`` is the
        age of the oldest chunk still to be written to that level (0 when none is)."""
        now = time.monotonic()
        with self._cond:
            pending = dict.fromkeys(self._counts, 0)
            oldest = dict.fromkeys(self._counts, now)
            for r in self._dirty.values():
                for j in r.pending:
                    pending[j] += 1
                    oldest[j] = min(oldest[j], r.since)
            per_level = {j: {"writeback_pending": pending[j], "writeback_lag_s": now - oldest[j], **c}
                         for j, c in self._counts.items()}
            return len(self._dirty), per_level

    def stop(self, timeout: float) -> None:
        """Stop the writers (after their current batch), waiting up to ``timeout`` s in all."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
