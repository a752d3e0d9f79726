"""The disk tier's batched read path: many objects straight into caller-owned tensors.

Per object: ``open`` (``O_NOFOLLOW``), ``fstat`` (a regular file of exactly the size its header
states), then one pass of ``readv`` calls from offset 0 that land the prefix and header in a small
scratch buffer and the payload directly in the caller's tensors, hashing each ~256 KiB step while it is
still in cache. The checksum is compared before the result is returned (on a mismatch the object is a
corrupt miss and ``out`` holds unspecified bytes).

**Parsed-header fast path.** A header is parsed and validated once and, after its object's checksum
passed, remembered (bounded LRU) with its exact bytes; a later read of that key plans its ``readv``
from the remembered layout and only compares the bytes it read into the scratch buffer with the
remembered ones — any difference (the file was replaced) falls back to the full, validating read. When
``out`` does not match the header, the disk tier's checked path decides (checksum first, then
:class:`~tierstore.InvalidInputError`).

Work is split into one slice per I/O thread (not one task per object), so a batch of small objects
costs a few pool hand-offs rather than one per object.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import xxhash

from .. import objformat
from ..errors import CorruptObjectError, InvalidInputError
from ..iov import read_into
from ..keys import ChunkKey
from ..tensors import TensorDict
from . import objfile

if TYPE_CHECKING:
    from .disk import DiskTier

#: remembered headers (a few hundred bytes each)
HEADER_CACHE = 16384

Work = tuple[ChunkKey, int, Mapping[str, torch.Tensor]]


def _raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU ``t`` as a writable memoryview (any dtype, bfloat16 included)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class BatchedReader:
    """Reads batches of objects of one :class:`~tierstore.tiers.disk.DiskTier` into ``out`` tensors."""

    def __init__(self, tier: DiskTier):
        self.tier = tier
        self._headers: OrderedDict[ChunkKey, tuple[bytes, objformat.Header]] = OrderedDict()
        self._lock = threading.Lock()
        from .disk import _matches  # the disk tier's own out-vs-header check (imported once it exists)

        self._matches = _matches

    def load_many_into(self, work: list[Work]) -> list[TensorDict | InvalidInputError | None]:
        tier = self.tier
        slices = [list(range(i, len(work), tier.io_threads)) for i in range(min(tier.io_threads, len(work)))]
        results: list[TensorDict | InvalidInputError | None] = [None] * len(work)

        def run(indices: list[int]) -> None:
            for i in indices:
                key, size, out = work[i]
                try:
                    results[i] = tier._load_checked(key, size, "cpu", out=out, reader=self._reader(key, size, out))
                except InvalidInputError as exc:
                    results[i] = exc

        tier._map(run, slices)
        return results

    def _reader(self, key: ChunkKey, size: int, out: Mapping[str, torch.Tensor]) -> Callable[[], TensorDict | None]:
        return lambda: self.read_into(key, size, out)

    def read_into(self, key: ChunkKey, size: int, out: Mapping[str, torch.Tensor]) -> TensorDict | None:
        """One object into ``out``; raises like :meth:`DiskTier._load_into`."""
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in out.values()):
            return self.tier._load_into(key, size, out)
        with self._lock:
            known = self._headers.get(key)
            if known is not None:
                self._headers.move_to_end(key)
        fd, st = objfile.open_object(self.tier._object_path(key))  # never a symlink, FIFO or directory
        try:
            if known is not None and known[1].object_size == st.st_size:
                raw, hdr = known
            else:
                head, hdr = objfile.read_header(fd, st, key)  # sizes checked against the file's
                raw = bytes(head[:hdr.payload_offset])
            if hdr.codec != "none" or not self._matches(out, hdr):
                return self.tier._load_into(key, size, out)  # the checked slow path decides
            scratch = bytearray(hdr.payload_offset)  # prefix and header land here, the payload in out
            segments = [memoryview(scratch), *payload_segments(out, hdr)]
            h = xxhash.xxh3_128()
            got = read_into(fd, segments, h, skip=objformat.PREFIX_SIZE)
            if got != hdr.object_size:
                raise CorruptObjectError(f"short read: {got} of {hdr.object_size} bytes")
            if scratch != raw:  # replaced since its header was remembered: read it the careful way
                with self._lock:
                    self._headers.pop(key, None)
                return self.tier._load_into(key, size, out)
            if h.digest() != raw[16:32]:
                raise CorruptObjectError(f"checksum mismatch for {key.hex()}")
            if known is None or known[0] is not raw:  # remember a header only once its object verified
                with self._lock:
                    self._headers[key] = (raw, hdr)
                    while len(self._headers) > HEADER_CACHE:
                        self._headers.popitem(last=False)
            self.tier._touch(fd, st)
        finally:
            os.close(fd)
        return dict(out)

    def forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._headers.pop(key, None)


def payload_segments(out: Mapping[str, torch.Tensor], hdr: objformat.Header) -> list[memoryview]:
    """Buffers covering the raw payload in order: each tensor's bytes in ``out`` (contiguous CPU tensors
    matching ``hdr``), scratch for gaps. Shared by the single and batched disk reads."""
    segments: list[memoryview] = []
    pos = 0
    for s in hdr.tensors:
        if s.offset > pos:
            segments.append(memoryview(bytearray(s.offset - pos)))
        if s.nbytes:
            segments.append(_raw_view(out[s.name]))
        pos = s.offset + s.nbytes
    if hdr.raw_size > pos:
        segments.append(memoryview(bytearray(hdr.raw_size - pos)))
    return segments
