"""The ``disk`` backend: one checksummed object file per chunk in a local directory.

Layout under ``path``::

    .lock            "<pid> <hostname>" of the owning process (a note: the lock is on the directory)
    00/ … ff/        finished objects, ``<2 hex>/<64 hex>.tso``, and the temp files they are written
                     through, ``<64 hex>.tso.<32 hex>.tmp`` (see :mod:`tierstore.backends.layout`)

A write encodes the chunk (:mod:`tierstore.objformat`), writes it to a temp file in the object's folder with
``writev`` and renames it into place, so a reader sees the whole object or nothing; ``durable=True`` adds an
fsync of the file before the rename and of its folder after. A read takes the whole file into one fresh uint8
tensor and returns views over it after checking the header's key and the checksum (hashed piecewise as it is
read); :meth:`FileBackend.read_into_many` reads payloads straight into caller-owned tensors instead
(:mod:`.file_reads`): no allocation, which matters because first-touch page faults on fresh memory cost more
than the read. :meth:`FileBackend.list` walks the 256 folders (sizes from ``stat``, LRU order from mtime; a
hit refreshes an mtime over a minute old) and removes the temp files a crashed writer left.

**Only our own files are touched.** Writes, renames and deletes go through descriptors of the directory and
its folders opened without following symlinks, and only names matching our patterns are removed: files that
are not ours (and a folder that is a symlink) are listed past and left alone. Directories are created 0700 and
files 0600 (``permissions: group``: 0770 and 0660), whatever the umask.

A directory belongs to one process at a time (:mod:`.dirlock`: an ``flock`` on the directory, released by
:meth:`close` or by the kernel when the process dies). With ``instances: N`` a backend whose directory is held
takes the first free one of ``path.1`` … ``path.<N-1>`` instead, so several processes on a host can share one
config. ``read_only=True`` opens without the lock (an inspector beside a running engine): it lists, serves
reads, sees objects the owner adds later (it is *shared*: the store asks it about keys its index lacks), never
removes a file and is never written.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from .. import objformat
from ..config import check_tier_options
from ..errors import ClosedError, ConfigError, InvalidInputError
from ..iov import writev_all
from ..keys import ChunkKey
from ..telemetry import Failures
from . import objfile
from .base import Backend, Capabilities, Chunk, Hit, Listed, Prepared, ReadResult, results_of
from .dirlock import DirLock, lock_first_free, open_dir
from .file_reads import BatchedReader
from .layout import PERMISSIONS, is_temp_name, key_from_name, object_relpath, temp_name

log = logging.getLogger("tierstore")

T = TypeVar("T")
R = TypeVar("R")

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
    """A delete or write was attempted on a disk backend opened with ``read_only=True``."""


class FileBackend(Backend):
    """Chunks as object files under ``path`` (created if missing; ``~`` is expanded).

    Args:
        name: the tier's name (in logs).
        path: the directory. An unusable path raises :class:`~tierstore.ConfigError` naming it.
        durable: fsync each object and its folder before a write returns (off: a torn file after a power
            loss fails its checksum and is a miss).
        read_only: open without the lock; never remove or write a file.
        codec: ``"none"`` (reads are zero-copy views) or ``"zstd"``.
        io_threads: batched calls read and write up to this many objects at once (a queue depth for NVMe;
            batched reads use no more threads than there are cores); 1 = serial. A single item always runs
            on the caller's thread.
        permissions: ``"private"`` (directories 0700, files 0600) or ``"group"`` (0770, 0660).
        instances: when ``path`` is held by another process, take the first free directory of ``path.1`` …
            ``path.<instances-1>`` instead (the path actually used is :attr:`path`).
        verify_reads: ``"always"`` (default): every read of an object checks its payload's checksum;
            ``"once"``: a batched read into ``out`` skips that check for a file this process wrote or already
            verified, as long as its inode, size and change time are still those it saw then (sizes and header
            bytes are checked on every read). See :mod:`.file_reads` for what that does and does not catch.

    Raises:
        LockedError: another process (or another open backend in this one) holds the directory (every one of
            them, with ``instances``); the message names the holder's pid and host.
    """

    kind = "disk"

    def __init__(self, name: str | None = None, path: str | os.PathLike[str] | None = None, durable: bool = False,
                 read_only: bool = False, codec: str = "none", io_threads: int = 4, permissions: str = "private",
                 instances: int = 1, verify_reads: str = "always"):
        self.name = name or self.kind
        if path is None:
            raise ConfigError("disk tier: 'path' is required")
        opts = check_tier_options("disk", {"path": path, "durable": durable, "read_only": read_only,
                                           "codec": codec, "io_threads": io_threads, "permissions": permissions,
                                           "instances": instances, "verify_reads": verify_reads},
                                   where=f"disk tier {self.name!r}")
        self.durable, self.read_only, self.codec = durable, read_only, codec
        self.capabilities = Capabilities(objects=True, persistent=True, shared=read_only, writable=not read_only,
                                         codec=codec)
        self.io_threads = self.concurrency = io_threads
        self.permissions = permissions
        self.failures = Failures(log, f"tier {self.name}: ")
        self._dir_mode, self._file_mode = PERMISSIONS[permissions]
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        #: calls in flight: the directory's descriptor and lock stay until the last one ends, even past close()
        self._users = 0
        self._worker = threading.local()
        self._lock: DirLock | None = None
        base = opts["path"]
        if read_only:
            self._root_fd, self.path = open_dir(base), base
        else:
            self._root_fd, self._lock, self.path = lock_first_free(
                [base] + [f"{base}.{i}" for i in range(1, instances)], self._dir_mode, self._file_mode)
        self._reads = BatchedReader(self, trust=verify_reads == "once")

    # ------------------------------------------------------------------ the directory
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

    def list(self) -> Iterator[Listed]:
        """Every object, oldest mtime first; our stale temp files are removed on the way (unless read-only)."""
        with self._in_use():
            return self._list()

    def _list(self) -> Iterator[Listed]:
        found: builtins.list[Listed] = []
        stale = 0
        if not self.read_only:
            stale += self._remove_legacy_temp()
        for sub in _FANOUT:
            try:
                fd = self._open_folder(sub, create=not self.read_only)
            except FileNotFoundError:
                continue
            except OSError as exc:  # a symlink or a file where our folder should be: not ours
                self.failures.report("folder", "%s/%s is not a folder (%s); left alone, not used", self.path,
                                     sub, exc)
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
                    found.append(Listed(key, st.st_size, st.st_mtime_ns / 1e9))
            finally:
                os.close(fd)
        found.sort(key=lambda f: (f.mtime, f.key.hex()))
        if stale or found:
            log.debug("tier %s: found %d objects under %s, removed %d temp files", self.name, len(found),
                      self.path, stale)
        return iter(found)

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

    def object_path(self, key: ChunkKey) -> str:
        """The path of ``key``'s object file under :attr:`path`, whether or not it is stored (nothing is
        checked or created). For tools that read or inspect object files directly."""
        return os.path.join(self.path, object_relpath(key))

    # ------------------------------------------------------------------ writes
    def prepare(self, key: ChunkKey, chunk: Chunk) -> Prepared:
        enc = objformat.as_encoded(key, chunk, self.codec)
        return Prepared(enc, enc.size)

    def write_many(self, items: Sequence[tuple[ChunkKey, Prepared]]) -> builtins.list[BaseException | None]:
        if self.read_only:
            raise ReadOnlyError(f"disk tier {self.name!r} at {self.path!r} is read-only")
        def store(item: tuple[ChunkKey, Prepared]) -> None:
            self._store(item[0], item[1].payload)

        with self._in_use():
            return self._map(store, items)

    def _store(self, key: ChunkKey, payload: objformat.Encoded) -> None:
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
                    _unlink_quietly(name, folder)  # the write fails as a whole: storage and index keep agreeing
                    raise
            # the file as renamed into place (the rename changed its ctime), for verify_reads: once
            st = os.stat(name, dir_fd=folder, follow_symlinks=False) if self._reads.trust else None
        finally:
            os.close(folder)
        if self.codec == "none":  # the first read of what we just wrote needs no parsing either
            self._reads.remember_written(key, self.object_path(key), payload, time.time_ns(), st)

    # ------------------------------------------------------------------ reads
    def touch(self, fd: int, mtime_ns: int) -> int:
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

    def _opened(self, key: ChunkKey, read: Callable[[int, os.stat_result], T]) -> T | None:
        """``read(fd, stat)`` of ``key``'s object, opened safely (:func:`objfile.open_object`); ``None`` if
        there is none."""
        try:
            fd, st = objfile.open_object(self.object_path(key))
        except FileNotFoundError:
            return None
        try:
            return read(fd, st)
        finally:
            os.close(fd)

    def read_tensors(self, key: ChunkKey) -> Hit | None:
        """The object's tensors (views over one buffer when uncompressed), verified; ``None`` if absent."""
        def read(fd: int, st: os.stat_result) -> Hit:
            tensors = objfile.read_object(fd, st, key)
            self.touch(fd, st.st_mtime_ns)
            return Hit(tensors, st.st_size)

        return self._opened(key, read)

    def read_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> builtins.list[ReadResult]:
        device = torch.device(device)

        def one(key: ChunkKey) -> Hit | None:
            hit = self.read_tensors(key)
            if hit is not None and device.type != "cpu":
                hit = Hit({n: t.to(device) for n, t in hit.value.items()}, hit.size)
            return hit

        with self._in_use():
            return self._map(one, keys)

    def read_into_many(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]
                       ) -> builtins.list[ReadResult]:
        """Payloads straight into ``outs`` (contiguous CPU tensors): no allocation (see :mod:`.file_reads`).
        On a checksum failure ``out`` holds unspecified bytes."""
        with self._in_use():
            return self._reads.read_many_into(list(keys), list(outs))

    def read_objects(self, keys: Sequence[ChunkKey]) -> builtins.list[ReadResult]:
        with self._in_use():
            return self._map(lambda key: self._opened(key, lambda fd, st: Hit(objfile.read_encoded(fd, st, key),
                                                                              st.st_size)), keys)

    # ------------------------------------------------------------------ the rest
    def delete_many(self, keys: Sequence[ChunkKey]) -> builtins.list[BaseException | None]:
        if self.read_only:
            raise ReadOnlyError(f"disk tier {self.name!r} at {self.path!r} is read-only; deletes are refused")
        try:
            with self._in_use():
                return results_of(self._remove, keys)
        except ClosedError as exc:  # each item's result: an eviction or delete racing close() keeps its bookkeeping
            return [exc] * len(keys)

    def _remove(self, key: ChunkKey) -> None:
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

    def stat_many(self, keys: Sequence[ChunkKey]) -> builtins.list[int | None]:
        sizes: builtins.list[int | None] = []
        for k in keys:
            try:
                st = os.lstat(self.object_path(k))
                sizes.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
            except OSError:
                sizes.append(None)
        return sizes

    def free_space(self) -> int | None:
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return None

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> builtins.list[R | BaseException]:
        """Per-item work on a small pool, the first item on the caller's thread (all inline for one item, for
        ``io_threads=1`` and inside a worker); each item's exception is its result. Returns only once every
        item is done: none is left using the caller's buffers."""
        items = list(items)
        if len(items) <= 1 or self.io_threads == 1 or getattr(self._worker, "active", False):
            return results_of(fn, items)
        with self._pool_lock:
            if self._closed:
                raise ClosedError(f"tier {self.name!r} is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"tierstore-{self.name}",
                                                initializer=self._mark_worker)
            futures = [self._pool.submit(results_of, fn, [x]) for x in items[1:]]
        try:
            first = results_of(fn, items[:1])
        finally:
            concurrent.futures.wait(futures)
        return [*first, *(f.result()[0] for f in futures)]

    def run_on_pool(self, fn: Callable[[int], None], n: int) -> None:
        """``fn(i)`` for ``i < n``, ``i = 0`` on the caller's thread, the rest on the pool; returns once all are
        done, raising the first error (batched reads split their work into ``n`` slices this way)."""
        for got in self._map(fn, range(n)):
            if isinstance(got, BaseException):
                raise got

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """A call's hold on the directory: refused with :class:`ClosedError` once :meth:`close` began (whatever
        the batch size or ``io_threads``); one admitted before keeps the directory's descriptor (and lock) open
        until it ends, so no write goes through a descriptor number closed and reused meanwhile."""
        with self._pool_lock:
            if self._closed:
                raise ClosedError(f"tier {self.name!r} is closed")
            self._users += 1
        try:
            yield
        finally:
            with self._pool_lock:
                self._users -= 1
                last = self._closed and self._users == 0
            if last:
                self._release()

    def _mark_worker(self) -> None:
        self._worker.active = True

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, "durable": self.durable, "read_only": self.read_only, "codec": self.codec,
                "permissions": self.permissions, "failures": self.failures.counts()}

    def close(self) -> None:
        with self._pool_lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._pool_lock:
            idle = self._users == 0
        if idle:  # else the last call still running releases the directory
            self._release()

    def _release(self) -> None:
        with self._pool_lock:
            lock, self._lock = self._lock, None
            fd, self._root_fd = self._root_fd, -1
        try:
            if lock is not None:
                lock.release()
        finally:
            if fd >= 0:
                os.close(fd)

    def __repr__(self) -> str:
        return f"<FileBackend {self.name!r} {self.path}>"


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


__all__ = ["FileBackend", "ReadOnlyError"]
