"""Eviction policy: which key goes first. Pure bookkeeping — no tensors, no I/O, no locks.

Modelled on cachetools' ``LRUCache``: sizes in bytes, ``currsize``, least-recently-used first. The tier
that owns a policy decides what may be evicted (pins, dirty chunks) and does the removal itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class LRUPolicy:
    """Byte-sized least-recently-used order over keys."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()
        self.currsize = 0

    def __contains__(self, key) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator:
        return iter(self._sizes)

    def size(self, key) -> int:
        return self._sizes[key]

    def add(self, key, size: int) -> None:
        """Insert or replace ``key`` as the most recently used."""
        self.currsize += size - self._sizes.pop(key, 0)
        self._sizes[key] = size

    def touch(self, key) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key) -> int:
        size = self._sizes.pop(key)
        self.currsize -= size
        return size

    def victims(self) -> Iterator:
        """Keys from least to most recently used (a live view: do not add or remove while iterating)."""
        return iter(self._sizes)
