"""Bounded staging: a ring of equal host buffers (pinned when CUDA is present).

Ranged reads that cannot land in their final memory (a GPU destination, a dtype cast, a range that is
also being cached) land in a ring slot first. The ring is one allocation carved into ``count`` slots, so
staging memory is fixed however large the checkpoint; pinning (``cudaHostAlloc``) is slow, so the last
ring is kept for the next load. With a CUDA destination each worker thread copies its slot to the device
with a non-blocking H2D copy on its own stream while the other workers keep reading, and waits for that
copy only before handing the slot back (:func:`tierstore.tensors.copy_segments`).
"""

from __future__ import annotations

import queue
import threading

import torch

_cache_lock = threading.Lock()
_cached: StagingRing | None = None


class StagingRing:
    """``count`` staging slots of ``slot_size`` bytes; ``acquire`` blocks until one is free."""

    def __init__(self, count: int, slot_size: int, pinned: bool):
        self.count, self.slot_size, self.pinned = count, slot_size, pinned
        self.buffer = torch.empty(count * slot_size, dtype=torch.uint8, pin_memory=pinned)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(self.buffer[i * slot_size:(i + 1) * slot_size])

    def acquire(self) -> torch.Tensor:
        return self._free.get()

    def release(self, slot: torch.Tensor) -> None:
        self._free.put(slot)


def get_ring(count: int, slot_size: int, pinned: bool) -> StagingRing:
    """A ring with at least ``count`` slots of ``slot_size`` bytes, reusing the last one if it fits."""
    global _cached
    with _cache_lock:
        ring, _cached = _cached, None
    if ring is not None and ring.slot_size == slot_size and ring.count == count and ring.pinned == pinned:
        return ring
    return StagingRing(count, slot_size, pinned)


def put_ring(ring: StagingRing) -> None:
    """Hand ``ring`` back for reuse by the next load (only one ring is kept)."""
    global _cached
    with _cache_lock:
        _cached = ring

