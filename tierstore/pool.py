"""A fixed pool of host memory handed out in contiguous extents (pinned when CUDA is present).

One allocation at start-up, never grown: no per-chunk ``cudaHostAlloc``, and freed memory is reused
as-is. The pool is cut into slots of ``slot_size`` bytes (default 64, the payload alignment); a chunk
takes one contiguous run of slots, so a chunk of ``n`` bytes costs ``n`` rounded up to ``slot_size``
— at most 63 bytes more by default, under 1.6% for chunks of 4 KiB or more, and small chunks pack
densely (a 256 MiB pool holds 4 million 8-byte chunks, not 4,096).

Free runs are kept coalesced (neighbours merge on free) and binned by size class (powers of two), so an
allocation looks at a handful of candidates rather than scanning the pool: good fit within a class,
any run from a larger class otherwise. When no run is large enough the owner evicts and retries.
"""

from __future__ import annotations

import os
import threading

import torch

from .errors import InvalidInputError
from .tensors import alloc_host

#: candidates examined in the request's own size class before taking a run from a larger class
_SCAN = 16

Extent = tuple[int, int]  # (first slot, slot count)


class SlotPool:
    """``capacity`` bytes as ``capacity // slot_size`` slots of one flat uint8 tensor."""

    def __init__(self, capacity: int, slot_size: int = 64, pinned: bool = False, shared: bool | str = False):
        if not isinstance(slot_size, int) or slot_size <= 0 or slot_size % 64:
            raise InvalidInputError(f"slot_size must be a positive multiple of 64, got {slot_size}")
        self.slot_size = slot_size
        self.nslots = capacity // slot_size
        self.pinned = pinned and torch.cuda.is_available()
        #: with ``shared``: the sealed memfd holding the pool (what a node server hands its clients); sealed
        #: against writes but through this object's mapping, unless ``shared == "writable"``
        self.memfd: int | None = None
        if shared:
            from .serve import shm

            self.memfd, self.buffer = shm.create_pool("tierstore-host-pool", self.nslots * slot_size,
                                                      writable=shared == "writable")
            self.pinned = self.pinned and shm.register_for_dma(self.buffer, read_only=False)
        else:
            n = self.nslots * slot_size  # pinned: page-locked and mapped now; else huge pages, mapped on first use
            self.buffer = torch.empty(n, dtype=torch.uint8, pin_memory=True) if self.pinned else alloc_host(n)
        self._lock = threading.Lock()
        self._by_start: dict[int, int] = {}  # free run: first slot -> count
        self._by_end: dict[int, int] = {}  # free run: one past its last slot -> first slot
        self._bins: list[dict[int, None]] = [{} for _ in range(max(1, self.nslots.bit_length()))]
        self._free_slots = 0
        if self.nslots:
            self._add(0, self.nslots)

    @property
    def capacity(self) -> int:
        return self.nslots * self.slot_size

    def close(self) -> None:
        """Give back what a shared pool holds outside this object: its memfd and its DMA registration (the
        mapping itself stays until its last view is gone). A no-op for a private pool, and once done."""
        if self.memfd is None:
            return
        from .serve import shm

        memfd, self.memfd = self.memfd, None
        os.close(memfd)
        shm.unregister_for_dma(self.buffer)

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_size))

    def size_for(self, nbytes: int) -> int:
        """Bytes of the pool a chunk of ``nbytes`` occupies."""
        return self.slots_for(nbytes) * self.slot_size

    def alloc(self, nbytes: int) -> Extent | None:
        """A contiguous run of slots for ``nbytes``: ``(first_slot, count)``, or ``None`` if no free run
        is long enough."""
        n = self.slots_for(nbytes)
        with self._lock:
            start = self._find(n)
            if start is None:
                return None
            count = self._remove(start)
            if count > n:
                self._add(start + n, count - n)
            return start, n

    def free(self, run: Extent) -> None:
        start, n = run
        with self._lock:
            left = self._by_end.get(start)
            if left is not None:
                n += start - left
                self._remove(left)
                start = left
            if start + n in self._by_start:
                n += self._remove(start + n)
            self._add(start, n)

    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of ``t``'s first element in the pool (``t`` a view of it)."""
        return t.data_ptr() - self.buffer.data_ptr()

    def view(self, run: Extent) -> torch.Tensor:
        start, n = run
        return self.buffer[start * self.slot_size:(start + n) * self.slot_size]

    def free_slots(self) -> int:
        with self._lock:
            return self._free_slots

    def free_bytes(self) -> int:
        return self.free_slots() * self.slot_size

    def largest_free(self) -> int:
        """Bytes of the longest free run (what one chunk can get without eviction)."""
        with self._lock:
            return max(self._by_start.values(), default=0) * self.slot_size

    # ------------------------------------------------------------------ free runs (lock held)
    def _find(self, n: int) -> int | None:
        b = n.bit_length() - 1
        if b >= len(self._bins):
            return None
        for i, start in enumerate(self._bins[b]):
            if self._by_start[start] >= n:
                return start
            if i >= _SCAN:
                break
        for larger in self._bins[b + 1:]:
            if larger:
                return next(iter(larger))
        for start in self._bins[b]:  # the class is long and its first candidates were short: look at all
            if self._by_start[start] >= n:
                return start
        return None

    def _add(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._bins[n.bit_length() - 1][start] = None
        self._free_slots += n

    def _remove(self, start: int) -> int:
        n = self._by_start.pop(start)
        del self._by_end[start + n]
        del self._bins[n.bit_length() - 1][start]
        self._free_slots -= n
        return n
