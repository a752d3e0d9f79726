"""Promotion: copying chunks toward the top tier, off the reader's critical path where it can be.

* **Admission** (``retain``): a read that found chunks below the top hands them to :meth:`Promoter.admit`
  once they are in the caller's hands. Each key is admitted under its claim and only if no put or delete of
  it ended since the read began (:meth:`WriteBack.changed_since`); claims are tried, never waited for, so a
  busy key is simply not admitted. The top tier gets the value in one batched put (a memcpy for memory
  tiers); the tiers between the top and the tier that served it are filled by write-back, in the
  background, as for a put.
* **Prefetch** and **readiness**: :meth:`Promoter.prefetch` promotes keys on a bounded pool of jobs;
  :meth:`Promoter.promote_shared` probes the shared tiers for a run of keys and promotes what they hold,
  in the background. Keys being promoted are *pending* until their job is done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from .errors import ClosedError
from .keys import ChunkKey
from .tensors import TensorDict

if TYPE_CHECKING:
    from .tiers import Tier
    from .writeback import WriteBack

log = logging.getLogger("tierstore")


class Promoter:
    """Admission, prefetch jobs and the keys they have in flight, for one store."""

    def __init__(self, tiers: Sequence[Tier], wb: WriteBack, max_in_flight: int,
                 guard: Callable[[], AbstractContextManager[None]]) -> None:
        self.tiers = list(tiers)
        self._wb = wb
        self._guard = guard  # the store's lifecycle guard (a context manager factory) for each job
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="tierstore-promote")
        self._lock = threading.Lock()
        self._in_flight: dict[ChunkKey, Future[int]] = {}
        self.counts = {"promotions": 0, "prefetch_errors": 0}

    # ------------------------------------------------------------------ admission after a read
    def admit(self, hits: dict[ChunkKey, tuple[int, TensorDict]], token: int) -> None:
        """Admit ``{key: (level it was read from, value)}`` into the writable tiers above that level."""
        wb = self._wb
        claimed = [k for k in hits if wb.try_claim(k)]
        try:
            fresh = [k for k in claimed if not wb.changed_since(k, token)
                     and hits[k][0] not in wb.stale_levels(k)]
            top = next((j for j, t in enumerate(self.tiers) if not t.read_only), None)
            todo = [k for k in fresh if top is not None and top < hits[k][0]]
            if not todo:
                return
            assert top is not None
            stored = self.tiers[top].put_many([(k, hits[k][1]) for k in todo])
            for k, ok in zip(todo, stored, strict=True):
                if ok:
                    wb.mark_written(k, top)
                    wb.request_fill(k, [j for j in range(top + 1, hits[k][0]) if not self.tiers[j].read_only])
            with self._lock:
                self.counts["promotions"] += sum(stored)
        finally:
            for k in claimed:
                wb.release(k)

    # ------------------------------------------------------------------ prefetch jobs
    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Promote ``keys`` in the background; the future resolves to how many the top tier then holds
        (or raises the first error once every key is done)."""
        done: Future[int] = Future()
        if not keys:
            done.set_result(0)
            return done
        remaining, held, errors, lock = [len(keys)], [0], [], threading.Lock()

        def finished(f: Future[bool]) -> None:
            exc = ClosedError("store closed before the prefetch ran") if f.cancelled() else f.exception()
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

        try:
            for k in keys:
                self._pool.submit(self._promote_one, k).add_done_callback(finished)
        except RuntimeError:  # the pool was shut down by a racing close()
            raise ClosedError("store is closed") from None
        return done

    def _promote_one(self, key: ChunkKey) -> bool:
        with self._guard(), self._wb.claim(key):
            return self.promote_current(key)

    def promote_current(self, key: ChunkKey) -> bool:
        """Copy the current value into the tiers above its highest holder (caller holds the claim); whether
        the top tier holds it then."""
        stale = self._wb.stale_levels(key)
        for level, tier in enumerate(self.tiers):
            if level in stale or not tier.contains(key):
                continue
            if level == 0:
                return True
            data = tier.copy_out(key)  # no pin held below while the tiers above evict into it
            if data is None:
                continue
            for upper, above in enumerate(self.tiers[:level]):
                if not above.read_only and above.put(key, data):
                    self._wb.mark_written(key, upper)
            with self._lock:
                self.counts["promotions"] += 1
            return self.tiers[0].contains(key)
        return False

    # ------------------------------------------------------------------ what is on its way up
    def promote_shared(self, keys: Sequence[ChunkKey], lookup: Callable[[Sequence[ChunkKey]], int]) -> None:
        """In the background: find the leading run of ``keys`` the tiers hold (``lookup``, which probes the
        shared ones) and promote it. The keys count as pending from now until that is done."""
        future: Future[int] = Future()
        with self._lock:
            if keys[0] in self._in_flight:
                return
            for k in keys:
                self._in_flight.setdefault(k, future)

        def job() -> None:
            try:
                with self._guard():
                    run = lookup(keys)
                    self._landed(keys[run:], future)  # what the probe did not find is not on its way
                    got = 0
                    for k in keys[:run]:  # on this job's thread: a job never waits for another job
                        with self._wb.claim(k):
                            got += self.promote_current(k)
                future.set_result(got)
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self._landed(keys, future)

        try:
            self._pool.submit(job)
        except RuntimeError:
            self._landed(keys, future)
            raise ClosedError("store is closed") from None

    def _landed(self, keys: Sequence[ChunkKey], job: Future[int]) -> None:
        """``keys`` are no longer on their way up by ``job`` (another job may have them since)."""
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

    def stop(self) -> None:
        """Cancel queued jobs (running ones finish; the store's close waits for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
