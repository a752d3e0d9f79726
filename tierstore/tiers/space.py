"""How many bytes a tier may hold after its storage said ENOSPC (the device is full below our capacity).

The tier then holds at most what it really holds (its next puts evict least-recently-used chunks, so the
newest survive), and probes free space again after a back-off that doubles while the device stays full
and resets once a write fits again. One ENOSPC therefore never disables a tier for good.
"""

from __future__ import annotations

import time


class SpaceLimit:
    """The limit one tier learned from ENOSPC; call every method with the tier's lock held."""

    def __init__(self) -> None:
        self.bytes: int | None = None  # None: no limit beyond the configured capacity
        self._recheck_at = 0.0
        self._backoff = 0.0
        self._lifted = False

    def full(self, held: int, first_backoff: float, max_backoff: float) -> float:
        """The storage is full while we hold ``held`` bytes; returns the seconds until the next probe."""
        self.bytes = held
        self._backoff = min(max(2 * self._backoff, first_backoff), max_backoff)
        self._recheck_at = time.monotonic() + self._backoff
        return self._backoff

    def due(self) -> bool:
        """Whether free space should be probed now."""
        return self.bytes is not None and time.monotonic() >= self._recheck_at

    def probed(self, held: int, free: int | None) -> None:
        """Free space was probed: ``free`` bytes (``None`` = unknown: lift the limit and just try again)."""
        if self.bytes is None:
            return
        self.bytes = None if free is None else max(self.bytes, held + free)
        self._recheck_at = time.monotonic() + self._backoff
        self._lifted = True

    def stored(self) -> None:
        """A write fit after the limit was raised: the device has room again, so the back-off starts over."""
        if self._lifted:
            self._lifted, self._backoff = False, 0.0

    def apply(self, capacity: int | None) -> int | None:
        """The tier's effective capacity."""
        if self.bytes is None:
            return capacity
        return self.bytes if capacity is None else min(self.bytes, capacity)
