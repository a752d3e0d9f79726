"""A store-backed range cache: fetched byte ranges of a checkpoint kept as content-addressed chunks.

A range is keyed by ``blake2b(source identity ‖ start ‖ end)``; the identity changes whenever the file
may have (an S3 ETag/size/mtime, a local size/mtime/inode, or the digest of a content-addressed object),
so a stale range is never served. Each range is stored as a one-tensor chunk ``{"bytes": uint8[n]}``.

The cache degrades rather than fails: a store error on ``get`` is a miss, on ``put`` a skipped write —
both are counted and logged once, and the load carries on from the source.
"""

from __future__ import annotations

import logging
import struct
import threading
from typing import TYPE_CHECKING

import torch

from ..errors import TierstoreError
from ..keys import ChunkKey
from .sources import Source

if TYPE_CHECKING:
    from ..api import Store

log = logging.getLogger(__name__)
_DOMAIN = b"tierstore.weights.range\0"
_VERIFIED = b"tierstore.weights.verified\0"
FIELD = "bytes"


class RangeCache:
    """Read-through cache of ``(source, range)`` → bytes in a tierstore ``store``.

    Args:
        store: any object with the store contract's ``get(key, out=...)`` and ``put(key, tensors)``.
        write: put missed ranges into the store (default True).
    """

    def __init__(self, store: Store, write: bool = True) -> None:
        self.store = store
        self.write = write
        self.hits = self.misses = self.errors = 0
        self.bytes_hit = self.bytes_missed = 0
        self._lock = threading.Lock()
        self._logged = False

    @staticmethod
    def key(source: Source, start: int, end: int) -> ChunkKey:
        """The chunk key of bytes ``[start, end)`` of ``source``'s current version."""
        ident = source.identity()
        return ChunkKey.from_bytes(_DOMAIN + struct.pack("<Q", len(ident)) + ident
                                   + struct.pack("<QQ", start, end))

    @staticmethod
    def _verified_key(source: Source, digest: str) -> ChunkKey:
        ident = source.identity()
        return ChunkKey.from_bytes(_VERIFIED + struct.pack("<Q", len(ident)) + ident + digest.encode())

    def verified(self, source: Source, digest: str) -> bool:
        """Whether a load through this store already checked this version of ``source`` against ``digest``
        (a version's identity changes whenever its bytes may have, so its check holds for it)."""
        out = torch.empty(len(digest), dtype=torch.uint8)
        try:
            got = self.store.get(self._verified_key(source, digest), out={FIELD: out})
        except (TierstoreError, OSError, RuntimeError) as exc:
            self._failed("get", exc)
            return False
        return got is not None and out.numpy().tobytes() == digest.encode()

    def mark_verified(self, source: Source, digest: str) -> None:
        """Remember that this version of ``source`` matched ``digest`` (later loads skip the check)."""
        if not self.write:
            return
        mark = torch.frombuffer(bytearray(digest.encode()), dtype=torch.uint8)
        try:
            self.store.put(self._verified_key(source, digest), {FIELD: mark})
        except (TierstoreError, OSError, RuntimeError) as exc:
            self._failed("put", exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            first, self._logged = not self._logged, True
        if first:
            log.warning("weights range cache: store %s failed (%s: %s); reading from the source",
                        what, type(exc).__name__, exc)

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Fill the 1-D uint8 ``out`` from the store; True on a hit, False on a miss (or store error)."""
        try:
            got = self.store.get(key, out={FIELD: out})
        except (TierstoreError, OSError, RuntimeError) as exc:
            self._failed("get", exc)
            got = None
        with self._lock:
            if got is None:
                self.misses += 1
                self.bytes_missed += out.numel()
            else:
                self.hits += 1
                self.bytes_hit += out.numel()
        counters = getattr(self.store, "counters", None)  # the store's metrics: weight bytes by origin
        if counters is not None:
            origin = "source" if got is None else "cache"
            counters.add("weights_bytes", out.numel(), origin)
            counters.add("weights_ranges", 1, origin)
        return got is not None

    def put(self, key: ChunkKey, data: torch.Tensor) -> None:
        """Store ``data`` (1-D uint8, CPU) under ``key``; never raises for a store-side failure."""
        if not self.write:
            return
        try:
            self.store.put(key, {FIELD: data})
        except (TierstoreError, OSError, RuntimeError) as exc:
            self._failed("put", exc)

    def read_into(self, source: Source, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` with ``source[offset : offset + len(out)]``, from the store when it holds it."""
        key = self.key(source, offset, offset + out.numel())
        if self.get_into(key, out):
            return
        source.read_into(offset, out.numpy().data)
        self.put(key, out)

    def read(self, source: Source, offset: int, length: int) -> bytes:
        out = torch.empty(length, dtype=torch.uint8)
        self.read_into(source, offset, out)
        return out.numpy().tobytes()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cache_hits": self.hits, "cache_misses": self.misses, "cache_errors": self.errors,
                    "cache_bytes_hit": self.bytes_hit, "cache_bytes_missed": self.bytes_missed}


def read_bytes(source: Source, offset: int, length: int, cache: RangeCache | None) -> bytes:
    """Read a small range (a header, an index file), through ``cache`` when there is one."""
    if cache is None:
        return source.read(offset, length)
    return cache.read(source, offset, length)
