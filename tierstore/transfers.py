"""Transfers: the data plane of a store — every move of bytes between the caller and a tier, or between two
tiers, carried out as the control plane (:mod:`tierstore.residency`) plans it.

Each transfer is a :class:`Job` with an id and a future (``store.stats()["jobs"]`` lists those running):

* **reads** (``read``): a batch grouped by the tier holding each key, each group one batched read of its
  backend; a key a tier no longer has (or cannot read) goes on to the next tier holding it, and a key no
  index knows is asked of the shared tiers (a probe, or a read that is its own probe). Run on the caller's
  thread: the bytes are in the caller's hands when it returns.
* **landing** (:meth:`Transfers.land_many`): a write into one tier — for a put, a write-back, a promotion or
  an eviction's write-down — under the ``(key, tier)`` slot: room is reserved first, victims evicted
  synchronously (a dirty one written to the tier below first), then one batched write and the commit.
* **write-back** (:mod:`tierstore.writeback`): a scheduler thread takes what is due per tier and hands each
  batch to that tier's writer thread; a batch reads its sources (an object's bytes as they are between
  backends of the same codec) and lands them.
* **promotion** (:mod:`tierstore.promotion`): after a read found chunks below the top (``retain``), and for
  ``prefetch`` and ``readiness``, jobs on a small pool copy them up — never on the reader's thread.

No lock is held across I/O; what waits (a busy slot, room) waits on the residency's condition.
"""

from __future__ import annotations

import errno
import itertools
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from time import perf_counter
from typing import Any, TypeVar, cast

import torch

from . import objformat
from .backends.base import Backend, Chunk, Hit, ReadResult
from .errors import (
    ClosedError,
    CorruptObjectError,
    ForgedObjectError,
    InvalidInputError,
    UnsupportedObjectError,
)
from .keys import ChunkKey
from .outcomes import Copied, Eviction
from .residency import Hold, Residency, Slot, TierSpec, Victim
from .telemetry import Failures, Latency
from .tensors import TensorDict

log = logging.getLogger("tierstore")
T = TypeVar("T")

COUNTERS = ("hits", "misses", "puts", "bytes_in", "bytes_out", "corrupt", "unsupported", "forged", "errors",
            "skipped", "enospc")
#: seconds a write waits for its slot or for room (pins released, others' evictions and writes finished)
PIN_WAIT = 2.0
#: extra eviction rounds when a memory pool has the bytes but no contiguous run for a chunk
ENOMEM_ROUNDS = 4


class Tier:
    """One tier of a store as the data plane sees it: its backend and what it counts, and (``spec``) the
    description the control plane is given."""

    def __init__(self, index: int, name: str, kind: str, backend: Backend, capacity: int | None) -> None:
        self.index = index
        self.name = name
        self.kind = kind
        self.backend = backend
        self.capacity = capacity
        self.caps = backend.capabilities
        self.spec = TierSpec(name, capacity, self.caps.writable, self.caps.shared)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.failures = Failures(log, f"tier {name}: ")
        self.latency = Latency()  #: seconds per batched get, put and lookup (probe) of this tier
        self._lock = threading.Lock()

    @property
    def shared(self) -> bool:
        return self.caps.shared

    @property
    def writable(self) -> bool:
        return self.caps.writable

    def count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self.counts)
        backend = self.backend.stats()
        failures = self.failures.counts()
        for reason, n in backend.pop("failures", {}).items():
            failures[reason] = failures.get(reason, 0) + n
        return {"kind": self.kind, **counts, **backend, "failures": failures}

    def __repr__(self) -> str:
        return f"<Tier {self.index} {self.name!r} {self.kind}>"


# ---------------------------------------------------------------------- jobs
class Job:
    """One transfer: what it does, where, and — when it runs on a pool, where someone may wait for it — its
    future (done when the transfer is). A transfer run on the caller's thread has none: nobody else waits."""

    __slots__ = ("future", "id", "keys", "kind", "started", "tier")

    def __init__(self, id: int, kind: str, tier: str, keys: int, future: Future[Any] | None = None) -> None:  # noqa: A002
        self.id = id
        self.kind = kind  # "read" | "put" | "write-back" | "write-down" | "promote" | "prefetch" | "probe"
        self.tier = tier
        self.keys = keys
        self.future = future
        self.started = time.monotonic()


