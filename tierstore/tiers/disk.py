"""The ``disk`` tier: one checksummed object file per chunk in a local directory.

Layout under ``path``::

    .lock            flock'ed by the owning process; holds "<pid> <hostname>"
    tmp/             objects being written (unique names; whatever is left here at open is removed)
    00/ … ff/        finished objects, ``<2 hex>/<64 hex>.tso`` (see :mod:`tierstore.tiers.layout`)

A put encodes the chunk (:mod:`tierstore.objformat`), writes it to a temp file with ``writev`` and
renames it into place, so a reader sees the whole object or nothing; ``durable=True`` adds an fsync of
the file before the rename and of its folder after. A get reads the whole file into one fresh uint8
tensor and returns views over it after checking the header's key and the checksum (hashed piecewise as
it is read). :meth:`DiskTier._load_into` reads the payload straight into caller-owned tensors instead:
no allocation, which matters because first-touch page faults on fresh memory cost more than the read.
The index is rebuilt on open by listing the 256 folders (sizes from ``stat``, LRU order from mtime; a
hit refreshes mtime at most once a second). Files that are not ours are listed past and left alone.

A directory belongs to one process at a time: ``fcntl.flock`` on ``.lock``, released by :meth:`close`
or by the kernel when the process dies (the descriptor is close-on-exec, but a ``fork``ed child shares
it until it exits). ``read_only=True`` opens without the lock (an inspector beside a running engine): it
lists, serves gets, sees objects the owner adds later, and refuses writes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from .. import objformat
from ..errors import ClosedError, ConfigError, CorruptObjectError, InvalidInputError, LockedError
from ..keys import ChunkKey
from ..iov import IOV_MAX, advance
from ..tensors import TensorDict, byte_alias, fill_out
from .base import Tier
from .layout import TMP_SUFFIX, key_from_name, object_relpath

log = logging.getLogger("tierstore")

LOCK_NAME = ".lock"
TMP_DIR = "tmp"
_HEX = "0123456789abcdef"
_FANOUT = [a + b for a in _HEX for b in _HEX]
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: reads are hashed in steps of this size (L2-sized: the bytes are hashed while still in cache)
_PIECE = 256 << 10
#: a hit refreshes the file's mtime (the LRU order after a restart) at most this often
_TOUCH_EVERY_NS = 1_000_000_000


class ReadOnlyError(InvalidInputError):
    """A write (put, delete) was attempted on a disk tier opened with ``read_only=True``."""


def _writev_all(fd: int, bufs: Sequence) -> int:
    """Write every buffer in order; loops on partial writes and batches by IOV_MAX. Returns bytes written."""
    views = [mv for mv in (memoryview(b).cast("B") for b in bufs) if len(mv)]
    total, i = 0, 0
    while i < len(views):
        n = os.writev(fd, views[i:i + IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        total += n
        i = advance(views, i, n)
    return total


def _read_into(fd: int, bufs: Sequence, hasher=None, skip: int = 0) -> int:
    """Fill ``bufs`` in order from the current position; returns the bytes read (short only at EOF).

    Reads go in steps of about :data:`_PIECE` bytes and each step is hashed (after the first ``skip``
    bytes of the stream) right away, while it is still in cache: checksumming then costs little on top of
    the read itself, where hashing a whole multi-MiB buffer afterwards would stream it from RAM again.
    """
    views = [mv for mv in (memoryview(b).cast("B") for b in bufs) if len(mv)]
    total, i, off = 0, 0, 0
    while i < len(views):
        batch, room, j, o = [], _PIECE, i, off
        while j < len(views) and room > 0 and len(batch) < IOV_MAX:
            take = min(len(views[j]) - o, room)
            batch.append(views[j][o:o + take])
            room -= take
            j, o = (j + 1, 0) if o + take == len(views[j]) else (j, o + take)
        n = os.readv(fd, batch)
        if n == 0:
            break  # end of file
        for b in batch:
            if n <= 0:
                break
            m = min(len(b), n)
            if hasher is not None:
                if skip >= m:
                    skip -= m
                else:
                    hasher.update(b[skip:m])
                    skip = 0
            n -= m
            total += m
            off += m
            if off == len(views[i]):
                i, off = i + 1, 0
    return total


class DiskTier(Tier):
    """Chunks as object files under ``path`` (created if missing; ``~`` is expanded).

    Args:
        name: tier name (default ``"disk"``).
        capacity: bytes the objects may occupy (their exact file sizes); ``None`` = unbounded, until
            the filesystem fills up (then the tier adopts what it holds as its capacity).
        path: the directory. An unusable path raises :class:`~tierstore.ConfigError` naming it.
        durable: fsync each object and its folder before a put returns (off: a torn file after a power
            loss fails its checksum and is a miss).
        read_only: open without the lock and refuse writes (:class:`ReadOnlyError`).
        codec: ``"none"`` (reads are zero-copy views) or ``"zstd"``.
        io_threads: batched calls (``get_many``, ``put_many``) read and write up to this many objects at
            once (a queue depth for NVMe); 1 = serial. Single-key calls always run on the caller's thread.

    Raises:
        LockedError: another process (or another open tier in this one) holds the directory; the
            message names the holder's pid and host.
    """

    kind = "disk"

    def __init__(self, name: str | None = None, capacity: int | None = None, path: str | os.PathLike | None = None,
                 durable: bool = False, read_only: bool = False, codec: str = "none", io_threads: int = 4):
        super().__init__(name, capacity)
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1:
            raise ConfigError(f"disk tier io_threads must be a positive int, got {io_threads!r}")
        if path is None or not str(path):
            raise ConfigError("disk tier: 'path' is required")
        if codec not in objformat.CODECS:
            raise ConfigError(f"disk tier codec: {codec!r} is not one of {' | '.join(objformat.CODECS)}")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.durable = bool(durable)
        self.read_only = bool(read_only)
        self.codec = codec
        self._tmp = os.path.join(self.path, TMP_DIR)
        self._lock_fd: int | None = None
        self.io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._worker = threading.local()
        if read_only:
            if not os.path.isdir(self.path):
                raise ConfigError(f"disk tier path {self.path!r} does not exist "
                                  "(a read_only tier opens an existing directory)")
        else:
            self._create_dirs()
            self._lock_fd = self._acquire_lock()
        try:
            self._rebuild_index()
        except BaseException:
            self._close()
            raise

    # ------------------------------------------------------------------ open: dirs, lock, index
    def _create_dirs(self) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
            for sub in (TMP_DIR, *_FANOUT):
                try:
                    os.mkdir(os.path.join(self.path, sub))
                except FileExistsError:
                    pass
        except OSError as exc:
            raise ConfigError(f"disk tier path {self.path!r} is not a writable directory: {exc}") from None

    def _acquire_lock(self) -> int:
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise ConfigError(f"disk tier path {self.path!r}: cannot open {LOCK_NAME}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                holder = os.pread(fd, 256, 0).decode(errors="replace").split()
            except OSError:
                holder = []
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"disk tier path {self.path!r}: cannot lock {LOCK_NAME}: {exc}") from None
            who = (f"pid {holder[0]} on host {holder[1] if len(holder) > 1 else '?'}" if holder
                   else "another process")
            raise LockedError(errno.EWOULDBLOCK,
                              f"disk tier directory {self.path!r} is in use by {who}; a directory belongs to "
                              "one process at a time (open it with read_only=True to inspect it)") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the lock itself is what counts; the note is for humans
        return fd

    def _rebuild_index(self) -> None:
        """List the fan-out folders: register objects (oldest mtime first), drop stale temp files."""
        found: list[tuple[int, str, ChunkKey, int]] = []
        stale: list[str] = []
        if not self.read_only:
            stale += [e.path for e in _scandir(self._tmp)]
        for sub in _FANOUT:
            for entry in _scandir(os.path.join(self.path, sub)):
                if entry.name.endswith(TMP_SUFFIX):
                    stale.append(entry.path)
                    continue
                key = key_from_name(entry.name)
                if key is None or object_relpath(key) != f"{sub}/{entry.name}":
                    continue  # not ours (or not where we would look for it): leave it alone
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append((st.st_mtime_ns, entry.name, key, st.st_size))
        if not self.read_only:
            for p in stale:
                _unlink_quietly(p)
        found.sort()
        with self._cond:
            for _, _, key, size in found:
                self._index_add(key, size)
        if stale or found:
            log.debug("tier %s: indexed %d objects (%d bytes) under %s, removed %d temp files",
                      self.name, len(found), self.used_bytes, self.path, len(stale))
        if not self.read_only and self.capacity is not None and self.used_bytes > self.capacity:
            self._trim_to_capacity()

    def _trim_to_capacity(self) -> None:
        """The directory holds more than the (lowered) capacity: drop least-recently-used objects."""
        with self._cond:
            victims = []
            excess = self._lru.currsize - self.capacity
            for k in list(self._lru.victims()):
                if excess <= 0:
                    break
                excess -= self._lru.remove(k)
                self._counts["evictions"] += 1
                victims.append(k)
        for k in victims:
            try:
                self._drop(k)
            except OSError as exc:
                self._log_once("drop", "could not remove %s: %s", k.hex(), exc)

    # ------------------------------------------------------------------ data plane
    def _object_path(self, key: ChunkKey) -> str:
        return os.path.join(self.path, object_relpath(key))

    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> tuple[objformat.Encoded, int]:
        if self.read_only:
            raise ReadOnlyError(f"disk tier {self.name!r} at {self.path!r} is read-only")
        enc = objformat.encode(key, tensors, self.codec)
        return enc, enc.size

    def _store(self, key: ChunkKey, payload: objformat.Encoded, size: int) -> None:
        final = self._object_path(key)
        tmp = os.path.join(self._tmp, f"{key.hex()}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        fd = self._open_new(tmp)
        try:
            try:
                written = _writev_all(fd, payload.parts)
                if written != size:
                    raise RuntimeError(f"encoded object is {written} bytes, expected {size}")
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # a fan-out folder was removed under us: recreate it once
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.replace(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if self.durable:
            try:
                _fsync_dir(os.path.dirname(final))
            except BaseException:
                _unlink_quietly(final)  # the put fails as a whole: storage and index keep agreeing
                raise

    def _open_new(self, tmp: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(self._tmp, exist_ok=True)
            return os.open(tmp, flags, 0o644)

    def _open_object(self, key: ChunkKey) -> tuple[int, os.stat_result]:
        fd = os.open(self._object_path(key), os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptObjectError("not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _touch(self, fd: int, st: os.stat_result) -> None:
        """Refresh mtime on a hit so the LRU order rebuilt after a restart follows use, not creation."""
        if self.read_only:
            return
        now = time.time_ns()
        if now - st.st_mtime_ns > _TOUCH_EVERY_NS:
            try:
                os.utime(fd, ns=(now, now))
            except OSError:
                pass

    def _load(self, key: ChunkKey, size: int, device, borrow: bool = False) -> TensorDict | None:
        fd, st = self._open_object(key)
        try:
            buf = torch.empty(st.st_size, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            h = xxhash.xxh3_128()
            got = _read_into(fd, [mv], h, skip=objformat.PREFIX_SIZE)
            if got != st.st_size:
                raise CorruptObjectError(f"short read: {got} of {st.st_size} bytes")
            hdr = objformat.parse_header(mv, key, object_size=st.st_size)
            if h.digest() != bytes(mv[16:32]):
                raise CorruptObjectError(f"checksum mismatch for {key.hex()}")
            self._touch(fd, st)
        finally:
            os.close(fd)
        if hdr.codec == "none":
            tensors = objformat.tensors_from_payload(buf[hdr.payload_offset:], hdr)  # views over buf
        else:
            tensors = objformat.decode(buf, key)
        device = torch.device(device)
        if device.type != "cpu":
            tensors = {n: t.to(device) for n, t in tensors.items()}
        return tensors

    def _load_into(self, key: ChunkKey, size: int, out: Mapping[str, torch.Tensor]) -> TensorDict | None:
        """Read the payload straight into caller-owned ``out`` (contiguous CPU tensors): no allocation.

        Names, shapes and dtypes must match the stored chunk exactly (else :class:`InvalidInputError`,
        nothing read). The checksum is verified after the read: on :class:`CorruptObjectError` ``out``
        holds unspecified bytes. Compressed objects and non-CPU or non-contiguous ``out`` tensors go
        through :meth:`_load` and a copy.
        """
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in out.values()):
            data = self._load(key, size, "cpu")
            return None if data is None else fill_out(out, data)
        fd, st = self._open_object(key)
        try:
            head = os.pread(fd, 8 << 10, 0)
            if len(head) >= objformat.PREFIX_SIZE:
                hlen = objformat.PREFIX.unpack_from(head)[2]
                if objformat.PREFIX_SIZE + hlen > len(head) and hlen <= objformat.MAX_HEADER:
                    head = os.pread(fd, objformat.PREFIX_SIZE + hlen, 0)
            hdr = objformat.parse_header(head, key, object_size=st.st_size)
            if hdr.codec != "none":
                os.close(fd)
                fd = -1
                data = self._load(key, size, "cpu")
                return None if data is None else fill_out(out, data)
            _check_out(out, hdr)
            segments: list[memoryview] = []
            pos = 0
            for s in hdr.tensors:
                if s.offset > pos:
                    segments.append(memoryview(bytearray(s.offset - pos)))
                if s.nbytes:
                    segments.append(memoryview(byte_alias(out[s.name]).numpy()))
                pos = s.offset + s.nbytes
            if hdr.raw_size > pos:
                segments.append(memoryview(bytearray(hdr.raw_size - pos)))
            os.lseek(fd, hdr.payload_offset, os.SEEK_SET)
            h = xxhash.xxh3_128(memoryview(head)[objformat.PREFIX_SIZE:hdr.payload_offset])
            got = _read_into(fd, segments, h)
            if got != hdr.raw_size:
                raise CorruptObjectError(f"short read: {got} of {hdr.raw_size} payload bytes")
            if h.digest() != head[16:32]:
                raise CorruptObjectError(f"checksum mismatch for {key.hex()}")
            self._touch(fd, st)
        finally:
            if fd >= 0:
                os.close(fd)
        return dict(out)

    def _drop(self, key: ChunkKey) -> None:
        if self.read_only:
            return  # forget it in this view only; the owner's files are not ours to remove
        try:
            os.unlink(self._object_path(key))
        except FileNotFoundError:
            pass

    def _probe(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """A read-only view also finds objects the owning process wrote after this one opened."""
        if not self.read_only:
            return [None] * len(keys)  # we own the directory: the index is complete
        sizes: list[int | None] = []
        for k in keys:
            try:
                st = os.lstat(self._object_path(k))
                sizes.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
            except OSError:
                sizes.append(None)
        return sizes

    def _free_space(self) -> int | None:
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return None

    def _map(self, fn: Callable, items: Sequence) -> list:
        """Batched I/O on a small pool (inline for one item, for ``io_threads=1`` and inside a worker)."""
        items = list(items)
        if len(items) <= 1 or self.io_threads == 1 or getattr(self._worker, "active", False):
            return [fn(x) for x in items]
        with self._pool_lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"tierstore-{self.name}",
                                                initializer=self._mark_worker)
            try:
                futures = [self._pool.submit(fn, x) for x in items]
            except RuntimeError:  # shut down by a racing close()
                raise ClosedError(f"tier {self.name!r} is closed") from None
        return [f.result() for f in futures]

    def _mark_worker(self) -> None:
        self._worker.active = True

    def _close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ writes refused when read-only
    def put_many(self, items):
        if self.read_only:
            raise ReadOnlyError(f"disk tier {self.name!r} at {self.path!r} is read-only; puts are refused")
        return super().put_many(items)

    def delete_many(self, keys):
        if self.read_only:
            raise ReadOnlyError(f"disk tier {self.name!r} at {self.path!r} is read-only; deletes are refused")
        return super().delete_many(keys)

    def stats(self) -> dict:
        return {**super().stats(), "path": self.path, "durable": self.durable, "read_only": self.read_only,
                "codec": self.codec}


def _check_out(out: Mapping[str, torch.Tensor], hdr: objformat.Header) -> None:
    names = {s.name for s in hdr.tensors}
    if set(out) != names:
        raise InvalidInputError(f"out has tensors {sorted(out)}, the chunk has {sorted(names)}")
    for s in hdr.tensors:
        dst = out[s.name]
        if tuple(dst.shape) != s.shape or dst.dtype != s.dtype:
            raise InvalidInputError(
                f"out[{s.name!r}] is {tuple(dst.shape)} {dst.dtype}, the chunk holds {s.shape} {s.dtype}")


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["DiskTier", "ReadOnlyError"]
