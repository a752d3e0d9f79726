"""Memory backends: chunks as tensors on a torch device (``device``) or in host RAM (``host``).

A write copies the chunk in, a read copies it out (callers own what they get); :meth:`MemoryBackend.borrow`
lends the stored tensors themselves for a write-back to read from.

A host backend of at least 64 MiB preallocates its whole capacity once as a :class:`~tierstore.pool.SlotPool`
(pinned when CUDA is present and ``pinned: true``) and carves chunks out of it: a write is a memcpy into memory that
stays mapped once used (unpinned, in 2 MiB pages where the kernel allows them: a fresh 4 KiB page faults at a
fraction of memcpy speed), transfers to the GPU are DMA-able, and memory never grows. ``pool: true|false`` forces
the choice; smaller ones make one allocation per chunk. A pooled chunk occupies its tensors' bytes, each tensor
starting 64-byte aligned, rounded up to ``slot_size`` (default 64). A run of the pool is reused only once no reader
or borrower still copies from it. When fragmentation leaves no run long enough a write fails with ``ENOMEM`` and the
store evicts more.

A pool in shared memory (a node server's) starts each chunk with a 64-byte header whose first word is the
chunk's *stamp*: a number no other write of this backend gets, set once the chunk's bytes are in place and
zeroed (under the backend's lock) the moment the chunk is replaced, deleted or evicted — before its memory can
be reused. A client that remembers a chunk's place and stamp can therefore copy it straight out of the mapped
pool and trust the copy if the word still holds that stamp after it (``tierstore.serve.places``).
"""

from __future__ import annotations

import errno
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .. import objformat
from ..config import check_tier_options
from ..errors import ConfigError, InvalidInputError
from ..keys import ChunkKey
from ..objformat import ALIGN, validate_chunk
from ..pool import Extent, SlotPool
from ..tensors import TensorDict, copy_tensors, fill_out, nbytes, wait_for_copies
from .base import Backend, Capabilities, Chunk, Hit, Prepared, ReadResult, results_of

#: host backends at least this large preallocate a pool by default
POOL_MIN = 64 << 20


def _tensors(key: ChunkKey, chunk: Chunk) -> Mapping[str, torch.Tensor]:
    if isinstance(chunk, objformat.Encoded):  # an object read from a lower tier: its tensors, no copy
        if chunk.header.key != key:
            raise InvalidInputError(f"object holds key {chunk.header.key.hex()}, not {key.hex()}")
        return objformat.decode_encoded(chunk)
    validate_chunk(chunk)
    return chunk


class MemoryBackend(Backend):
    """Chunks as tensors on ``device``, one allocation per chunk (Python references keep memory a reader is
    still copying alive)."""

    capabilities = Capabilities(zero_copy=True)

    def __init__(self, name: str | None = None, device: str = "cpu", pinned: bool = False):
        self.name = name or self.kind or "memory"
        self.device = torch.device(device)
        self.pinned = pinned and self.device.type == "cpu" and torch.cuda.is_available()
        self._data: dict[ChunkKey, TensorDict] = {}
        self._lock = threading.Lock()

    def prepare(self, key: ChunkKey, chunk: Chunk) -> Prepared:
        tensors = _tensors(key, chunk)
        return Prepared(tensors, nbytes(tensors))

    def write_many(self, items: Sequence[tuple[ChunkKey, Prepared]]) -> list[BaseException | None]:
        return results_of(lambda item: self._write(*item), items)

    def _write(self, key: ChunkKey, prepared: Prepared) -> None:
        stored = copy_tensors(prepared.payload, self.device, pin_memory=self.pinned)
        with self._lock:
            self._data[key] = stored

    def read_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> list[ReadResult]:
        def one(key: ChunkKey) -> Hit | None:
            with self.borrow(key) as data:
                return None if data is None else Hit(copy_tensors(data, device), self._size(key, data))

        return results_of(one, keys)

    def read_into_many(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]) -> list[ReadResult]:
        def one(item: tuple[ChunkKey, Mapping[str, torch.Tensor]]) -> Hit | None:
            with self.borrow(item[0]) as data:
                return None if data is None else Hit(fill_out(item[1], data), self._size(item[0], data))

        return results_of(one, list(zip(keys, outs, strict=True)))

    def _size(self, key: ChunkKey, data: TensorDict) -> int:
        return nbytes(data)

    @contextmanager
    def borrow(self, key: ChunkKey) -> Iterator[TensorDict | None]:
        with self._lock:
            data = self._data.get(key)
        yield data

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[BaseException | None]:
        with self._lock:
            for key in keys:
                self._data.pop(key, None)
        return [None] * len(keys)

    def stat_many(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        with self._lock:
            return [None if (d := self._data.get(k)) is None else nbytes(d) for k in keys]

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "pinned": self.pinned}

    def close(self) -> None:
        with self._lock:
            self._data.clear()


