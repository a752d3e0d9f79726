"""Promotion: the part of the data plane (:mod:`tierstore.transfers`) that copies chunks up to the top tier.

Jobs on a small pool, never on a reader's thread: the hits a read found below the top (``retain``),
``prefetch``, and the background promotion behind ``readiness``. A key being promoted is *pending* until its
job is done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from typing import Any

from . import objformat
from .backends.base import Chunk
from .errors import ClosedError
from .keys import ChunkKey
from .outcomes import Copied
from .transfers import Transfers

log = logging.getLogger("tierstore")

#: promotion jobs admitted after reads, queued or running, at most per worker (each holds what it read): a read
#: finding more below the top admits nothing more until some are done (counted as ``promotions_skipped``)
JOBS_PER_WORKER = 2


class Promoter:
    """Promotion jobs of one store: admission after a read (``retain``), ``prefetch`` and the background
    promotion behind ``readiness``; keys being promoted are *pending* until their job is done."""

    def __init__(self, transfers: Transfers, workers: int) -> None:
        self.t = transfers
        self.res = transfers.res
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tierstore-promote")
        self._lock = threading.Lock()
        self._in_flight: dict[ChunkKey, Future[Any]] = {}
        self.max_admitted = JOBS_PER_WORKER * workers
        self._admitted: dict[ChunkKey, int] = {}  # key -> admitted jobs holding it (queued or running)
        self._admitted_jobs = 0
        self.counts = {"promotions": 0, "promotions_skipped": 0, "prefetch_errors": 0}

    def admit(self, hits: list[tuple[ChunkKey, int, int, objformat.Encoded | None]]) -> None:
        """Promote ``(key, tier read from, generation, object in hand or None)`` in the background, each only
        if it is still the key's current value then. Bounded and deduplicated: a key already admitted is not
        admitted again, and nothing is when :attr:`max_admitted` jobs are queued or running or the top tier
        could only wait for room (its copies pinned): those reads just do not promote (counted)."""
        top = self.t.top
        if top is None:
            return
        size = min((1 if h[3] is None else h[3].size for h in hits), default=1)
        with self._lock:
            fresh = [h for h in hits if h[0] not in self._admitted]
            full = self._admitted_jobs >= self.max_admitted
            if not fresh or full:
                self.counts["promotions_skipped"] += len(hits)
                return
        if not self.res.could_take(top, size):
            with self._lock:
                self.counts["promotions_skipped"] += len(hits)
            return
        with self._lock:
            self._admitted_jobs += 1
            for h in fresh:
                self._admitted[h[0]] = self._admitted.get(h[0], 0) + 1
            self.counts["promotions_skipped"] += len(hits) - len(fresh)

        def job() -> list[bool]:
            try:
                return [self.promote(*h) for h in fresh]
            finally:
                self._admitted_done(fresh)

        try:
            self.t.jobs.submit(self._pool, "promote", self.t.tiers[top].name, len(fresh), job)
        except ClosedError:
            self._admitted_done(fresh)

    def _admitted_done(self, hits: list[tuple[ChunkKey, int, int, objformat.Encoded | None]]) -> None:
        with self._lock:
            self._admitted_jobs -= 1
            for h in hits:
                n = self._admitted[h[0]] - 1
                if n:
                    self._admitted[h[0]] = n
                else:
                    del self._admitted[h[0]]

    def promote(self, key: ChunkKey, source: int, gen: int, data: Chunk | None = None, *,
                raise_errors: bool = False) -> bool:
        """Copy generation ``gen`` of ``key`` from tier ``source`` into the top tier (re-reading it unless
        ``data`` is at hand) and have write-back fill the tiers between; whether the top holds it now.

        The source is read first (not pinned: its eviction may need the room this promotion makes), and the
        top's ``(key, tier)`` slot is taken only once the bytes are at hand: a put of the key never waits
        behind a promotion's read. A read error is logged and counted (``raise_errors``: also raised, for a
        caller that reports it)."""
        t, res, top = self.t, self.res, self.t.top
        if top is None or source <= top:
            return source == top
        with ExitStack() as stack:
            if data is None:
                if not res.holds_current(key, source, gen):
                    return res.current_gen(key, top) is not None
                got = t.read_copy(stack, source, key, top, raise_failed=raise_errors)
                if isinstance(got, Copied):
                    return False
                data = got
            if not res.begin_promote(key, source, gen, top):
                # another write into the top may be landing this very value (a read's promotion): its outcome
                # counts
                res.wait_until(lambda: None if res.writing(key, top) else True, time.monotonic() + self.t.pin_wait)
                return res.current_gen(key, top) is not None
            (ok,) = t.land_many(top, [(key, gen, data)], slots_held=True, kind="promote")
        if ok:
            res.fill(key, gen, [j for j in range(top + 1, source) if t.tiers[j].writable])
            with self._lock:
                self.counts["promotions"] += 1
        return bool(ok)

    def promote_current(self, key: ChunkKey) -> bool:
        """Copy ``key``'s current value toward the top from wherever it is (indexed, or found on a shared tier
        now); whether the top holds it then."""
        t, res = self.t, self.res
        (tier,) = res.locate([key])
        if tier is None:
            token = res.deletes
            for tr in t.tiers:
                if tr.shared and tr.index in res.probe_tiers(key):
                    (size,) = tr.backend.stat_many([key])
                    if size is not None and res.found(tr.index, key, size, token) is not None:
                        tier = tr.index
                        break
        gen = None if tier is None else res.current_gen(key, tier)
        return tier is not None and gen is not None and self.promote(key, tier, gen, raise_errors=True)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Promote ``keys`` in the background; the future resolves to how many the top tier then holds (or
        raises the first error once every key is done)."""
        done: Future[int] = Future()
        if not keys:
            done.set_result(0)
            return done
        remaining, held, errors, lock = [len(keys)], [0], [], threading.Lock()

        def finished(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                with self._lock:
                    self.counts["prefetch_errors"] += 1
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

        name = self.t.tiers[self.t.top].name if self.t.top is not None else ""
        for k in keys:
            self.t.jobs.submit(self._pool, "prefetch", name, 1, partial(self.promote_current, k)
                               ).add_done_callback(finished)
        return done

    def promote_shared(self, keys: Sequence[ChunkKey], lookup: Callable[[Sequence[ChunkKey]], int]) -> None:
        """In the background: find the leading run of ``keys`` the tiers hold (``lookup``, which probes the
        shared ones) and promote it. The keys count as pending from now until that is done."""
        future: Future[int] = Future()
        with self._lock:
            if keys[0] in self._in_flight:
                return
            for k in keys:
                self._in_flight.setdefault(k, future)

        def job() -> int:
            try:
                run = lookup(keys)
                self._landed(keys[run:], future)  # what the probe did not find is not on its way
                got = sum(self.promote_current(k) for k in keys[:run])
                future.set_result(got)
                return got
            except BaseException as exc:
                future.set_exception(exc)
                raise
            finally:
                self._landed(keys, future)

        name = self.t.tiers[self.t.top].name if self.t.top is not None else ""
        try:
            self.t.jobs.submit(self._pool, "prefetch", name, len(keys), job)
        except ClosedError:
            self._landed(keys, future)
            raise

    def _landed(self, keys: Sequence[ChunkKey], job: Future[int]) -> None:
        with self._lock:
            for k in keys:
                if self._in_flight.get(k) is job:
                    del self._in_flight[k]

    def pending(self, keys: Sequence[ChunkKey]) -> int:
        """Length of the leading run of ``keys`` being promoted now."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._in_flight:
                n += 1
            return n

    def wait(self, deadline: float | None) -> None:
        """Wait (until ``deadline``, ``time.monotonic``) for the promotion jobs running or queued now."""
        for job in self.t.jobs.running():
            if job.kind in ("promote", "prefetch") and job.future is not None:
                try:
                    job.future.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a timeout: the flush's own deadline decides
                    return

    def stop(self, deadline: float) -> None:
        """Cancel queued jobs and wait (until ``deadline``) for the running ones: they write into the tiers
        close() is about to shut."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.wait(deadline)
