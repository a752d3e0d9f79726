"""A fixed pool of host memory carved into equal slots (pinned when CUDA is present).

One allocation at start-up, never grown: no per-chunk ``cudaHostAlloc`` and no fragmentation growth. A
chunk takes a contiguous run of slots (first fit); when no run is free the owner evicts and retries.
"""

from __future__ import annotations

import threading

import torch

from .errors import InvalidInputError


class SlotPool:
    """``capacity`` bytes as ``capacity // slot_size`` slots of one flat uint8 tensor."""

    def __init__(self, capacity: int, slot_size: int = 1 << 20, pinned: bool = False):
        if slot_size <= 0 or slot_size % 64:
            raise InvalidInputError(f"slot_size must be a positive multiple of 64, got {slot_size}")
        self.slot_size = slot_size
        self.nslots = capacity // slot_size
        self.pinned = pinned and torch.cuda.is_available()
        self.buffer = torch.empty(self.nslots * slot_size, dtype=torch.uint8, pin_memory=self.pinned)
        self._free = bytearray(b"\x01") * self.nslots
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.nslots * self.slot_size

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_size))

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        """First-fit run of slots for ``nbytes``: ``(first_slot, count)`` or ``None``."""
        n = self.slots_for(nbytes)
        with self._lock:
            start = self._free.find(b"\x01" * n)
            if start < 0:
                return None
            self._free[start:start + n] = b"\x00" * n
            return start, n

    def free(self, run: tuple[int, int]) -> None:
        start, n = run
        with self._lock:
            self._free[start:start + n] = b"\x01" * n

    def view(self, run: tuple[int, int]) -> torch.Tensor:
        start, n = run
        return self.buffer[start * self.slot_size:(start + n) * self.slot_size]

    def free_slots(self) -> int:
        with self._lock:
            return self._free.count(1)
