"""Byte sources: a local file read with ``os.preadv`` or any fsspec file read with ranged requests.

Every source reads *into caller memory* (``read_into``/``readv_into``) so the loader can land bytes in
preallocated buffers or straight into a model's parameters. Sources are thread-safe: the loader calls
them from many threads at once (``preadv`` has no file position to share; s3fs multiplexes concurrent
ranged GETs over its connection pool). Each source also has an ``identity`` — the bytes that change
when the file changes (ETag/size/mtime) — from which range-cache keys are derived.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from typing import Any

from ..iov import preadv_all
from .header import CheckpointError

log = logging.getLogger("tierstore.weights")


class Source(ABC):
    """A read-only, random-access byte source of known size.

    Attributes:
        name: path or URL, used in error messages.
        size: total size in bytes.
        remote: True when reads cross a network (the loader then stages ranges and may cache them).
        reads / bytes_read: counters of reads issued against the underlying file or object.
    """

    name: str
    size: int
    remote: bool = False

    def __init__(self) -> None:
        self.reads = 0
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    @abstractmethod
    def identity(self) -> bytes:
        """Bytes that identify this version of the file (change whenever its content may have)."""

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointError` if the name now leads to another version than the one being read
        (reads check the rest themselves: S3 ``If-Match``, size/mtime re-checks)."""

    @abstractmethod
    def _read(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` (consecutive, writable) from ``offset``; raise CheckpointError on short data."""

    def readv_into(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill the consecutive buffers ``bufs`` with the bytes starting at ``offset``.

        Raises:
            CheckpointError: the file ended early (truncated or changed while being read).
        """
        total = sum(len(b) for b in bufs)
        if offset < 0 or offset + total > self.size:
            raise CheckpointError(self.name, f"read [{offset}, {offset + total}) is outside the "
                                             f"{self.size}-byte file")
        if total == 0:
            return
        self._read(offset, bufs)
        with self._count_lock:
            self.reads += 1
            self.bytes_read += total

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with ``len(buf)`` bytes starting at ``offset``."""
        self.readv_into(offset, [buf])

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (for headers and index files; data goes through read_into)."""
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        """Release the file handle; idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self.size})"


class LocalFileSource(Source):
    """A local (or mounted: NFS, Lustre ...) file read with ``os.preadv`` into caller buffers."""

    def __init__(self, path: str):
        super().__init__()
        self.name = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(self._fd)
        self.size = st.st_size
        self._version = _file_version(st)
        # ctime too: a rewrite in place whose mtime was set back still changes it
        self._identity = (f"file\0{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
                          f"\0{st.st_ctime_ns}").encode()

    def identity(self) -> bytes:
        return self._identity

    def _read(self, offset: int, bufs: list[memoryview]) -> None:
        got = preadv_all(self._fd, bufs, offset)
        if got < sum(memoryview(b).nbytes for b in bufs):
            raise CheckpointError(self.name, f"truncated: read at offset {offset + got} returned no data "
                                             f"(file changed while loading?)")
        # A file replaced by rename keeps serving the version we opened; one rewritten in place shows a
        # new size or mtime: refuse rather than hand out (or cache) a mix of two versions.
        if _file_version(os.fstat(self._fd)) != self._version:
            raise CheckpointError(self.name, "changed while being loaded (rewritten in place)")

    def check_unchanged(self) -> None:
        # a file replaced by rename keeps serving the version opened here: compare it with the path's
        try:
            st = os.stat(self.name)
        except FileNotFoundError:
            raise CheckpointError(self.name, "removed while being loaded") from None
        opened = os.fstat(self._fd)
        if (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino) or _file_version(st) != self._version:
            raise CheckpointError(self.name, "replaced while being loaded (renamed over): the checkpoint "
                                             "changed during the load; load it again")

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class FsspecSource(Source):
    """A file on any fsspec filesystem (S3, GCS, HTTP, memory ...) read with ranged requests."""

    remote = True

    def __init__(self, fs: Any, path: str, info: dict[str, Any] | None = None):
        super().__init__()
        self.fs = fs
        self.path = path
        protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.name = f"{protocol}://{path}" if protocol not in ("file", "local") else path
        self._pinned = None
        if type(fs).__module__.startswith("s3fs"):
            # s3fs sends If-Match: <the ETag it saw at open> with every ranged GET of this handle, so a
            # replaced object fails the read (412) instead of mixing versions
            self._pinned = fs.open(path, "rb", cache_type="none")
            info = self._pinned.details
        info = info if info is not None else fs.info(path)
        self.size = int(info["size"])
        self._version = _object_version(info)
        if self._pinned is None and not any(self._version[1:]):
            log.warning("%s: this filesystem reports no ETag or modification time, so a replacement of the same "
                        "size during the load cannot be detected (only a size change is)", self.name)
        self._identity = f"{self.name}\0{self.size}\0{self._version[1]}\0{self._version[2]}".encode()

    def identity(self) -> bytes:
        return self._identity

    def _read(self, offset: int, bufs: list[memoryview]) -> None:
        total = sum(len(b) for b in bufs)
        if self._pinned is not None:
            try:
                data = self._pinned._fetch_range(offset, offset + total)
            except OSError as exc:
                if type(exc).__name__ == "FileExpired":
                    raise CheckpointError(self.name, "replaced while being loaded (its ETag changed)") from None
                raise
        else:  # no conditional reads: check the version after each read instead
            data = self.fs.cat_file(self.path, start=offset, end=offset + total)
            self.fs.invalidate_cache(self.path)
            if _object_version(self.fs.info(self.path)) != self._version:
                raise CheckpointError(self.name, "replaced while being loaded (size, ETag or mtime changed)")
        if len(data) != total:
            raise CheckpointError(self.name, f"truncated: ranged read [{offset}, {offset + total}) "
                                             f"returned {len(data)} bytes")
        pos = 0
        for b in bufs:
            b[:] = data[pos:pos + len(b)]
            pos += len(b)

    def check_unchanged(self) -> None:
        # the reads read ahead: a replacement after the last one shows only in the name's version now
        if self._pinned is None:
            self.fs.invalidate_cache(self.path)
            if _object_version(self.fs.info(self.path)) != self._version:
                raise CheckpointError(self.name, "replaced while being loaded (size, ETag or mtime changed): "
                                                 "load it again")

    def close(self) -> None:
        pinned, self._pinned = self._pinned, None
        if pinned is not None:
            pinned.close()


def _file_version(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _object_version(info: dict[str, Any]) -> tuple[int, str, str]:
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""
    # memory:// has only "created", which a replacement renews
    mtime = info.get("LastModified") or info.get("mtime") or info.get("updated") or info.get("created") or ""
    if hasattr(mtime, "timestamp"):  # a datetime from info(), a float from the listing: the same instant
        mtime = mtime.timestamp()
    return int(info["size"]), str(etag), str(mtime)


def is_local(uri: str) -> bool:
    """True for a plain path or a ``file://`` URL."""
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else os.path.expanduser(uri)


def filesystem(uri: str, storage_options: dict[str, Any] | None, concurrency: int) -> tuple[Any, str]:
    """``(fs, path)`` for an fsspec URL; S3 gets a connection pool as large as ``concurrency``."""
    import fsspec

    opts = dict(storage_options or {})
    if uri.startswith(("s3://", "s3a://")):
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("max_pool_connections", max(10, concurrency))
        opts["config_kwargs"] = cfg
    fs, path = fsspec.core.url_to_fs(uri, **opts)
    return fs, path
