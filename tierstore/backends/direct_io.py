"""Direct I/O (``O_DIRECT``) of whole chunk payloads on a local file system: no page-cache copy.

A buffered read or write of a multi-MiB payload costs the kernel a copy through the page cache (and, for a
write, dirty pages to flush later), CPU an engine's prefill competes for. With ``O_DIRECT`` the device moves
the bytes to or from the caller's memory itself. It needs every buffer's address and length, and the file
offset, to be multiples of :data:`BLOCK`: objects written for it have their header padded to a block
(:func:`tierstore.objformat.encode`'s ``payload_align``), and vLLM's CPU-tier chunks are page-aligned. Where
anything is not aligned, or the file system refuses direct I/O (tmpfs, some FUSE mounts: ``EINVAL``), the
caller reads or writes buffered instead.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..iov import preadv_all, writev_all

#: alignment of addresses, lengths and offsets (a page: the logical block size of every device is at most that)
BLOCK = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def address(view: memoryview) -> int:
    """The address of ``view``'s first byte (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def aligned(views: Sequence[memoryview]) -> bool:
    """Whether every view starts and ends on a :data:`BLOCK` boundary (and there is at least one)."""
    return bool(views) and all(len(v) and not len(v) % BLOCK and not address(v) % BLOCK for v in views)


def set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; whether it is now as asked (``False`` where unsupported)."""
    if not O_DIRECT:
        return not on
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
    except OSError:
        return False
    return True


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buffer = mmap.mmap(-1, BLOCK)  # anonymous memory is page-aligned


_scratch = _Scratch()


def aligned_copy(data: Any) -> memoryview:
    """``data`` (a multiple of :data:`BLOCK` long) copied into this thread's page-aligned scratch memory."""
    n = memoryview(data).nbytes
    if len(_scratch.buffer) < n:
        _scratch.buffer = mmap.mmap(-1, n)
    view = memoryview(_scratch.buffer)[:n]
    view[:] = memoryview(data).cast("B")
    return view


def write_object(fd: int, parts: Sequence[Any]) -> None:
    """Write an encoded object's ``parts`` to the empty file ``fd``: directly when its header region fills whole
    blocks and its payload is block-aligned in memory, else (or when the file system refuses) buffered, with
    no joined copy (:func:`~tierstore.iov.writev_all`)."""
    views = [memoryview(p).cast("B") for p in parts]
    if len(views) > 1 and not len(views[0]) % BLOCK and aligned(views[1:]) and set_direct(fd, True):
        try:
            writev_all(fd, [aligned_copy(views[0]), *views[1:]])
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        set_direct(fd, False)  # refused after all: write it again, buffered
    writev_all(fd, views)


def read_payload(fd: int, segments: Sequence[memoryview], offset: int) -> int | None:
    """Read a payload at block-aligned ``offset`` directly into block-aligned ``segments``: the bytes read, or
    ``None`` (nothing read) when direct I/O cannot be used here: unaligned, or refused by the file system. Leaves
    ``fd`` buffered."""
    if offset % BLOCK or not aligned(segments) or not set_direct(fd, True):
        return None
    try:
        return preadv_all(fd, segments, offset)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None
    finally:
        set_direct(fd, False)
