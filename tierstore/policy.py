"""Eviction policy: which key goes first. Pure bookkeeping — no tensors, no I/O, no locks.

Modelled on cachetools' ``LRUCache``: sizes in bytes, ``currsize``, least-recently-used first. The tier
that owns a policy decides what may be evicted (pins, dirty chunks) and does the removal itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUPolicy(Generic[K]):
    """Byte-sized least-recently-used order over keys."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[K, int] = OrderedDict()
        self.currsize = 0

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[K]:
        return iter(self._sizes)

    def size(self, key: K) -> int:
        return self._sizes[key]

    def add(self, key: K, size: int) -> None:
        """Insert or replace ``key`` as the most recently used."""
        self.currsize += size - self._sizes.pop(key, 0)
        self._sizes[key] = size

    def sizes_of(self, keys: Sequence[K], touch: bool = False) -> list[int | None]:
        """Each key's size (``None``: absent) in one pass; ``touch`` makes the present ones most recently used."""
        get = self._sizes.get
        sizes = [get(k) for k in keys]
        if touch:
            move = self._sizes.move_to_end
            for k, size in zip(keys, sizes, strict=True):
                if size is not None:
                    move(k)
        return sizes

    def remove(self, key: K) -> int:
        size = self._sizes.pop(key)
        self.currsize -= size
        return size

    def victims(self) -> Iterator[K]:
        """Keys from least to most recently used (a live view: do not add or remove while iterating)."""
        return iter(self._sizes)