class DeviceBackend(MemoryBackend):
    """The ``device`` tier: chunks resident on an accelerator (``cuda:N``); ``cpu`` works for tests."""

    kind = "device"

    def __init__(self, name: str | None = None, device: str = "cuda:0"):
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {device!r} requested but CUDA is not available (use device: cpu)")
        super().__init__(name, device=device)


#: bytes before a chunk's tensors in a shared pool (its stamp word, padded to the tensors' alignment)
HEADER = ALIGN


def _layout(tensors: Mapping[str, torch.Tensor], header: int = 0) -> tuple[list[tuple[str, int]], int]:
    offsets, pos = [], header
    for name, t in tensors.items():
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append((name, pos))
        pos += t.numel() * t.element_size()
    return offsets, pos


class HostBackend(MemoryBackend):
    """The ``host`` tier: chunks in host RAM, pooled when large enough (see the module docstring).

    Args:
        capacity: bytes to preallocate for the pool (the tier's capacity); ``None``: no pool, unbounded.
        pinned: pin the pool (page-locked, DMA-able) when CUDA is present.
        pool: force the pool on or off (default: on from :data:`POOL_MIN` bytes).
        slot_size: the pool's allocation unit (a positive multiple of 64).
        shared_memory: keep the pool in a sealed memfd (``pool.memfd``) that a node server hands its clients
            (sealed against writes but the server's; ``"writable"``: not, for a server with trusted writers).
    """

    kind = "host"

    def __init__(self, name: str | None = None, capacity: int | None = None, pinned: bool = True,
                 pool: bool | None = None, slot_size: int = 64, shared_memory: bool | str = False):
        opts = check_tier_options("host", {"capacity": capacity, "pinned": pinned, "pool": pool,
                                           "slot_size": slot_size, "shared_memory": shared_memory},
                                  where=f"host tier {name or self.kind!r}")
        super().__init__(name, device="cpu", pinned=pinned)
        capacity = opts["capacity"]
        use_pool = (capacity is not None and capacity >= POOL_MIN) if pool is None else pool
        self.pool: SlotPool | None = None
        if use_pool and capacity:
            slot_size = max(ALIGN, min(slot_size, capacity // ALIGN * ALIGN))  # a tiny pool still gets a slot
            self.pool = SlotPool(capacity, slot_size, pinned=self.pinned, shared=opts["shared_memory"])
            self.capacity = self.pool.capacity
        self._runs: dict[ChunkKey, Extent] = {}
        self._header = HEADER if self.pool is not None and self.pool.memfd is not None else 0
        #: the pool as 8-byte words (stamps are written through it), and per chunk its stamp
        self._words = None if not self._header else self.pool.buffer.view(torch.int64)  # type: ignore[union-attr]
        self._stamps: dict[ChunkKey, int] = {}
        self._writes, self._salt = 0, secrets.randbits(64)
        self._lent: dict[Extent, int] = {}  # runs being read or borrowed -> how many readers
        self._retired: set[Extent] = set()  # runs replaced or deleted while lent: freed by the last reader

    def prepare(self, key: ChunkKey, chunk: Chunk) -> Prepared:
        tensors = _tensors(key, chunk)
        if self.pool is None:
            return Prepared(tensors, nbytes(tensors))
        return Prepared(tensors, self.pool.size_for(_layout(tensors, self._header)[1]))

    def _write(self, key: ChunkKey, prepared: Prepared) -> None:
        if self.pool is None:
            return super()._write(key, prepared)
        payload = prepared.payload
        run, stored = self.reserve_run(key, payload, prepared.size)
        try:
            for name, dst in stored.items():
                t = payload[name]
                dst.copy_(t, non_blocking=t.device.type == "cuda")
            wait_for_copies(*payload.values())
        except BaseException:
            self.cancel_run(run)
            raise
        self.publish_run(key, run, stored)

    def reserved_size(self, like: Mapping[str, torch.Tensor]) -> int | None:
        """Bytes of the pool a chunk with tensors shaped like ``like`` takes; ``None`` without a pool (no
        reservations: such a tier is written with a put)."""
        return None if self.pool is None else self.pool.size_for(_layout(like, self._header)[1])

    def reserve_run(self, key: ChunkKey, like: Mapping[str, torch.Tensor], size: int
                    ) -> tuple[Extent, dict[str, torch.Tensor]]:
        """A run of ``size`` pool bytes for a new value of ``key`` with tensors shaped like ``like`` (any device,
        ``meta`` too), and those tensors as views of it, to be filled: no reader sees them before
        :meth:`publish_run`; :meth:`cancel_run` gives the run back. Raises ``ENOMEM`` when no run is free."""
        assert self.pool is not None
        run = self.pool.alloc(size) or self._reuse(key, size)
        if run is None:
            raise OSError(errno.ENOMEM, "host pool fragmented: no contiguous run free")
        buf = self.pool.view(run)
        views = {}
        for name, off in _layout(like, self._header)[0]:
            t = like[name]
            dst = buf[off:off + t.numel() * t.element_size()]
            views[name] = (dst.view(t.dtype) if t.dtype != torch.uint8 else dst).reshape(t.shape)
        return run, views

    def cancel_run(self, run: Extent) -> None:
        """Give back a run :meth:`reserve_run` handed out and that was never published."""
        assert self.pool is not None
        self.pool.free(run)

    def publish_run(self, key: ChunkKey, run: Extent, stored: dict[str, torch.Tensor]) -> None:
        """Make ``stored`` (views of ``run``, their bytes in place) ``key``'s value; its old run is freed once no
        reader holds it."""
        assert self.pool is not None
        with self._lock:
            old = self._runs.get(key)
            self._data[key], self._runs[key] = stored, run
            if self._words is not None:  # published only now that the bytes are in place
                self._stamps[key] = stamp = self._next_stamp()
                self._words[self._word_of(run)] = stamp
            if old is not None:
                self._free(old)

    def _reuse(self, key: ChunkKey, size: int) -> Extent | None:
        """The run of ``key``'s current value for its new one, when only that run is long enough and nobody
        reads it: its value is given up first (readers see a miss meanwhile, never a mix)."""
        assert self.pool is not None
        with self._lock:
            old = self._runs.get(key)
            if old is None or old in self._lent or old[1] < self.pool.slots_for(size):
                return None
            del self._runs[key], self._data[key]
            self._stamps.pop(key, None)
            self._free(old)
            return self.pool.alloc(size)  # the freed run is long enough: never None

    @contextmanager
    def borrow(self, key: ChunkKey) -> Iterator[TensorDict | None]:
        (data,), runs, _ = self.lend_many([key])
        try:
            yield data
        finally:
            self.give_back(runs)

    def lend_many(self, keys: Sequence[ChunkKey]
                  ) -> tuple[list[TensorDict | None], list[Extent], list[tuple[int, int] | None]]:
        """Each key's tensors (its own memory, ``None`` if not held), the pool runs now lent — none is reused,
        by an overwrite, a delete or an eviction, before :meth:`give_back` returns them — and in a shared pool
        each chunk's ``(stamp, byte offset of its stamp word)`` (else ``None``)."""
        runs: list[Extent] = []
        marks: list[tuple[int, int] | None] = [None] * len(keys)
        with self._lock:
            data = [self._data.get(k) for k in keys]
            if self.pool is not None:
                lent = self._lent
                for i, k in enumerate(keys):
                    run = self._runs.get(k)
                    if run is not None:
                        lent[run] = lent.get(run, 0) + 1
                        runs.append(run)
                        if self._words is not None:
                            marks[i] = (self._stamps[k], run[0] * self.pool.slot_size)
        return data, runs, marks

    def _next_stamp(self) -> int:
        """The next write's stamp (lock held): distinct for every write — an odd multiplier is a bijection
        modulo 2**64 — and spread over 64 bits, so chunk data is unlikely to hold it by chance; never 0."""
        while True:
            self._writes += 1
            v = (self._writes * 0x9E3779B97F4A7C15 + self._salt) % (1 << 64)
            if v:
                return v - (1 << 64) if v >= 1 << 63 else v  # as the signed word holds it

    def _word_of(self, run: Extent) -> int:
        assert self.pool is not None
        return run[0] * self.pool.slot_size // 8

    def give_back(self, runs: Sequence[Extent]) -> None:
        if not runs:
            return
        assert self.pool is not None
        with self._lock:
            lent = self._lent
            for run in runs:
                n = lent.pop(run) - 1
                if n:
                    lent[run] = n
                elif run in self._retired:
                    self._retired.discard(run)
                    self.pool.free(run)

    def _free(self, run: Extent) -> None:
        """Return ``run`` to the pool now, or when its last reader is done (lock held)."""
        assert self.pool is not None
        if self._words is not None:
            self._words[self._word_of(run)] = 0
        if run in self._lent:
            self._retired.add(run)
        else:
            self.pool.free(run)

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[BaseException | None]:
        if self.pool is None:
            return super().delete_many(keys)
        with self._lock:
            for key in keys:
                self._data.pop(key, None)
                self._stamps.pop(key, None)
                run = self._runs.pop(key, None)
                if run is not None:
                    self._free(run)
        return [None] * len(keys)

    def _size(self, key: ChunkKey, data: TensorDict) -> int:
        if self.pool is None:
            return nbytes(data)
        return self.pool.size_for(_layout(data, self._header)[1])

    def stat_many(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        if self.pool is None:
            return super().stat_many(keys)
        with self._lock:
            return [None if (r := self._runs.get(k)) is None else r[1] * self.pool.slot_size for k in keys]

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.pool is not None:
            out["pool_free_bytes"] = self.pool.free_slots() * self.pool.slot_size
        return out

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._runs.clear()
            if self.pool is not None:
                self.pool.close()
