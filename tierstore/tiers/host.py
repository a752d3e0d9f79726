"""The ``host`` tier: chunks in host RAM.

By default a tier of at least 64 MiB preallocates its whole capacity once as a
:class:`~tierstore.pool.SlotPool` (pinned when CUDA is present and ``pinned: true``) and carves chunks
out of it: a put is a memcpy into memory that is already mapped (fresh allocations page-fault at a
fraction of memcpy speed), transfers to the GPU are DMA-able, and memory never grows over time.
``pool: true|false`` forces the choice; small tiers default to one plain allocation per chunk.

Capacity means bytes a user can store: a pooled chunk is charged its tensors' bytes, each tensor
starting 64-byte aligned, rounded up to ``slot_size`` (default 64) — at most 63 bytes per tensor more,
under 3.2% for a two-tensor chunk of 4 KiB or more. When fragmentation leaves no run long enough,
least-recently-used chunks are evicted until one is (they free adjacent runs, which merge).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping

import torch

from ..keys import ChunkKey
from ..objformat import ALIGN, Encoded
from ..pool import SlotPool
from ..tensors import nbytes
from .memory import MemoryTier

#: host tiers at least this large preallocate a pool by default
POOL_MIN = 64 << 20


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[tuple[str, int]], int]:
    offsets, pos = [], 0
    for name, t in tensors.items():
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append((name, pos))
        pos += t.numel() * t.element_size()
    return offsets, pos


class HostTier(MemoryTier):
    kind = "host"

    def __init__(self, name: str | None = None, capacity: int | None = None, pinned: bool = True,
                 pool: bool | None = None, slot_size: int = 64):
        super().__init__(name, capacity, device="cpu", pinned=pinned)
        use_pool = (capacity is not None and capacity >= POOL_MIN) if pool is None else pool
        self.pool: SlotPool | None = None
        if use_pool and capacity:
            slot_size = max(ALIGN, min(slot_size, capacity // ALIGN * ALIGN))  # a tiny tier still gets a slot
            self.pool = SlotPool(capacity, slot_size, pinned=self.pinned)
        if self.pool is not None:
            self.capacity = self.pool.capacity
        self._runs: dict[ChunkKey, tuple[int, int]] = {}
        self._retired: dict[ChunkKey, list[tuple[int, int]]] = {}  # replaced or dropped while pinned

    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor] | Encoded
                 ) -> tuple[Mapping[str, torch.Tensor], int]:
        assert not isinstance(tensors, Encoded)  # only tiers that store objects get them
        if self.pool is None:
            return tensors, nbytes(tensors)
        return tensors, self.pool.size_for(_layout(tensors)[1])

    def _store(self, key: ChunkKey, payload: Mapping[str, torch.Tensor], size: int) -> None:
        if self.pool is None:
            return super()._store(key, payload, size)
        run = self._alloc_run(key, size)
        buf = self.pool.view(run)
        offsets, _ = _layout(payload)
        stored = {}
        for name, off in offsets:
            t = payload[name]
            nb = t.numel() * t.element_size()
            dst = buf[off:off + nb]
            dst = (dst.view(t.dtype) if t.dtype != torch.uint8 else dst).reshape(t.shape)
            dst.copy_(t)
            stored[name] = dst
        with self._cond:
            old = self._runs.get(key)
            self._data[key], self._runs[key] = stored, run
            if old is not None:
                self._free_run(key, old)

    def _alloc_run(self, key: ChunkKey, size: int) -> tuple[int, int]:
        """Bytes are reserved already; evict further LRU chunks while fragmentation blocks a run.

        An overwrite whose new run only fits where the old value lies gives the old value up first.
        """
        assert self.pool is not None  # runs exist only in a pooled tier
        kept: set[ChunkKey] = set()
        while (run := self.pool.alloc(size)) is None:
            with self._cond:
                victims = self._claims.select_victims(size, exclude=kept | {key})
            if victims:
                kept |= self._evict(victims)
            elif key in self._runs:
                self._drop(key)  # the put replaces it anyway; a failed put then removes the key (base)
            else:
                raise OSError(errno.ENOMEM, "host pool fragmented: no contiguous run free")
        return run

    def _drop(self, key: ChunkKey) -> None:
        if self.pool is None:
            return super()._drop(key)
        with self._cond:
            self._data.pop(key, None)
            run = self._runs.pop(key, None)
            if run is not None:
                self._free_run(key, run)

    def _free_run(self, key: ChunkKey, run: tuple[int, int]) -> None:
        """Return ``run`` to the pool, or once ``key`` is unpinned if a reader may still be copying it.

        Call with the lock held: a reader pins under it before it looks the key up.
        """
        assert self.pool is not None
        if self._claims.pinned(key):
            self._retired.setdefault(key, []).append(run)
        else:
            self.pool.free(run)

    def _last_unpin(self, key: ChunkKey) -> None:
        if self._retired:
            assert self.pool is not None
            for run in self._retired.pop(key, ()):
                self.pool.free(run)
