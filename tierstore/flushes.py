"""Flush accounting of the residency: what a flush waits for, counted as it changes, and what it reports.

Every write that must still happen — a ``(key, tier)`` pending for the key's value and not *failing* — is
counted under the *epoch* in which its key's pending tiers were recorded. A flush that begins takes the
current epoch (later writes count under the next one) and is done once no write of its epoch or an earlier
one is counted: each is uncounted as it settles (written, superseded by a newer put, given up, dropped,
deleted, or failing). So a flush looks at a few counters on each change, never at the keys.

Failing writes and the losses a flush reports (tiers given up, chunks dropped) are kept here too. Not
thread-safe on its own: the residency calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .keys import ChunkKey

#: keys whose losses (tiers given up, chunks dropped) a flush keeps naming; older ones are only counted
LOSSES_KEPT = 1 << 16


@dataclass(frozen=True)
class FlushState:
    """What a flush waits for: the writes counted under ``epoch`` or earlier."""

    epoch: int


class FlushTracker:
    """Counters of outstanding writes per epoch, the failing ``(key, tier)`` pairs, and the losses."""

    def __init__(self) -> None:
        self.epoch = 0  #: the epoch writes that become pending now are counted under
        self._open: dict[int, int] = {}  # epoch -> outstanding writes
        self.failing: dict[ChunkKey, set[int]] = {}
        self.given_up: OrderedDict[ChunkKey, set[int]] = OrderedDict()
        self.dropped: OrderedDict[ChunkKey, set[int]] = OrderedDict()
        #: given-up tiers that only keep an older copy they could not remove: reported while it is there
        self.kept_stale: dict[ChunkKey, set[int]] = {}

    def opened(self, epoch: int, n: int = 1) -> None:
        """``n`` writes counted under ``epoch`` became outstanding."""
        self._open[epoch] = self._open.get(epoch, 0) + n

    def settled(self, epoch: int, n: int = 1) -> None:
        """``n`` outstanding writes of ``epoch`` settled."""
        left = self._open[epoch] - n
        if left:
            self._open[epoch] = left
        else:
            del self._open[epoch]

    def begin(self) -> FlushState:
        """A flush begins: it waits for what is counted up to now."""
        state = FlushState(self.epoch)
        self.epoch += 1
        return state

    def outstanding(self, state: FlushState) -> int:
        """Writes ``state``'s flush still waits for (one entry per epoch that has some: a short walk)."""
        return sum(n for epoch, n in self._open.items() if epoch <= state.epoch)

    def fail(self, key: ChunkKey, tier: int) -> None:
        self.failing.setdefault(key, set()).add(tier)

    def unfail(self, key: ChunkKey, tier: int) -> None:
        tiers = self.failing.get(key)
        if tiers is not None:
            tiers.discard(tier)
            if not tiers:
                del self.failing[key]

    def take_failing(self) -> dict[ChunkKey, set[int]]:
        """Every failing pair, no longer failing (a flush gives them a fresh round of retries)."""
        failing, self.failing = self.failing, {}
        return failing

    def give_up(self, key: ChunkKey, tier: int) -> None:
        _remember(self.given_up, key, tier)

    def keep_stale(self, key: ChunkKey, tier: int) -> None:
        """``tier`` could not remove an older copy of ``key``: given up while that copy stays (see
        :meth:`losses`)."""
        self.give_up(key, tier)
        self.kept_stale.setdefault(key, set()).add(tier)

    def drop(self, key: ChunkKey, tier: int) -> None:
        _remember(self.dropped, key, tier)

    def forget(self, key: ChunkKey) -> None:
        """The key was put again or deleted: its losses are history."""
        self.given_up.pop(key, None)
        self.dropped.pop(key, None)
        self.kept_stale.pop(key, None)

    def losses(self, stale_gone: Callable[[ChunkKey, int], bool],
               ) -> tuple[dict[ChunkKey, set[int]], dict[ChunkKey, set[int]]]:
        """``(failed, dropped)``: per key the tiers it could not reach (given up, or failing now) and those
        the pressure policy dropped. A tier given up only for an older copy it kept is no longer named once
        ``stale_gone(key, tier)`` says that copy went (evicted or removed since, or replaced by the current
        value)."""
        for key, tiers in list(self.kept_stale.items()):
            for tier in [j for j in tiers if stale_gone(key, j)]:
                tiers.discard(tier)
                given = self.given_up.get(key)
                if given is not None:
                    given.discard(tier)
                    if not given:
                        del self.given_up[key]
            if not tiers:
                del self.kept_stale[key]
        failed = {k: set(v) for k, v in self.given_up.items()}
        for key, tiers in self.failing.items():
            failed.setdefault(key, set()).update(tiers)
        return failed, {k: set(v) for k, v in self.dropped.items()}


def _remember(losses: OrderedDict[ChunkKey, set[int]], key: ChunkKey, tier: int) -> None:
    losses.setdefault(key, set()).add(tier)
    losses.move_to_end(key)
    while len(losses) > LOSSES_KEPT:
        losses.popitem(last=False)


__all__ = ["LOSSES_KEPT", "FlushState", "FlushTracker"]