class Jobs:
    """The transfers running now (ids, kinds, futures), for ``stats()`` and for ``close()`` to wait on."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._running: dict[int, Job] = {}
        self.done = 0

    def run(self, kind: str, tier: str, keys: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this thread as a job (listed while it runs; no future: the caller has the result)."""
        job = Job(next(self._ids), kind, tier, keys)
        running = self._running
        with self._lock:
            running[job.id] = job
        try:
            return fn()
        finally:
            with self._lock:
                del running[job.id]
                self.done += 1

    def submit(self, executor: ThreadPoolExecutor, kind: str, tier: str, keys: int, fn: Callable[[], Any]
               ) -> Future[Any]:
        """Run ``fn`` on ``executor`` as a job; its future. Raises :class:`ClosedError` if the executor was shut
        down."""
        job = self._start(kind, tier, keys)

        def body() -> None:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                self._finish(job, exc=exc)
                return
            self._finish(job, result=result)

        try:
            queued = executor.submit(body)
        except RuntimeError:  # shut down by a racing close()
            self._finish(job, exc=ClosedError("store is closed"))
            raise ClosedError("store is closed") from None
        queued.add_done_callback(partial(self._cancelled, job))
        assert job.future is not None
        return job.future

    def _cancelled(self, job: Job, queued: Future[None]) -> None:
        """A job that close() took off its executor's queue before it ran ends with :class:`ClosedError`."""
        if queued.cancelled():
            self._finish(job, exc=ClosedError("store is closed"))

    def _start(self, kind: str, tier: str, keys: int) -> Job:
        job = Job(next(self._ids), kind, tier, keys, Future())
        with self._lock:
            self._running[job.id] = job
        return job

    def _finish(self, job: Job, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._running.pop(job.id, None)
            self.done += 1
        assert job.future is not None
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def running(self) -> list[Job]:
        with self._lock:
            return list(self._running.values())

    def summary(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            running = [{"id": j.id, "kind": j.kind, "level": j.tier,  # ("level": the stats key as published)
                         "keys": j.keys, "age_s": now - j.started}
                       for j in self._running.values()]
            return {"running": running, "done": self.done}


# ---------------------------------------------------------------------- the data plane
class Transfers:
    """Reads, landings and evictions of one store (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier], residency: Residency, pin_wait: float = PIN_WAIT) -> None:
        self.tiers = list(tiers)
        self.res = residency
        self.pin_wait = pin_wait
        self.jobs = Jobs()
        self.top = next((tr.index for tr in self.tiers if tr.writable), None)

    # ------------------------------------------------------------------ landing
    def land_many(self, tier: int, items: Sequence[tuple[ChunkKey, int, Chunk]], *, put: bool = False,
                  queue: bool = True, slots_held: bool = False, kind: str = "put") -> list[bool | None]:
        """Write each ``(key, generation, chunk)`` into ``tier``: per item ``True`` (stored), ``None``
        (superseded: a newer value is there or was put, nothing to write) or ``False`` (refused: too big, no room
        in time, a write error; counted). ``slots_held``: the caller took the slots (write-back, promotion)."""
        if not items:
            return []
        tr = self.tiers[tier]
        start = perf_counter()
        try:
            return self.jobs.run(kind, tr.name, len(items),
                                 lambda: self._land(tr, items, put=put, queue_below=queue, slots_held=slots_held))
        finally:
            tr.latency.since("put", start)

    def _land(self, tr: Tier, items: Sequence[tuple[ChunkKey, int, Chunk]], *, put: bool, queue_below: bool,
              slots_held: bool) -> list[bool | None]:
        deadline = time.monotonic() + self.pin_wait
        outcome: list[bool | None] = [False] * len(items)
        if slots_held:
            self._land_held(tr, items, list(range(len(items))), outcome, put, queue_below, deadline)
            return outcome
        # take the slots that are free now and land those items; wait for a busy one only while holding none
        # (two batches waiting for each other's slots would deadlock), then try the rest again
        todo = list(range(len(items)))
        while todo:
            held, busy = [], []
            for i in todo:
                status = self.res.begin_write(items[i][0], tr.index, items[i][1])
                if status is Slot.OK:
                    held.append(i)
                elif status is Slot.BUSY:
                    busy.append(i)
                else:
                    outcome[i] = None
            if not held and busy:
                i = busy.pop(0)
                slot = self._take_slot(items[i][0], tr.index, items[i][1], deadline)
                if slot is Slot.OK:
                    held.append(i)
                elif slot is Slot.SUPERSEDED:
                    outcome[i] = None
                else:  # the slot stayed busy: a write_through put's pending tier is retried by write-back
                    tr.count(skipped=1)
                    self.abort(tr.index, items[i][0], items[i][1])
            self._land_held(tr, items, held, outcome, put, queue_below, deadline)
            todo = busy
        return outcome

    def _land_held(self, tr: Tier, items: Sequence[tuple[ChunkKey, int, Chunk]], todo: list[int],
                   outcome: list[bool | None], put: bool, queue_below: bool, deadline: float) -> None:
        """Land ``items[i]`` for each ``i`` in ``todo`` (their slots held) into ``tr``, setting ``outcome[i]``."""
        res, tier = self.res, tr.index
        if res.space_probe_due(tier):  # full after ENOSPC: is there room again?
            res.space_probed(tier, tr.backend.free_space())
        prepared: dict[int, Any] = {}
        for i in todo:
            key, gen, chunk = items[i]
            try:
                prepared[i] = tr.backend.prepare(key, chunk)
            except Exception as exc:  # noqa: BLE001 - an item the backend cannot take: refused, counted
                tr.count(errors=1)
                tr.failures.report("prepare", "cannot store %s: %s: %s", key.hex(), type(exc).__name__, exc)
                self.abort(tier, key, gen)
        queue = deque(i for i in todo if i in prepared)
        retries: dict[int, int] = {}
        while queue:
            # reserve what fits now; a chunk that must wait goes after what is reserved is written and indexed
            # (its bytes may be what there is to evict)
            wave: list[int] = []
            reserved: dict[int, int] = {}
            while queue:
                i = queue[0]
                got = self.make_room(items[i][0], tier, prepared[i].size, deadline, wait=not wave)
                if got is None and wave:
                    break
                queue.popleft()
                if got is None:
                    tr.count(skipped=1)
                    self.abort(tier, items[i][0], items[i][1])
                    continue
                wave.append(i)
                reserved[i] = got
            if not wave:
                continue
            try:
                errors = tr.backend.write_many([(items[i][0], prepared[i]) for i in wave])
            except ClosedError:
                errors = [ClosedError(f"tier {tr.name!r} is closed")] * len(wave)
            except Exception as exc:  # noqa: BLE001 - a backend that raised for the batch: every item failed
                errors = [exc] * len(wave)
            for i, err in zip(wave, errors, strict=True):
                key, gen, _ = items[i]
                if err is None:
                    stale = res.commit_write(key, tier, gen, prepared[i].size, reserved[i], put=put, queue=queue_below)
                    tr.count(puts=1, bytes_in=prepared[i].size)
                    outcome[i] = True
                    self.remove_stale(key, stale)
                    continue
                res.release(tier, reserved[i])
                tries = retries[i] = retries.get(i, 0) + 1
                if isinstance(err, OSError) and err.errno == errno.ENOSPC and tries == 1:
                    self._after_enospc(tr)
                    queue.appendleft(i)
                elif isinstance(err, OSError) and err.errno == errno.ENOMEM and tries <= ENOMEM_ROUNDS:
                    for victim in res.reclaim(key, tier, prepared[i].size):
                        self.evict(victim, deadline)
                    queue.appendleft(i)
                else:
                    tr.count(errors=1)
                    tr.failures.report("write", "write failed (%s: %s); skipping", type(err).__name__, err)
                    self.abort(tier, key, gen)
        if any(outcome[i] for i in todo):
            res.space_stored(tier)

    def abort(self, tier: int, key: ChunkKey, gen: int, reserved: int = 0) -> None:
        """A write of ``gen`` into ``tier`` stored nothing: release its slot and bytes; a pending tier's write
        counts as failed (retried with back-off; logged once it keeps failing)."""
        if self.res.abort_write(key, tier, gen, reserved, failed=True):
            log.warning("write-back to tier %s keeps failing (e.g. %s); retrying while the chunks are held",
                        self.tiers[tier].name, key.hex())

    def _take_slot(self, key: ChunkKey, tier: int, gen: int, deadline: float) -> Slot | None:
        res = self.res
        return res.wait_until(lambda: s if (s := res.begin_write(key, tier, gen)) is not Slot.BUSY else None,
                              deadline)

    def make_room(self, key: ChunkKey, tier: int, size: int, deadline: float, wait: bool = True,
                  clean: bool = False) -> int | None:
        """Reserve ``size`` bytes of ``tier`` for ``key``, evicting as the residency says; ``None`` when there
        is no room (with ``wait``: by ``deadline``, while others free room or readers hold pins). ``clean``:
        from free room and clean victims only (no write below, no waiting: see
        :meth:`~tierstore.residency.Residency.reserve`), ``None`` as soon as a round frees nothing."""
        res = self.res
        while True:
            if wait:
                room = res.wait_until(lambda: r if ((r := res.reserve(key, tier, size, clean)).reserved is not None
                                                    or r.victims or not r.wait) else None, deadline)
            else:
                room = res.reserve(key, tier, size, clean)
            if room is None or (room.reserved is None and not room.victims):
                return None
            if room.reserved is not None:
                return room.reserved
            # a victim that fails is set aside (the next reserve names another, or none); the deadline bounds
            # the rounds even so
            gone = [self.evict(victim, deadline) for victim in room.victims]
            if Eviction.REMOVED not in gone and (clean or time.monotonic() >= deadline):
                return None

    def _after_enospc(self, tr: Tier) -> None:
        """The storage is full below the tier's budget: hold at most what it holds now."""
        tr.count(enospc=1)
        backoff = self.res.space_full(tr.index)
        tr.failures.report("enospc", "no space left on device; holding at most what is held now, re-probing "
                           "free space in %.1fs (doubling while full)", backoff)

    def remove_stale(self, key: ChunkKey, tiers: Iterable[int]) -> None:
        """Remove ``key``'s copies in ``tiers`` that hold an older value than the current one."""
        for j in tiers:
            if self.res.claim_stale(key, j):
                self._remove(key, j)

    def _remove(self, key: ChunkKey, tier: int, damaged: bool = False) -> None:
        """Remove ``key`` from ``tier``'s storage (the caller holds the slot for it), then from the index. A
        ``damaged`` copy leaves the index even when its removal fails: it is never served (a restart that finds
        it fails its check again), whereas an older value that stays in storage stays indexed and reported."""
        tr = self.tiers[tier]
        (err,) = tr.backend.delete_many([key])
        if err is not None and not isinstance(err, FileNotFoundError):
            tr.failures.report("drop", "could not remove %s (%s): %s", key.hex(),
                               "forgotten: damaged" if damaged else "kept, reported", err)
            if not damaged:
                self.res.removal_failed(tier, key)
                return
        self.res.removed(tier, key)

    # ------------------------------------------------------------------ eviction
    def evict(self, victim: Victim, deadline: float) -> Eviction:
        """Carry out one eviction: write a dirty victim below first (trying each tier the residency names),
        then remove it unless it must stay. A victim that cannot be read to save it, or cannot be removed, is
        set aside (:meth:`~tierstore.residency.Residency.set_aside`): never removed unsaved, never named again
        at once. A copy that stays and meanwhile became an older value (a put landed elsewhere while this
        eviction held it, so the put could not remove it) is removed now, or reported by flush if it cannot be."""
        outcome = self._evict(victim, deadline)
        if outcome is not Eviction.REMOVED:
            self.remove_stale(victim.key, [victim.tier])
        return outcome

    def _evict(self, victim: Victim, deadline: float) -> Eviction:
        down, tried = victim.down, []
        try:
            while isinstance(down, int) and down is not False:
                copied = self.jobs.run("write-down", self.tiers[down].name, 1,
                                       partial(self._write_down, victim, down))
                if copied is Copied.FAILED:  # its own copy could not be read: it stays, set aside
                    self.res.set_aside(victim)
                    return Eviction.FAILED
                if copied is not Copied.REFUSED:
                    break
                tried.append(down)
                down = self.res.written_down_failed(victim, tried)
        except BaseException:
            self.res.keep(victim)
            raise
        if down is False:
            self.res.keep(victim)
            return Eviction.KEPT
        if not self.res.may_evict(victim):
            return Eviction.KEPT
        tr = self.tiers[victim.tier]
        (err,) = tr.backend.delete_many([victim.key])
        if err is not None and not isinstance(err, FileNotFoundError):
            tr.failures.report("drop", "could not remove %s (set aside): %s", victim.key.hex(), err)
            self.res.set_aside(victim)
            return Eviction.FAILED
        self.res.evicted(victim)
        return Eviction.REMOVED

    def _write_down(self, victim: Victim, down: int) -> Copied:
        """Copy a dirty victim into tier ``down`` (see :class:`~tierstore.outcomes.Copied`)."""
        slot = self.res.begin_write(victim.key, down, victim.gen)
        if slot is not Slot.OK:
            # a newer value is below: this copy is not the one to save; busy: try the next tier
            return Copied.SAVED if slot is Slot.SUPERSEDED else Copied.REFUSED
        with ExitStack() as stack:
            data = self.read_copy(stack, victim.tier, victim.key, down)
            if not isinstance(data, Copied):
                (ok,) = self.land_many(down, [(victim.key, victim.gen, data)], slots_held=True, kind="write-down")
                return Copied.REFUSED if ok is False else Copied.SAVED
        self.res.abort_write(victim.key, down, victim.gen)
        return data  # GONE: it vanished or is damaged, nothing left to save (pending tiers are given up)

    def read_copy(self, stack: ExitStack, source: int, key: ChunkKey, target: int, *,
                  raise_failed: bool = False) -> Chunk | Copied:
        """:meth:`read_for_copy` with its outcome made explicit: the chunk, ``Copied.GONE`` (missing or
        damaged: nothing to save) or ``Copied.FAILED`` (an I/O error, no memory, a closed tier: it is there but
        could not be read now; logged and counted, and raised with ``raise_failed``)."""
        tr = self.tiers[source]
        try:
            data = self.read_for_copy(stack, source, key, target)
        except (FileNotFoundError, CorruptObjectError, UnsupportedObjectError) as exc:
            log.debug("copy of %s in tier %s is unusable (%s)", key.hex(), tr.name, exc)
            return Copied.GONE
        except Exception as exc:  # noqa: BLE001 - a read error: the copy stays
            tr.count(errors=1)
            tr.failures.report("read", "reading %s to copy it failed (%s: %s); it stays", key.hex(),
                               type(exc).__name__, exc)
            if raise_failed:
                raise
            return Copied.FAILED
        return Copied.GONE if data is None else data

    def read_for_copy(self, stack: ExitStack, source: int, key: ChunkKey, target: int) -> Chunk | None:
        """``key``'s chunk in ``source``, to be written into ``target``: its object as it is when both hold
        objects with one codec (no decode, no re-encode), else its tensors (a memory backend lends its own for
        the life of ``stack``). ``None`` if it is gone; raises if it cannot be read."""
        src = self.tiers[source]
        if self.moves_objects(source, target):
            (got,) = src.backend.read_objects([key])
        elif src.caps.zero_copy:
            tensors = stack.enter_context(src.backend.borrow(key))
            got = None if tensors is None else Hit(tensors, 0)
        else:
            (got,) = src.backend.read_many([key])
        if isinstance(got, BaseException):
            raise got
        if got is None:
            return None
        if got.size:
            src.count(bytes_out=got.size)
        return got.value  # type: ignore[no-any-return]

    def moves_objects(self, source: int, target: int) -> bool:
        """Whether a copy from ``source`` into ``target`` moves the object as it is (both hold objects of one
        codec: no decode, no re-encode)."""
        src, dst = self.tiers[source].caps, self.tiers[target].caps
        return src.objects and dst.objects and src.codec == dst.codec

    def read_objects_for_copy(self, source: int, keys: Sequence[ChunkKey]) -> list[Chunk | BaseException | None]:
        """:meth:`read_for_copy` of many keys as one batched read of ``source``'s objects (where
        :meth:`moves_objects`): per key its object, ``None`` if gone, or the error reading it."""
        src = self.tiers[source]
        try:
            got = src.backend.read_objects(keys)
        except Exception as exc:  # noqa: BLE001 - the batch failed (a closed tier too): each item's error
            return [exc] * len(keys)
        out: list[Chunk | BaseException | None] = []
        for r in got:
            if isinstance(r, Hit):
                if r.size:
                    src.count(bytes_out=r.size)
                out.append(r.value)
            else:
                out.append(r)
        return out

    # ------------------------------------------------------------------ reads
    def read(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]] | None,
             device: str | torch.device, *, objects_from: Iterable[int] = ()
             ) -> tuple[list[Any], list[tuple[int, int] | None]]:
        """Each key's chunk from the highest tier holding its current value (see the module docstring).

        Returns per key its value (tensors, its filled ``out``, ``None`` for a miss, or the
        :class:`InvalidInputError` its ``out`` raised) and ``(tier, generation)`` it was read from. Tiers in
        ``objects_from`` are read as objects and decoded here, so the object stays at hand for a promotion:
        such values are ``(tensors, Encoded)`` pairs."""
        return self.jobs.run("read", "", len(keys), lambda: self._read(keys, outs, device, set(objects_from)))

    def _read(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]] | None,
              device: str | torch.device, as_objects: set[int]) -> tuple[list[Any], list[tuple[int, int] | None]]:
        res = self.res
        n = len(keys)
        results: list[Any] = [None] * n
        source: list[tuple[int, int] | None] = [None] * n
        skip: dict[int, set[int]] = {}  # key index -> tiers that could not serve it (or were read unindexed)
        probed: dict[int, set[int]] = {}  # key index -> shared tiers already asked about it
        todo = list(range(n))
        while todo:
            holds = self._pin(keys, todo, skip)
            again: list[int] = []
            try:
                tier = _one_tier(holds) if len(todo) == n else None
                if tier is not None:  # the common case: the whole batch at one tier, read as it came
                    by_tier = {tier: todo}
                else:
                    by_tier = {}
                    for i in todo:
                        h = holds[i]
                        if h is not None:
                            by_tier.setdefault(h.tier, []).append(i)
                for tier, idx in by_tier.items():
                    whole = len(idx) == n
                    got = self._read_tier(tier, keys if whole else [keys[i] for i in idx],
                                           outs if whole or outs is None else [outs[i] for i in idx], device,
                                           tier in as_objects)
                    self._classify(tier, idx, got, holds, keys, results, source, skip, again)
            finally:
                res.unpin(holds)
            unseen = [i for i in todo if holds[i] is None]
            again += self._ask_shared(unseen, keys, outs, device, as_objects, results, source, skip, probed)
            todo = again
        return results, source

    def _classify(self, tier: int, idx: list[int], got: list[ReadResult], holds: list[Hold | None],
                  keys: Sequence[ChunkKey], results: list[Any], source: list[tuple[int, int] | None],
                  skip: dict[int, set[int]], again: list[int]) -> None:
        """Take in ``got``, what ``tier`` returned for the keys at ``idx``: hits into ``results`` and
        ``source``; a key to read again from a lower tier into ``again`` (and that tier into ``skip``)."""
        if len(idx) == len(results) and set(map(type, got)) == {Hit}:  # the whole batch hit: filled in C
            found, pinned = cast(list[Hit], got), cast(list[Hold], holds)
            results[:] = map(_VALUE, found)
            source[:] = zip(itertools.repeat(tier), map(_GEN, pinned))
            self.tiers[tier].count(hits=len(found), bytes_out=sum(map(_SIZE, found)))
            return
        hits = read = 0
        for i, r in zip(idx, got, strict=True):
            h = holds[i]
            assert h is not None
            if type(r) is Hit:  # the common case, counted once below
                results[i] = r.value
                source[i] = (tier, h.gen)
                hits += 1
                read += r.size
            elif not self._settle(i, tier, h.gen, keys[i], r, results, source):
                skip.setdefault(i, set()).add(tier)
                again.append(i)
        if hits:
            self.tiers[tier].count(hits=hits, bytes_out=read)

    def _pin(self, keys: Sequence[ChunkKey], todo: list[int], skip: dict[int, set[int]]) -> list[Hold | None]:
        """Pin each of ``todo``'s keys at the first tier holding its current value, past the tiers ``skip``
        names for it."""
        if not skip and len(todo) == len(keys):  # the first pass over the whole batch
            return self.res.pin(keys)
        holds: list[Hold | None] = [None] * len(keys)
        plain = [i for i in todo if i not in skip]
        for i, h in zip(plain, self.res.pin([keys[i] for i in plain]), strict=True):
            holds[i] = h
        for i in todo:
            if i in skip:
                holds[i] = self.res.pin([keys[i]], [j for j in range(len(self.tiers)) if j not in skip[i]])[0]
        return holds

    def _read_tier(self, tier: int, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]] | None,
                    device: str | torch.device, as_objects: bool) -> list[ReadResult]:
        tr = self.tiers[tier]
        start = perf_counter()
        try:
            if as_objects:
                return [_decoded(r, None if outs is None else outs[i], device)
                        for i, r in enumerate(tr.backend.read_objects(keys))]
            if outs is None:
                return tr.backend.read_many(keys, device)
            return tr.backend.read_into_many(keys, outs)
        except ClosedError:
            raise
        except Exception as exc:  # noqa: BLE001 - a backend that failed the whole batch: each item a miss
            tr.failures.report("read", "batched read failed (%s: %s); treating as misses", type(exc).__name__, exc)
            return [exc] * len(keys)
        finally:
            tr.latency.since("get", start)

    def _ask_shared(self, unseen: list[int], keys: Sequence[ChunkKey], outs: Any, device: str | torch.device,
                    as_objects: set[int], results: list[Any], source: list[tuple[int, int] | None],
                    skip: dict[int, set[int]], probed: dict[int, set[int]]) -> list[int]:
        """Ask the shared tiers, in order, about keys no index holds: a read that is its own probe (a hit joins
        the index), or a probe that indexes what it finds. Returns the keys a probe indexed (to be read)."""
        res = self.res
        token = res.deletes
        todo, indexed = list(unseen), []
        for tr in self.tiers:
            if not todo:
                break
            if not tr.shared:
                continue
            ask = [i for i in todo if tr.index not in probed.get(i, ()) and tr.index not in skip.get(i, ())
                   and tr.index in res.probe_tiers(keys[i])]
            for i in ask:
                probed.setdefault(i, set()).add(tr.index)
            if not ask:
                continue
            if not tr.caps.probe_on_read:
                start = perf_counter()
                sizes = tr.backend.stat_many([keys[i] for i in ask])
                tr.latency.since("lookup", start)
                for i, size in zip(ask, sizes, strict=True):
                    if size is not None and res.found(tr.index, keys[i], size, token) is not None:
                        indexed.append(i)
                todo = [i for i in todo if i not in indexed]
                continue
            got = self._read_tier(tr.index, [keys[i] for i in ask], None if outs is None else
                                   [outs[i] for i in ask], device, tr.index in as_objects)
            done = set()
            for i, r in zip(ask, got, strict=True):
                gen = res.found(tr.index, keys[i], r.size, token) if isinstance(r, Hit) else 0
                if self._settle(i, tr.index, -1 if gen is None else gen, keys[i], r, results, source):
                    done.add(i)
            todo = [i for i in todo if i not in done]
        return indexed

    def _settle(self, i: int, tier: int, gen: int, key: ChunkKey, r: ReadResult, results: list[Any],
                source: list[tuple[int, int] | None]) -> bool:
        """Classify one read of ``key``'s copy of generation ``gen`` (``-1``: read but not indexed) from
        ``tier``; whether the key is done (a hit, or an ``out`` that does not fit)."""
        tr = self.tiers[tier]
        if isinstance(r, Hit):
            results[i] = r.value
            source[i] = (tier, gen)
            tr.count(hits=1, bytes_out=r.size)
            return True
        if isinstance(r, InvalidInputError):  # the caller's out does not fit the chunk: its answer
            results[i] = r
            return True
        if r is None or isinstance(r, FileNotFoundError):
            self.res.lost(tier, key, gen, remove=False)
            tr.count(misses=1)
            return False
        if isinstance(r, ForgedObjectError):
            tr.count(forged=1)
            tr.failures.report("forged", "refusing object %s (left in place): %s", key.hex(), r)
            self.res.lost(tier, key, gen, remove=False)
        elif isinstance(r, UnsupportedObjectError):
            tr.count(unsupported=1)
            tr.failures.report("unsupported", "cannot read object %s (left in place): %s", key.hex(), r)
            if tr.shared:  # a private tier keeps it indexed: its bytes stay accounted for until evicted
                self.res.lost(tier, key, gen, remove=False)
        elif isinstance(r, CorruptObjectError):
            tr.count(corrupt=1)
            remove = not tr.shared
            tr.failures.report("corrupt", "%s damaged object %s: %s", "removing" if remove else "skipping",
                               key.hex(), r)
            if self.res.lost(tier, key, gen, remove=remove):
                self._remove(key, tier, damaged=True)
        elif isinstance(r, ClosedError):
            raise r
        else:  # an I/O error, or an object too large for memory right now: a miss, kept
            tr.count(errors=1)
            tr.failures.report("read", "read failed (%s: %s); treating as a miss", type(r).__name__, r)
        tr.count(misses=1)
        return False


