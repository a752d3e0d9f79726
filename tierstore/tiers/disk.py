"""The ``disk`` tier: one checksummed object file per chunk in a local directory.

Layout under ``path``::

    .lock            "<pid> <hostname>" of the owning process (a note: the lock is on the directory)
    00/ … ff/        finished objects, ``<2 hex>/<64 hex>.tso``, and the temp files they are written
                     through, ``<64 hex>.tso.<32 hex>.tmp`` (see :mod:`tierstore.tiers.layout`)

A put encodes the chunk (:mod:`tierstore.objformat`), writes it to a temp file in the object's folder
with ``writev`` and renames it into place, so a reader sees the whole object or nothing; ``durable=True``
adds an fsync of the file before the rename and of its folder after. A get reads the whole file into one
fresh uint8 tensor and returns views over it after checking the header's key and the checksum (hashed
piecewise as it is read). :meth:`DiskTier._load_into` reads the payload straight into caller-owned tensors
instead: no allocation, which matters because first-touch page faults on fresh memory cost more than the
read. The index is rebuilt on open by listing the 256 folders (sizes from ``stat``, LRU order from mtime;
a hit refreshes an mtime over a minute old); temp files a crashed writer left are removed then.

**Only our own files are touched.** Writes, renames and deletes go through descriptors of the directory
and its folders opened without following symlinks, and only names matching our patterns are removed:
files that are not ours (and a folder that is a symlink) are listed past and left alone. Directories are
created 0700 and files 0600 (``permissions: group``: 0770 and 0660), whatever the umask.

A directory belongs to one process at a time (:mod:`tierstore.tiers.dirlock`: an ``flock`` on the
directory, released by :meth:`close` or by the kernel when the process dies). With ``instances: N`` a
tier whose directory is held takes the first free one of ``path.1`` … ``path.<N-1>`` instead, so several
processes on a host can share one config. ``read_only=True`` opens without the lock (an inspector beside
a running engine): it lists, serves gets, sees objects the owner adds later, never removes a file and
skips puts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import objformat
from ..config import check_tier_options
from ..errors import ClosedError, ConfigError, InvalidInputError
from ..iov import writev_all
from ..keys import ChunkKey, check_key
from ..objformat import validate_chunk
from ..tensors import TensorDict, fill_out
from . import objfile
from .base import Tier
from .dirlock import DirLock, lock_first_free, open_dir
from .disk_batch import BatchedReader
from .layout import PERMISSIONS, is_temp_name, key_from_name, object_relpath, temp_name

log = logging.getLogger("tierstore")

_HEX = "0123456789abcdef"
_FANOUT = [a + b for a in _HEX for b in _HEX]
#: the temp folder older versions wrote through, and their temp names (removed at open, nothing else)
_LEGACY_TMP_DIR = "tmp"
_LEGACY_TEMP_NAME = re.compile(r"[0-9a-f]{64}\.\d+\.[0-9a-f]{12}\.tmp")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC
#: a hit refreshes the file's mtime (the LRU order after a restart) when it is older than this: the order
#: survives a restart to the minute, and re-reading fresh chunks costs no metadata write (~20% of a 256 KiB read)
_TOUCH_EVERY_NS = 60 * 1_000_000_000


class ReadOnlyError(InvalidInputError):
    """A delete was attempted on a disk tier opened with ``read_only=True``."""


class DiskTier(Tier):
    """Chunks as object files under ``path`` (created if missing; ``~`` is expanded).

    Args:
        name: tier name (default ``"disk"``).
        capacity: bytes the objects may occupy (their exact file sizes); ``None`` = unbounded, until
            the filesystem fills up (then the tier adopts what it holds as its capacity). A capacity
            above the free space is allowed for the same reason: the tier adapts when it runs out.
        path: the directory. An unusable path raises :class:`~tierstore.ConfigError` naming it.
        durable: fsync each object and its folder before a put returns (off: a torn file after a power
            loss fails its checksum and is a miss).
        read_only: open without the lock; never remove a file; puts are skipped (``False``, counted
            ``skipped``) and deletes raise :class:`ReadOnlyError`.
        codec: ``"none"`` (reads are zero-copy views) or ``"zstd"``.
        io_threads: batched calls (``get_many``, ``put_many``) read and write up to this many objects at
            once (a queue depth for NVMe; batched reads use no more threads than there are cores); 1 =
            serial. Single-key calls always run on the caller's thread.
        permissions: ``"private"`` (directories 0700, files 0600) or ``"group"`` (0770, 0660).
        instances: when ``path`` is held by another process, take the first free directory of
            ``path.1`` … ``path.<instances-1>`` instead (the path actually used is :attr:`path`).

    Raises:
        LockedError: another process (or another open tier in this one) holds the directory (every one
            of them, with ``instances``); the message names the holder's pid and host.
    """

    kind = "disk"
    stores_objects = True

    def __init__(self, name: str | None = None, capacity: int | None = None, path: str | os.PathLike[str] | None = None,
                 durable: bool = False, read_only: bool = False, codec: str = "none", io_threads: int = 4,
                 permissions: str = "private", instances: int = 1):
        if path is None:
            raise ConfigError("disk tier: 'path' is required")
        opts = check_tier_options("disk", {"capacity": capacity, "path": path, "durable": durable,
                                           "read_only": read_only, "codec": codec, "io_threads": io_threads,
                                           "permissions": permissions, "instances": instances},
                                  where=f"disk tier {name or self.kind!r}")
        super().__init__(name, opts["capacity"])
        self.durable, self.read_only, self.codec = durable, read_only, codec
        self.io_threads = io_threads
        self.permissions = permissions
        self._dir_mode, self._file_mode = PERMISSIONS[permissions]
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._worker = threading.local()
        self._batched = BatchedReader(self)
        self._lock: DirLock | None = None
        base = opts["path"]
        if read_only:
            self._root_fd, self.path = open_dir(base), base
        else:
            self._root_fd, self._lock, self.path = lock_first_free(
                [base] + [f"{base}.{i}" for i in range(1, instances)], self._dir_mode, self._file_mode)
        try:
            self._rebuild_index()
        except BaseException:
            self._close()
            raise

    # ------------------------------------------------------------------ open: directory, lock, index
    def _open_folder(self, sub: str, create: bool = False) -> int:
        """A descriptor of fan-out folder ``sub``; never follows a symlink (``OSError`` ELOOP/ENOTDIR)."""
        try:
            return os.open(sub, _DIR_FLAGS | _O_NOFOLLOW, dir_fd=self._root_fd)
        except FileNotFoundError:
            if not create:
                raise
        with contextlib.suppress(FileExistsError):  # a racing writer made it
            os.mkdir(sub, self._dir_mode, dir_fd=self._root_fd)
        fd = os.open(sub, _DIR_FLAGS | _O_NOFOLLOW, dir_fd=self._root_fd)
        self._fix_mode(fd, self._dir_mode)
        return fd

    def _fix_mode(self, fd: int, mode: int) -> None:
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != mode and st.st_uid == os.geteuid():
                os.fchmod(fd, mode)
        except OSError:
            pass

    def _rebuild_index(self) -> None:
        """List the fan-out folders: register objects (oldest mtime first), remove our stale temp files."""
        found: list[tuple[int, str, ChunkKey, int]] = []
        stale = 0
        if not self.read_only:
            stale += self._remove_legacy_temp()
        for sub in _FANOUT:
            try:
                fd = self._open_folder(sub, create=not self.read_only)
            except FileNotFoundError:
                continue
            except OSError as exc:  # a symlink or a file where our folder should be: not ours
                self._fail("folder", "%s/%s is not a folder (%s); left alone, not used", self.path, sub, exc)
                continue
            try:
                if not self.read_only:
                    self._fix_mode(fd, self._dir_mode)
                for entry in _scandir(fd):
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    if is_temp_name(entry.name):
                        if not self.read_only:
                            stale += _unlink_quietly(entry.name, fd)
                        continue
                    key = key_from_name(entry.name)
                    if key is None or object_relpath(key) != f"{sub}/{entry.name}":
                        continue  # not ours (or not where we would look for it): leave it alone
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, entry.name, key, st.st_size))
            finally:
                os.close(fd)
        found.sort()
        self.index_objects((key, size) for _, _, key, size in found)
        if stale or found:
            log.debug("tier %s: indexed %d objects (%d bytes) under %s, removed %d temp files",
                      self.name, len(found), self.used_bytes, self.path, stale)
        if not self.read_only and self.capacity is not None and self.used_bytes > self.capacity:
            self._trim_to_capacity()

    def index_objects(self, items: Iterable[tuple[ChunkKey, int]]) -> None:
        """Register ``(key, file size)`` pairs as opening the tier registers the object files it finds, in
        order (the first is the first evicted), without touching storage: no file is read, checked or
        written, and no capacity is enforced. A key whose file is absent reads as a miss and is then
        forgotten; a damaged one is handled as on any read. For objects placed under :attr:`path` by
        other means, and for benchmarks of a large index."""
        with self._cond:
            for key, size in items:
                self._index_add(key, size)

    def _remove_legacy_temp(self) -> int:
        """Remove temp files older versions left in ``tmp/`` (only those names), then ``tmp/`` if empty."""
        try:
            fd = os.open(_LEGACY_TMP_DIR, _DIR_FLAGS | _O_NOFOLLOW, dir_fd=self._root_fd)
        except OSError:
            return 0  # absent, or not a real folder: nothing of ours
        try:
            removed = sum(_unlink_quietly(e.name, fd) for e in _scandir(fd)
                          if _LEGACY_TEMP_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False))
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):  # fails while it holds files that are not ours
            os.rmdir(_LEGACY_TMP_DIR, dir_fd=self._root_fd)
        return removed

    def _trim_to_capacity(self) -> None:
        """The directory holds more than the (lowered) capacity: drop least-recently-used objects."""
        assert self.capacity is not None
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
                self._fail("drop", "could not remove %s: %s", k.hex(), exc)

    # ------------------------------------------------------------------ data plane
    def object_path(self, key: ChunkKey) -> str:
        """The path of ``key``'s object file under :attr:`path`, whether or not the tier holds ``key``
        (nothing is checked or created). For tools that read or inspect object files directly."""
        return os.path.join(self.path, object_relpath(key))


    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor] | objformat.Encoded
                 ) -> tuple[objformat.Encoded, int]:
        enc = objformat.as_encoded(key, tensors, self.codec)
        return enc, enc.size

    def _store(self, key: ChunkKey, payload: objformat.Encoded, size: int) -> None:
        sub, name = object_relpath(key).split("/")
        tmp = temp_name(key)
        folder = self._open_folder(sub, create=True)
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW,
                             self._file_mode, dir_fd=folder)
                try:
                    os.fchmod(fd, self._file_mode)  # exactly the mode asked for, whatever the umask
                    writev_all(fd, payload.parts)
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                _unlink_quietly(tmp, folder)
                raise
            if self.durable:
                try:
                    os.fsync(folder)
                except BaseException:
                    _unlink_quietly(name, folder)  # the put fails as a whole: storage and index keep agreeing
                    raise
        finally:
            os.close(folder)
        if self.codec == "none":  # the first read of what we just wrote needs no parsing either
            self._batched.remember_written(key, self.object_path(key), payload, time.time_ns())

    def _touch(self, fd: int, mtime_ns: int) -> int:
        """Refresh mtime on a hit so the LRU order rebuilt after a restart follows use, not creation;
        returns the file's mtime as it now is."""
        if self.read_only:
            return mtime_ns
        now = time.time_ns()
        if now - mtime_ns > _TOUCH_EVERY_NS:
            with contextlib.suppress(OSError):
                os.utime(fd, ns=(now, now))
                return now
        return mtime_ns

    def _load(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False) -> TensorDict | None:
        fd, st = objfile.open_object(self.object_path(key))
        try:
            tensors = objfile.read_object(fd, st, key)  # views over one buffer when uncompressed
            self._touch(fd, st.st_mtime_ns)
        finally:
            os.close(fd)
        device = torch.device(device)
        if device.type != "cpu":
            tensors = {n: t.to(device) for n, t in tensors.items()}
        return tensors

    def _load_encoded(self, key: ChunkKey, size: int) -> objformat.Encoded | None:
        fd, st = objfile.open_object(self.object_path(key))
        try:
            return objfile.read_encoded(fd, st, key)
        finally:
            os.close(fd)

    def _load_into(self, key: ChunkKey, size: int, out: Mapping[str, torch.Tensor]) -> TensorDict | None:
        """Read the payload straight into caller-owned ``out`` (contiguous CPU tensors): no allocation.

        Planned when this tier wrote or verified the object before, else the careful read (see
        :mod:`~tierstore.tiers.disk_batch`). The checksum is verified after the read: on
        :class:`CorruptObjectError` ``out`` holds unspecified bytes. Compressed objects, non-CPU or
        non-contiguous ``out`` tensors, and an ``out`` that differs from what the (not yet verified) header
        says go through :meth:`_load_copy`, so a damaged object is a miss and only an intact one that
        differs raises :class:`InvalidInputError`.
        """
        return self._batched.read_into(key, out)

    def _load_copy(self, key: ChunkKey, out: Mapping[str, torch.Tensor]) -> TensorDict | None:
        """Decode the whole object, then copy it into ``out`` (whatever its device, layout or codec)."""
        fd, st = objfile.open_object(self.object_path(key))
        try:
            data = objfile.read_object(fd, st, key)
            self._touch(fd, st.st_mtime_ns)
        finally:
            os.close(fd)
        return fill_out(out, data)

    def _drop(self, key: ChunkKey) -> None:
        if self.read_only:
            return  # forget it in this view only; the owner's files are not ours to remove
        sub, name = object_relpath(key).split("/")
        try:
            folder = self._open_folder(sub)
        except FileNotFoundError:
            return
        try:
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            pass
        finally:
            os.close(folder)

    def _probe(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """A read-only view also finds objects the owning process wrote after this one opened."""
        if not self.read_only:
            return [None] * len(keys)  # we own the directory: the index is complete
        sizes: list[int | None] = []
        for k in keys:
            try:
                st = os.lstat(self.object_path(k))
                sizes.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
            except OSError:
                sizes.append(None)
        return sizes

    def _free_space(self) -> int | None:
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return None

    def _map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """Batched I/O on a small pool, the first item on the caller's thread (all inline for one item, for
        ``io_threads=1`` and inside a worker). Returns, or raises the first error, only once every item is
        done: none is left using the caller's buffers."""
        items = list(items)
        if len(items) <= 1 or self.io_threads == 1 or getattr(self._worker, "active", False):
            return [fn(x) for x in items]
        with self._pool_lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"tierstore-{self.name}",
                                                initializer=self._mark_worker)
            try:
                futures = [self._pool.submit(fn, x) for x in items[1:]]
            except RuntimeError:  # shut down by a racing close()
                raise ClosedError(f"tier {self.name!r} is closed") from None
        try:
            first = fn(items[0])
        finally:
            concurrent.futures.wait(futures)
        return [first, *(f.result() for f in futures)]

    def _load_many_into(self, work: list[tuple[ChunkKey, int, Mapping[str, torch.Tensor]]]
                        ) -> list[TensorDict | InvalidInputError | None]:
        """Batched ``get_many_into``: :mod:`~tierstore.tiers.disk_batch` (parsed-header fast path)."""
        return self._batched.load_many_into(work)

    def _mark_worker(self) -> None:
        self._worker.active = True

    def _close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        lock, self._lock = self._lock, None
        fd, self._root_fd = self._root_fd, -1
        try:
            if lock is not None:
                lock.release()
        finally:
            if fd >= 0:
                os.close(fd)

    # ------------------------------------------------------------------ a read-only view never writes
    def _put_many(self, items: Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]], keep_on_failure: bool
                  ) -> list[bool]:
        if not self.read_only:
            return super()._put_many(items, keep_on_failure)
        items = list(items)
        for key, tensors in items:  # bad input still raises, as for every tier
            check_key(key)
            validate_chunk(tensors)
        if items:
            self._count("skipped", len(items))
            self._fail("read-only", "opened read_only: puts are skipped")
        return [False] * len(items)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        if self.read_only:
            raise ReadOnlyError(f"disk tier {self.name!r} at {self.path!r} is read-only; deletes are refused")
        return super().delete_many(keys)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "path": self.path, "durable": self.durable, "read_only": self.read_only,
                "codec": self.codec, "permissions": self.permissions}


def _scandir(dir_fd: int) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(dir_fd) as it:
            return list(it)
    except OSError:
        return []


def _unlink_quietly(name: str, dir_fd: int) -> int:
    """Remove ``name`` in the folder open as ``dir_fd``; 1 if it was removed, else 0."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return 1
    except OSError:
        return 0


__all__ = ["DiskTier", "ReadOnlyError"]
