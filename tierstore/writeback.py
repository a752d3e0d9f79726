"""Write-back: the part of the data plane (:mod:`tierstore.transfers`) that copies what the residency says is
due into each tier below the one a put landed in.

A scheduler thread takes the due writes per tier and hands them, a batch at a time, to that tier's writer
thread; a batch reads its sources (an object's bytes as they are between backends of the same codec) and
lands them (:meth:`~tierstore.transfers.Transfers.land_many`). A failure is retried with back-off (the
residency keeps the schedule) and reported by :meth:`WriteBack.flush` once it keeps failing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

from .backends.base import Chunk
from .errors import ClosedError, CorruptObjectError, UnsupportedObjectError
from .keys import ChunkKey
from .residency import Hold, Write
from .transfers import Transfers

log = logging.getLogger("tierstore")

#: batches in flight per tier: one reading its sources while another writes
PIPELINE = 2

@dataclass(frozen=True)
class FlushReport:
    """What a :meth:`~tierstore.TieredStore.flush` that raised nothing has to say: the chunks the ``drop``
    pressure policy gave up (key -> names of the tiers they never reached). Every flush names a dropped chunk
    until its key is put again or deleted, so each caller that flushes learns of it."""

    dropped: dict[ChunkKey, tuple[str, ...]] = field(default_factory=dict)


class WriteBack:
    """Write-back of one store: a scheduler thread takes what the residency says is due into each tier and
    hands it, a batch at a time, to that tier's writers (:data:`PIPELINE` batches in flight per tier, each
    as large as the tier's backend runs at once — its :attr:`~tierstore.backends.base.Backend.concurrency`,
    at least ``batch`` — so one batch reads its sources while another writes)."""

    def __init__(self, transfers: Transfers, batch: int) -> None:
        self.t = transfers
        self.res = transfers.res
        self.batch = batch
        self._tiers = [tr.index for tr in transfers.tiers if tr.index > 0 and tr.writable]
        self._batches = {j: max(batch, transfers.tiers[j].backend.concurrency or 0) for j in self._tiers}
        self._writers = {j: ThreadPoolExecutor(PIPELINE,
                                               thread_name_prefix=f"tierstore-writeback-{transfers.tiers[j].name}")
                         for j in self._tiers}
        self._lock = threading.Lock()
        #: batches in flight: number -> tier (a tier takes ``pipeline`` at a time; flush waits for those its
        #: writes were in)
        self._running: dict[int, int] = {}
        self._numbered = 0
        self.pipeline = PIPELINE
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="tierstore-writeback")
        self._thread.start()

    def _run(self) -> None:
        res = self.res
        while not self._stopping:
            seen = res.changes
            due = self._due()
            if not due:
                res.wait_for_change(seen, self._idle())
                continue
            for j in due:
                writes, stale = res.take_due(j, self._batches[j])
                for key, tier in stale:
                    self.t.remove_stale(key, [tier])
                if writes:
                    self._submit(j, writes)

    def _due(self) -> list[int] | None:
        """Tiers with write-backs due now and no batch in flight (``None``: none)."""
        busy = self._busy()
        due = [j for j in self._tiers if busy.count(j) < self.pipeline and self.res.next_due(j) == 0.0]
        return due or None

    def _idle(self) -> float:
        """Seconds until the next retry falls due (at most one)."""
        busy = self._busy()
        times = [t for j in self._tiers if busy.count(j) < self.pipeline and (t := self.res.next_due(j)) is not None]
        return 1.0 if not times else min(1.0, max(0.0, min(times) - self.res.clock()))

    def _busy(self) -> list[int]:
        """The tier of each batch in flight."""
        with self._lock:
            return list(self._running.values())

    def _begin(self, tier: int) -> int:
        """Count a batch into ``tier`` in flight; its number."""
        with self._lock:
            self._numbered += 1
            self._running[self._numbered] = tier
            return self._numbered

    def write_now(self, tier: int, writes: list[Write]) -> None:
        """Carry out one batch of ``writes`` (taken from the residency) into ``tier`` on this thread."""
        self._write(tier, writes, self._begin(tier))

    def _submit(self, tier: int, writes: list[Write]) -> None:
        number = self._begin(tier)
        try:
            self.t.jobs.submit(self._writers[tier], "write-back", self.t.tiers[tier].name, len(writes),
                               lambda: self._write(tier, writes, number))
        except ClosedError:
            self._done(number)

    def _done(self, number: int) -> None:
        with self._lock:
            self._running.pop(number, None)
        self.res.notify()

    def _write(self, tier: int, writes: list[Write], number: int) -> None:
        t, res = self.t, self.res
        try:
            # the sources stay pinned until the stack gives back what it borrowed: a pool run lent to this batch
            # is not free memory, so its chunk must not be evicted (its bytes counted free) before then
            with ExitStack() as stack:
                stack.callback(res.unpin, [Hold(w.key, w.source, w.source_size, w.gen) for w in writes])
                items: list[tuple[ChunkKey, int, Chunk]] = []
                read = self._read_objects(tier, writes)
                for i, w in enumerate(writes):
                    try:
                        if i in read:
                            got = read[i]
                            if isinstance(got, BaseException):
                                raise got
                            data = got
                        else:
                            data = t.read_for_copy(stack, w.source, w.key, tier)
                    except (CorruptObjectError, UnsupportedObjectError) as exc:
                        log.warning("write-back of %s: its copy in tier %s cannot be read (%s); forgetting it",
                                    w.key.hex(), t.tiers[w.source].name, exc)
                        res.lost(w.source, w.key, w.gen, remove=False)
                        data = None
                    except Exception as exc:  # noqa: BLE001 - an I/O error: retried with back-off
                        log.debug("write-back of %s: reading tier %s failed: %s", w.key.hex(),
                                  t.tiers[w.source].name, exc)
                        data = None
                    if data is None:
                        t.abort(tier, w.key, w.gen)
                    else:
                        items.append((w.key, w.gen, data))
                t.land_many(tier, items, slots_held=True, kind="write-back")
        finally:
            self._done(number)

    def _read_objects(self, tier: int, writes: list[Write]) -> dict[int, Chunk | BaseException | None]:
        """The sources of ``writes`` that move as objects into ``tier``, read in one batch per source tier
        (index in ``writes`` -> object, ``None`` or error)."""
        by_source: dict[int, list[int]] = {}
        for i, w in enumerate(writes):
            if self.t.moves_objects(w.source, tier):
                by_source.setdefault(w.source, []).append(i)
        read: dict[int, Chunk | BaseException | None] = {}
        for source, idx in by_source.items():
            read.update(zip(idx, self.t.read_objects_for_copy(source, [writes[i].key for i in idx]), strict=True))
        return read

    def flush(self, timeout: float | None = None, *, stall: bool = False) -> FlushReport:
        """Wait until every chunk put so far reached every tier below it, is failing there, or was dropped.

        Failing tiers first get a fresh round of retries. Raises :class:`~tierstore.WriteBackError` naming
        the keys and tiers that could not be written (with ``dropped`` as in the report), and
        :class:`~tierstore.TierTimeoutError` if ``timeout`` passed first: in all, or with ``stall`` (close)
        with no write settled (a slow tier that keeps taking chunks is waited for; a stuck one is not).
        """
        from .errors import TierTimeoutError, WriteBackError

        res = self.res
        state = res.flush_begin()
        left = res.flush_waits_for(state)
        deadline = None if timeout is None else time.monotonic() + timeout

        def progress() -> int | None:
            n = res.flush_waits_for(state)
            return n if n != left else None

        while left:
            n = res.wait_until(progress, deadline)
            if n is None:
                how = "with none written in the last" if stall else "after"
                raise TierTimeoutError(f"flush: {left} write-backs still pending {how} {timeout}s")
            left = n
            if stall and timeout is not None:
                deadline = time.monotonic() + timeout
        # the batches that settled those writes give back what they borrowed and unpin their sources just after:
        # once flush returns, the chunks it waited for can be evicted
        with self._lock:
            batches = list(self._running)
        res.wait_until(lambda: True if all(b not in self._running for b in batches) else None, deadline)
        failed, dropped = res.losses()
        report = FlushReport(self._named(dropped))
        if failed:
            raise WriteBackError(self._named(failed), report.dropped)
        return report

    def _named(self, tiers: dict[ChunkKey, set[int]]) -> dict[ChunkKey, tuple[str, ...]]:
        return {k: tuple(self.t.tiers[j].name for j in sorted(js)) for k, js in tiers.items()}

    def stop(self, timeout: float) -> None:
        """Stop scheduling; let the batches in flight finish, waiting up to ``timeout`` s in all."""
        deadline = time.monotonic() + timeout
        self._stopping = True
        self.res.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        for writer in self._writers.values():
            writer.shutdown(wait=False, cancel_futures=True)
        for job in self.t.jobs.running():
            if job.kind == "write-back" and job.future is not None:
                try:
                    job.future.exception(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a timeout here: close goes on
                    pass


