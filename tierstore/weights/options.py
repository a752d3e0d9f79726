"""Loader options: defaults (measured, see docs/weights.md) and validation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidInputError
from ..sizes import parse_size

# Measured on this project's dev VM (virtio disk, 2 vCPUs; docs/weights.md): local files load best with
# a few large reads in flight (the kernel's readahead keeps each stream sequential), object stores with
# many 16 MiB ranged GETs (S3 serves ~90 MB/s per connection).
LOCAL_BLOCK_SIZE = 64 * 1024 * 1024
REMOTE_BLOCK_SIZE = 16 * 1024 * 1024
DEFAULT_MEMORY_LIMIT = 1024 * 1024 * 1024
LOCAL_CONCURRENCY = 8
REMOTE_CONCURRENCY = 16
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HOST_ALIGN = 64


@dataclass
class Options:
    """Validated loader options (see :func:`tierstore.weights.iter_tensors`)."""

    names: Iterable[str] | Callable[[str], bool] | None = None
    concurrency: int | None = None
    block_size: int | None = None  # build() also takes a size string; the loader fills in the default
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    dtype: torch.dtype | None = None
    max_header_size: int | None = None
    stats: dict[str, Any] | None = None
    cache_writes: bool = True
    verify: bool = True
    objects_url: str | list[str] | tuple[str, ...] | None = None
    #: called as ``progress(bytes_done, bytes_total)`` each time a group of tensors has landed
    progress: Callable[[int, int], None] | None = None

    @classmethod
    def build(cls, opts: dict[str, Any]) -> Options:
        unknown = set(opts) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidInputError(f"unknown option(s) {sorted(unknown)}; known: "
                                    f"{sorted(cls.__dataclass_fields__)}")
        o = cls(**opts)
        if o.block_size is not None:
            o.block_size = parse_size(o.block_size, key="block_size")
        o.memory_limit = parse_size(o.memory_limit, key="memory_limit")
        if o.block_size is not None and o.block_size < 1:
            raise InvalidInputError("block_size must be positive")
        if o.concurrency is not None and (not isinstance(o.concurrency, int) or o.concurrency < 1):
            raise InvalidInputError(f"concurrency must be a positive int, got {o.concurrency!r}")
        if o.objects_url is not None and not (isinstance(o.objects_url, str) or (
                isinstance(o.objects_url, (list, tuple)) and all(isinstance(u, str) for u in o.objects_url))):
            raise InvalidInputError(f"objects_url must be a URL or a list of URLs, got {o.objects_url!r}")
        if o.progress is not None and not callable(o.progress):
            raise InvalidInputError(f"progress must be a callable(done, total), got {o.progress!r}")
        if not isinstance(o.verify, bool):
            raise InvalidInputError(f"verify must be True or False, got {o.verify!r}")
        if o.dtype is not None and o.dtype not in CASTABLE:
            raise InvalidInputError(f"dtype must be one of {CASTABLE}, got {o.dtype!r}")
        return o
