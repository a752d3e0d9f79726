"""When this process should refresh a shared object's last use (its modification time, which ``gc
--max-size`` orders by), so that the fleet together pays about one request per object per interval.

No I/O here: :class:`UseClock` only decides, the remote tier sends the requests. Per key it keeps when the
next refresh is due and whether this process did the last one:

* a **read from the prefix** tells the object's time for free: fresh (younger than ``every``) means
  nothing to do until it is ``every`` old; stale means refresh now (a copy, no check first);
* a **hit in a tier above** (the instance serves the object from its own memory or disk) is a use the
  prefix cannot see. A key first seen is due ``every`` later; when due, this process refreshes at once if
  it did the last refresh itself (nobody else is known to), else it *checks* first (a HEAD): an object
  another instance refreshed meanwhile needs nothing, and this process then backs off to ``backoff`` ×
  ``every`` for that key. One instance ends up refreshing each object it keeps using (one request per
  interval) while the others check it once per ``backoff`` intervals, so N instances holding an object
  cost about 1 + (N - 1) / ``backoff`` requests per interval rather than N. An object someone still uses
  is refreshed at least every ``backoff`` × ``every`` seconds even when its refresher leaves.

The table is bounded (``kept`` keys, least recently noted forgotten first); a forgotten key is first seen
again, which costs no request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from ..keys import ChunkKey

#: how many intervals an instance waits before checking an object that another instance refreshes
BACKOFF = 4.0
#: keys whose schedule a process remembers
KEPT = 65536


class UseClock:
    """Which keys to refresh, and how (see the module docstring). Thread-safe; times are epoch seconds."""

    def __init__(self, every: float, backoff: float = BACKOFF, kept: int = KEPT) -> None:
        self.every = every
        self.backoff = backoff
        self.kept = kept
        self._lock = threading.Lock()
        self._due: OrderedDict[ChunkKey, tuple[float, bool]] = OrderedDict()  # key -> (next due, ours)

    def served_above(self, keys: Iterable[ChunkKey], now: float) -> list[tuple[ChunkKey, bool]]:
        """Keys a tier above served at ``now``: those to refresh, each with whether to check first."""
        todo = []
        with self._lock:
            for key in keys:
                entry = self._due.get(key)
                if entry is None:
                    self._set(key, now + self.every, False)
                elif now >= entry[0]:
                    self._set(key, now + self.every, entry[1])  # claimed: no second request meanwhile
                    todo.append((key, not entry[1]))
        return todo

    def read(self, key: ChunkKey, modified: float, now: float) -> bool:
        """A read of ``key``'s object found it modified at ``modified``: whether to refresh it now."""
        if modified <= 0:
            return False
        with self._lock:
            if now - modified < self.every:
                self._set(key, modified + self.every, False)
                return False
            entry = self._due.get(key)
            if entry is not None and now < entry[0] and entry[1]:
                return False  # our own refresh is on its way
            self._set(key, now + self.every, True)
            return True

    def refreshed(self, key: ChunkKey, now: float) -> None:
        """This process refreshed (or wrote) ``key``'s object at ``now``."""
        with self._lock:
            self._set(key, now + self.every, True)

    def found_fresh(self, key: ChunkKey, modified: float) -> None:
        """A check found ``key``'s object refreshed at ``modified`` by someone else: back off."""
        with self._lock:
            self._set(key, modified + self.backoff * self.every, False)

    def _set(self, key: ChunkKey, due: float, ours: bool) -> None:
        self._due[key] = (due, ours)
        self._due.move_to_end(key)
        while len(self._due) > self.kept:
            self._due.popitem(last=False)