# fields read in C over a whole batch: a Hit's value and size, a Hold's tier and generation
_VALUE, _SIZE = operator.itemgetter(0), operator.itemgetter(1)
_TIER, _GEN = operator.itemgetter(1), operator.itemgetter(3)


def _one_tier(holds: list[Hold | None]) -> int | None:
    """The tier every hold is at, if all are at one (``None`` if some key has none, or they differ)."""
    try:
        tiers = set(map(_TIER, holds))  # type: ignore[arg-type]  # a None raises
    except TypeError:
        return None
    return tiers.pop() if len(tiers) == 1 else None


def _decoded(r: ReadResult, out: Mapping[str, torch.Tensor] | None, device: str | torch.device) -> ReadResult:
    """An object read turned into what the caller asked for, the object kept: ``Hit((value, Encoded), size)``."""
    if not isinstance(r, Hit):
        return r
    from .tensors import fill_out

    try:
        tensors = objformat.decode_encoded(r.value)
        if out is not None:
            value: TensorDict = fill_out(out, tensors)
        else:
            dev = torch.device(device)
            value = tensors if dev.type == "cpu" else {n: t.to(dev) for n, t in tensors.items()}
    except Exception as exc:  # noqa: BLE001 - the item's result
        return exc
    return Hit((value, r.value), r.size)
