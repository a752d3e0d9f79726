"""Who may touch which key of one tier, and how many of its bytes are spoken for.

Every tier keeps its index (keys, sizes, LRU order) and four kinds of claims under one lock, ``cond``:

* **pins** — readers and copiers hold a key against eviction; many at once, counted per key;
* **exclusive claims** — one mutation of a key at a time (store, delete, forget);
* **evictions** — keys chosen as victims, and the bytes they are about to free;
* **reservations** — bytes a put has set aside before it writes, so capacity holds while it writes.

The rules, in one place: an exclusively claimed, evicting or pinned key is never chosen as a victim; an
exclusive claim waits for a running eviction of its key; nothing here waits for a pin to go away (a reader
may itself be waiting on a put into another tier), and every wait for space ends at a deadline. No I/O
runs under ``cond``: eviction calls back into the tier with the lock released.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager

from ..errors import ClosedError
from ..keys import ChunkKey
from ..policy import LRUPolicy

#: ``evict(victims) -> keys kept``: the tier's eviction of ``[(key, size), ...]`` (see :meth:`Tier._evict`)
Evict = Callable[[list[tuple[ChunkKey, int]]], set[ChunkKey]]


class Claims:
    """The lock-protected control state of one tier (see the module docstring)."""

    def __init__(self, index: LRUPolicy[ChunkKey], name: str) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.index = index
        self.name = name
        self.closed = False
        self.pins: dict[ChunkKey, int] = {}
        self.busy: set[ChunkKey] = set()  # exclusively claimed keys
        self.restored: set[ChunkKey] = set()  # pinned keys stored again since (a reader may hold the old one)
        self.evicting: set[ChunkKey] = set()
        self.evicting_bytes = 0
        self.reserved = 0

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"tier {self.name!r} is closed")

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Iterable[ChunkKey], touch: bool) -> list[int | None]:
        """Pin each key the index holds; its size, or ``None`` (absent, not pinned). Duplicates pin twice."""
        keys = list(keys)
        with self.cond:  # few dict operations per key: a batch of 256 hashes each key ~4 times, not ~10
            sizes = self.index.sizes_of(keys, touch)
            pins = self.pins
            count = pins.get
            for k, size in zip(keys, sizes, strict=True):
                if size is not None:
                    pins[k] = count(k, 0) + 1
        return sizes

    def unpin(self, keys: Iterable[ChunkKey], last_unpin: Callable[[ChunkKey], None]) -> None:
        """Release one pin per key; ``last_unpin(key)`` runs under the lock when a key's last pin goes."""
        with self.cond:
            pins, restored = self.pins, self.restored
            count = pins.get
            for k in keys:
                n = count(k, 0) - 1
                if n > 0:
                    pins[k] = n
                else:
                    pins.pop(k, None)
                    if restored:
                        restored.discard(k)
                    last_unpin(k)
            self.cond.notify_all()

    def pinned(self, key: ChunkKey) -> bool:
        """Whether ``key`` is pinned (call with the lock held)."""
        return self.pins.get(key, 0) > 0

    # ------------------------------------------------------------------ exclusive claims
    @contextmanager
    def exclusive(self, key: ChunkKey) -> Iterator[None]:
        """Hold ``key`` against every other mutation and against eviction for the ``with`` body.

        Waits while another mutation or an eviction of ``key`` runs (both end without waiting on us).
        """
        with self.cond:
            while key in self.busy or key in self.evicting:
                self.cond.wait()
            self.busy.add(key)
        try:
            yield
        finally:
            self.unclaim(key)

    def try_claim_to_forget(self, key: ChunkKey) -> bool:
        """Claim ``key`` to forget it after a failed read, unless anyone mutates or evicts it, or it was
        stored again since the reader pinned it (the failure may be the old object's); never waits."""
        with self.cond:
            if key in self.busy or key in self.evicting or key in self.restored:
                return False
            self.busy.add(key)
            return True

    def unclaim(self, key: ChunkKey) -> None:
        with self.cond:
            self.busy.discard(key)
            self.cond.notify_all()

    # ------------------------------------------------------------------ reservations and eviction
    def reserve(self, key: ChunkKey, size: int, limit: int | None, evict: Evict, deadline: float) -> int | None:
        """Set aside room for ``size`` bytes of ``key`` (exclusively claimed by the caller).

        The key's current value counts as freed, since the put replaces it. Victims are evicted
        synchronously, least recently used first; a victim the tier keeps (pinned meanwhile, or dirty and
        not written below) is passed over. Waits for others' evictions, reservations and pins only until
        ``deadline``. Returns the bytes reserved (give them to :meth:`commit` or :meth:`release`), or
        ``None`` when the value cannot fit.
        """
        kept: set[ChunkKey] = set()
        with self.cond:
            while True:
                self.check_open()
                credit = self.index.size(key) if key in self.index else 0
                need = max(0, size - credit)
                over = self.index.currsize + self.reserved + need - (limit if limit is not None else 0)
                if limit is None or over <= 0:
                    self.reserved += need
                    return need
                deficit = over - self.evicting_bytes
                victims = self.select_victims(deficit, exclude=kept | {key}) if deficit > 0 else []
                remaining = deadline - time.monotonic()
                if victims:
                    self.cond.release()
                    try:
                        kept |= evict(victims)
                    finally:
                        self.cond.acquire()
                elif remaining > 0 and (self.evicting_bytes or self.reserved or self.pins):
                    # others are freeing space or finishing writes, or readers hold pins for milliseconds
                    self.cond.wait(min(0.05, remaining))
                else:
                    return None

    def select_victims(self, deficit: int, exclude: Collection[ChunkKey]) -> list[tuple[ChunkKey, int]]:
        """Mark least-recently-used evictable keys worth ``deficit`` bytes as evicting (lock held)."""
        victims, freed = [], 0
        for k in self.index.victims():
            if freed >= deficit:
                break
            if self.pins.get(k) or k in self.evicting or k in self.busy or k in exclude:
                continue
            size = self.index.size(k)
            self.evicting.add(k)
            self.evicting_bytes += size
            victims.append((k, size))
            freed += size
        return victims

    def end_eviction(self, key: ChunkKey, size: int, removed: bool) -> bool:
        """Clear ``key``'s evicting mark; with ``removed``, take it out of the index. Whether it was there."""
        with self.cond:
            self.evicting.discard(key)
            self.evicting_bytes -= size
            present = removed and key in self.index
            if present:
                self.index.remove(key)
            self.cond.notify_all()
            return present

    def commit(self, key: ChunkKey, size: int, reserved: int) -> None:
        """The put of ``key`` (``size`` bytes, ``reserved`` of them set aside) is stored: index it."""
        with self.cond:
            self.reserved -= reserved
            self.index.add(key, size)
            if self.pins.get(key):
                self.restored.add(key)
            self.cond.notify_all()

    def release(self, reserved: int) -> None:
        """The put that reserved these bytes stored nothing."""
        with self.cond:
            self.reserved -= reserved
            self.cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse further reservations and wait up to ``timeout`` s for running mutations to end.

        ``False`` if already closed.
        """
        with self.cond:
            if self.closed:
                return False
            self.closed = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.busy and not self.reserved, timeout)
            return True
