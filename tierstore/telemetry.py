"""The numbers a store keeps about itself: named counters, latency histograms, failures by reason.

Everything here is plain Python and cheap enough to be always on (a latency record is one deque append;
counters and failures take one small lock); :mod:`tierstore.metrics` turns it into Prometheus families at
scrape time and ``stats()`` reads the same objects, so the two never disagree.

A failure is counted every time and logged rate-limited: the first of a reason at once, then at most one
line per ``quiet`` seconds saying how many happened since the last line — a second outage an hour after
the first is logged again.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate
from time import perf_counter
from typing import Any

#: upper bounds (seconds) of the latency buckets: 20 µs (a hit in memory) to 10 s (a slow remote batch)
LATENCY_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
#: observations kept unbinned before the recording thread bins them
FOLD_AT = 4096
#: seconds between two log lines of one failure reason
QUIET_S = 60.0


class Latency:
    """Latency histograms, one per operation name (``get``, ``put``, ``lookup``), fixed buckets."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.enabled = True  # False: record nothing (``bench metrics`` measures what recording costs)
        self._lock = threading.Lock()
        self._pending: deque[tuple[str, float]] = deque()  # observations not yet binned
        self._counts: dict[str, list[int]] = {}  # op -> count per bucket (+Inf last)
        self._sums: dict[str, float] = {}

    def since(self, op: str, start: float) -> None:
        """Record one ``op`` that began at ``start`` (a :func:`time.perf_counter` reading)."""
        if self.enabled:  # runs on every get and put: a deque append is atomic, no lock; binned in batches
            pending = self._pending
            pending.append((op, perf_counter() - start))
            if len(pending) >= FOLD_AT:
                self._fold()

    def _fold(self) -> None:
        with self._lock:
            pending, bounds = self._pending, self.bounds
            while True:
                try:
                    op, seconds = pending.popleft()
                except IndexError:
                    return
                counts = self._counts.get(op)
                if counts is None:
                    counts = self._counts[op] = [0] * (len(bounds) + 1)
                    self._sums[op] = 0.0
                counts[bisect_left(bounds, seconds)] += 1
                self._sums[op] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """Per op: cumulative counts per bucket (the last is ``+Inf``, the total) and the sum of seconds."""
        self._fold()
        with self._lock:
            raw = {op: (list(c), self._sums[op]) for op, c in self._counts.items()}
        return {op: (list(accumulate(counts)), total) for op, (counts, total) in raw.items()}


class Counters:
    """Named counters, each optionally split by one label value (``kv_hit_tokens`` by tier)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, int | float]] = {}

    def add(self, name: str, n: int | float = 1, label: str = "") -> None:
        with self._lock:
            per = self._values.setdefault(name, {})
            per[label] = per.get(label, 0) + n

    def snapshot(self) -> dict[str, dict[str, int | float]]:
        """``{name: {label: value}}`` (an unlabelled counter has the label ``""``)."""
        with self._lock:
            return {name: dict(per) for name, per in self._values.items()}


class Failures:
    """Failures of one component by reason: counted always, logged rate-limited (see the module docstring)."""

    def __init__(self, logger: logging.Logger, prefix: str, quiet: float = QUIET_S) -> None:
        self._log = logger
        self._prefix = prefix
        self.quiet = quiet
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}  # reason -> failures since its last line
        self._last: dict[str, float] = {}

    def report(self, reason: str, msg: str, *args: Any) -> None:
        """Count one failure of ``reason``; log it unless that reason was logged less than ``quiet`` s ago."""
        now = time.monotonic()
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            last = self._last.get(reason)
            if last is not None and now - last < self.quiet:
                return
            self._last[reason] = now
            n = self._unlogged.pop(reason)
        if last is None:
            self._log.warning(self._prefix + msg, *args)
        else:
            self._log.warning(self._prefix + msg + " (%d such failures in the last %.1f s)", *args, n, now - last)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
