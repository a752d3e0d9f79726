"""Reading chunk objects from local files (the disk tier, and remote tiers on a local or shared mount).

A reader trusts neither the path nor the bytes: :func:`open_object` never follows a symlink and never
blocks (a FIFO, socket or directory where an object should be is a :class:`CorruptObjectError`, not a
hang), :func:`read_header` reads only the prefix and header and checks the sizes they claim against the
file's real size, and :func:`read_object` allocates exactly that size only then, hashing the bytes piece
by piece as they arrive. So a sparse 64 GiB file with a small header costs one header read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from .. import objformat
from ..errors import CorruptObjectError
from ..iov import read_into
from ..keys import ChunkKey
from ..tensors import TensorDict

#: how objects are opened: read-only, never following a symlink, never blocking on a FIFO
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
#: and without an access-time update (nothing here reads atime; the LRU order is kept in mtime). The first read
#: of a freshly written object would otherwise dirty its inode: 256 KiB reads ran ~40% slower on ext4 with relatime
_NOATIME = getattr(os, "O_NOATIME", 0)


def open_for_read(path: str) -> int:
    """``os.open(path)`` with :data:`OPEN_FLAGS`, without touching atime where the file is ours (``O_NOATIME``
    is refused with ``EPERM`` on other users' files, which are then opened plainly)."""
    if _NOATIME:
        try:
            return os.open(path, OPEN_FLAGS | _NOATIME)
        except PermissionError:
            pass
    return os.open(path, OPEN_FLAGS)
#: the first read of an object: its prefix and header, and all of a small object
HEAD_READ = 64 << 10


def open_object(path: str) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only as a regular file: ``(fd, fstat)``.

    Raises:
        FileNotFoundError: nothing there.
        CorruptObjectError: a symlink, FIFO, socket, directory or device sits where an object should be.
        OSError: any other I/O failure.
    """
    try:
        fd = open_for_read(path)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):  # a symlink; a socket
            raise CorruptObjectError(f"{path} is not a regular file ({os.strerror(exc.errno)})") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptObjectError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_header(fd: int, st: os.stat_result, key: ChunkKey, first: int = HEAD_READ) -> tuple[bytes, objformat.Header]:
    """Read and validate the prefix and header of the open object: ``(bytes read, header)``.

    At most ``first`` bytes, or the header's length when it is longer (capped by the format); the object
    size the header implies must equal the file's size.
    """
    head = os.pread(fd, min(st.st_size, first), 0)
    hlen = objformat.header_length(head)
    if objformat.PREFIX_SIZE + hlen > len(head):
        if objformat.PREFIX_SIZE + hlen > st.st_size:
            raise CorruptObjectError(f"header length {hlen} runs past the {st.st_size}-byte file")
        head += os.pread(fd, objformat.PREFIX_SIZE + hlen - len(head), len(head))
    return head, objformat.parse_header(head, key, object_size=st.st_size)


def read_object(fd: int, st: os.stat_result, key: ChunkKey) -> TensorDict:
    """Read, verify and decode the whole open object: its tensors (views over one fresh buffer when
    uncompressed).

    Raises:
        CorruptObjectError: damaged (header, size, checksum).
        UnsupportedObjectError: intact, but this reader cannot represent it.
        MemoryError: the object does not fit in memory now.
    """
    buf, hdr, _ = read_verified(fd, st, key)
    hdr.require_supported()
    payload = buf[hdr.payload_offset:]
    if hdr.codec == "zstd":
        payload = objformat.decompress(buf.numpy().data[hdr.payload_offset:], hdr)
    return objformat.tensors_from_payload(payload, hdr)


def read_encoded(fd: int, st: os.stat_result, key: ChunkKey) -> objformat.Encoded:
    """The whole open object, verified but not decoded (what another tier that stores objects writes as is)."""
    buf, hdr, _ = read_verified(fd, st, key)
    return objformat.Encoded.of_object(buf, hdr)


def read_verified(fd: int, st: os.stat_result, key: ChunkKey, mac_for: Callable[[objformat.Header, memoryview], Any]
                  | None = None) -> tuple[torch.Tensor, objformat.Header, Any]:
    """Read the whole open object into one fresh uint8 buffer, checking header, size and checksum on the way:
    ``(buffer, header, mac)``. Raises as :func:`read_object` (not :class:`UnsupportedObjectError`: nothing is
    decoded).

    ``mac_for(header, bytes before the payload)`` may return a hasher (a sealed object's MAC, primed): the
    payload is then fed to it as it is read, while in cache, instead of the checksum, and it comes back as
    ``mac`` for the caller to check; otherwise ``mac`` is None and the checksum was checked."""
    head, hdr = read_header(fd, st, key)
    buf = objformat.alloc_bytes(st.st_size)
    mv = buf.numpy().data if st.st_size else memoryview(bytearray(0))
    mv[:len(head)] = head
    mac = mac_for(hdr, mv[:hdr.payload_offset]) if mac_for is not None else None
    if mac is not None:
        h = mac
        h.update(mv[hdr.payload_offset:len(head)])
    else:
        h = xxhash.xxh3_128(memoryview(head)[objformat.PREFIX_SIZE:])
    os.lseek(fd, len(head), os.SEEK_SET)
    got = len(head) + read_into(fd, [mv[len(head):]], h)
    if got != st.st_size:
        raise CorruptObjectError(f"short read: {got} of {st.st_size} bytes")
    if mac is None and h.digest() != head[16:32]:
        raise CorruptObjectError(f"checksum mismatch for {key.hex()}")
    return buf, hdr, mac

