"""The ``remote`` tier: chunk objects under any fsspec URL, shared by every process that opens it.

``s3://bucket/prefix`` (s3fs), ``file:///mnt/nfs/kv`` (a shared mount), ``memory://`` (tests), ``gs://`` …
Each chunk is one self-describing, checksummed object (:mod:`tierstore.objformat`) at
``<root>/ab/<hex>.tso`` (:mod:`tierstore.tiers.layout`).

Rules this tier keeps:

* **Write-once, atomic publish.** Objects are never replaced (``overwrites = False``): on S3 one PUT with
  ``If-None-Match: *``; on a local/shared mount a unique temp file in the same folder hard-linked into
  place (falls back to ``os.replace`` where links are unsupported); elsewhere one ``pipe_file`` with
  ``mode="create"``. A reader never sees part of an object, and two processes publishing the same key at
  once is harmless — the second finds the object there and counts it as a success.
* **Sharing.** The index is rebuilt by listing at open (``list_on_open``); keys missing from the index are
  looked up in storage (one HEAD each, concurrently) every time — negative results are never cached, since
  another process may publish a key at any moment.
* **Bounded, concurrent batches.** ``put_many``/``get_many``/probes fan their per-key work out over a
  thread pool of ``max_in_flight`` workers shared by all callers of the tier; the base class keeps the
  accounting, pins and counters.
* **Degrade, don't fail.** Any storage or network error on a read is a miss, on a write a skipped put; it
  is counted (``errors``) and logged once. A damaged object is a counted miss (``corrupt``), one this
  reader cannot represent (newer format, unknown dtype) a counted miss (``unsupported``); neither is
  deleted by a reader (``shared = True``): this process forgets it, and ``tierstore verify --repair``
  removes damaged ones.
* **Capacity** is optional (``None`` = unbounded). With one, LRU eviction runs over the objects this
  process knows (its listing and what it has written or found), and an evicted object is deleted.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from .. import objformat
from ..config import check_tier_options
from ..errors import ClosedError, ConfigError, InvalidInputError, TierstoreError
from ..keys import ChunkKey
from ..tensors import TensorDict
from . import objfile
from .base import Tier
from .layout import PERMISSIONS, TMP_SUFFIX, key_from_name, object_relpath

T = TypeVar("T")
R = TypeVar("R")

#: exceptions from a filesystem call that are bugs or bad arguments, not an unreachable storage
_PROGRAMMING_ERRORS = (TypeError, ValueError, AttributeError, LookupError, NotImplementedError, AssertionError)


class _Unavailable(OSError):
    """The storage failed recently; raised without I/O until the back-off expires."""


#: errno values for which a hard link cannot be made but ``os.replace`` works (FAT, some FUSE/SMB mounts)
_NO_LINK = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV, errno.ENOSYS}


def _check_url(url: object) -> None:
    """Raise :class:`ConfigError` unless every protocol in ``url`` is one fsspec can load."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"remote tier needs `url` (an fsspec URL such as s3://bucket/prefix), got {url!r}")
    for part in url.split("::"):
        protocol, _ = fsspec.core.split_protocol(part)
        if protocol is None:
            continue  # a plain local path
        if protocol not in fsspec.available_protocols():
            raise ConfigError(f"remote tier url {url!r}: unknown scheme {protocol!r}")
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            raise ConfigError(f"remote tier url {url!r}: scheme {protocol!r} needs a package: {exc}") from None


def _mtime(info: Mapping[str, Any]) -> float:
    """Modification time of a listing entry across fsspec implementations (0 when unknown)."""
    for field in ("LastModified", "mtime", "updated", "created"):
        v = info.get(field)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0


def _join(enc: objformat.Encoded) -> bytearray:
    """The object as one buffer for a single PUT, with one copy (``Encoded.tobytes`` makes two)."""
    buf = bytearray(enc.size)
    pos = 0
    for part in enc.parts:
        mv = memoryview(part).cast("B")
        buf[pos:pos + mv.nbytes] = mv
        pos += mv.nbytes
    return buf


class RemoteTier(Tier):
    """Chunks as write-once objects under an fsspec URL, shared between processes and nodes.

    Parameters
    ----------
    name, capacity:
        As for every tier; ``capacity=None`` (the default) means unbounded.
    url:
        Any fsspec URL: ``s3://bucket/prefix``, ``file:///mnt/nfs/kv``, ``memory://kv``, ``gs://…``.
        An unknown scheme, or one whose package is missing, raises :class:`ConfigError` before any I/O.
    storage_options:
        Keyword arguments for the filesystem (``endpoint_url``, ``key``, ``secret``, ``config_kwargs`` …).
    compression:
        ``None``/``"none"`` or ``"zstd"`` for objects this tier writes; it reads either.
    max_in_flight:
        Concurrent storage requests of this tier (all callers together).
    list_on_open:
        Rebuild the index by listing the prefix at open. Without it the index fills lazily, as lookups
        find objects in storage.
    permissions:
        For a local or mounted path: ``"private"`` (folders 0700, objects 0600) or ``"group"`` (0770,
        0660) for the folders and objects this tier creates.
    """

    kind = "remote"
    overwrites = False
    shared = True
    #: seconds to fail fast after a connection error or timeout (doubling while down, up to the max)
    retry_after: float = 1.0
    max_retry_after: float = 30.0

    def __init__(self, name: str | None = None, capacity: int | None = None, url: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, compression: str | None = None,
                 max_in_flight: int = 8, list_on_open: bool = True, permissions: str = "private"):
        _check_url(url)
        check_tier_options("remote", {"compression": compression, "max_in_flight": max_in_flight,
                                      "storage_options": storage_options, "list_on_open": list_on_open,
                                      "permissions": permissions}, where=f"remote tier {name or self.kind!r}")
        super().__init__(name, capacity)
        self._dir_mode, self._file_mode = PERMISSIONS[permissions]
        self.url = url
        self.codec = compression or "none"
        self.max_in_flight = max_in_flight
        options = dict(storage_options or {})
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ValueError, TypeError, ImportError) as exc:
            raise ConfigError(f"remote tier url {url!r}: {exc}") from None
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._s3 = type(self.fs).__module__.startswith("s3fs")
        self._create_mode = True  # whether pipe_file takes mode="create" (cleared if the fs rejects it)
        self._health = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._worker = threading.local()
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix=f"tierstore-{self.name}",
                                        initializer=self._mark_worker)
        if list_on_open:
            self._rebuild_index()

    # ------------------------------------------------------------------ paths and plumbing
    def _path(self, key: ChunkKey) -> str:
        return f"{self.root}/{object_relpath(key)}"

    def _mark_worker(self) -> None:
        self._worker.active = True

    def _map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(x) for x in items]``, run on the tier's pool (inline inside a pool worker: no deadlock)."""
        items = list(items)
        if len(items) <= 1 or self.max_in_flight == 1 or getattr(self._worker, "active", False):
            return [fn(x) for x in items]
        try:
            futures = [self._pool.submit(fn, x) for x in items]
        except RuntimeError:  # pool shut down by a racing close()
            raise ClosedError(f"tier {self.name!r} is closed") from None
        return [f.result() for f in futures]

    def _io(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Call a filesystem function; non-``OSError`` failures (botocore, aiohttp …) become ``OSError``.

        A connection failure or timeout marks the storage unreachable for ``retry_after`` seconds (doubling
        while it stays down, up to ``max_retry_after``): until then calls fail at once instead of each
        waiting for the network, so a dead endpoint costs the caller a miss, not a stall.
        """
        now = time.monotonic()
        if now < self._down_until:
            raise _Unavailable(f"{self.url} is unreachable; next attempt in {self._down_until - now:.1f}s")
        try:
            out = fn(*args, **kwargs)
        except (FileNotFoundError, FileExistsError, TierstoreError):
            self._mark_up()  # the storage answered
            raise
        except (ConnectionError, TimeoutError) as exc:
            self._mark_down(exc)
            raise
        except OSError:
            raise
        except _PROGRAMMING_ERRORS as exc:
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # botocore / aiohttp / gcsfs network errors
            self._mark_down(exc)
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        self._mark_up()
        return out

    def _mark_down(self, exc: BaseException) -> None:
        with self._health:
            now = time.monotonic()
            if now < self._down_until:
                return  # concurrent failures of one outage extend nothing
            self._backoff = min(max(2 * self._backoff, self.retry_after), self.max_retry_after)
            self._down_until = now + self._backoff
        self._log_once("down", "%s unreachable (%s: %s); requests fail fast for %.1fs at a time",
                       self.url, type(exc).__name__, exc, self._backoff)

    def _mark_up(self) -> None:
        if self._backoff:
            with self._health:
                self._backoff = 0.0
                self._down_until = 0.0

    # ------------------------------------------------------------------ index
    def _rebuild_index(self) -> None:
        """Register every finished object under the root, least recently modified first."""
        try:
            listing = self._list_root()
        except OSError as exc:
            self._count("errors")
            self._log_once("list", "listing %s failed (%s); starting with an empty index", self.url, exc)
            return
        found = []
        for path, info in listing.items():
            key = key_from_name(path)
            if key is not None and info.get("type", "file") == "file" and isinstance(info.get("size"), int):
                found.append((_mtime(info), key, info["size"]))
        found.sort(key=lambda f: f[0])
        if self.capacity is not None:  # keep the newest objects that fit; the rest stay unindexed
            kept, total = [], 0
            for entry in reversed(found):
                if total + entry[2] <= self.capacity:
                    kept.append(entry)
                    total += entry[2]
            if len(kept) < len(found):
                self._log_once("overfull", "%d objects under %s exceed the capacity; indexing the newest %d",
                               len(found), self.url, len(kept))
            found = kept[::-1]
        with self._cond:
            for _, key, size in found:
                self._index_add(key, size)

    def _list_root(self) -> dict[str, dict[str, Any]]:
        """Every file under the root with its details (empty if the root does not exist yet)."""
        try:
            return self._io(self.fs.find, self.root, detail=True)
        except FileNotFoundError:
            return {}
        finally:  # a listing cache would go stale as other processes publish; lookups must hit storage
            try:
                self.fs.invalidate_cache(self.root)
            except Exception:
                pass

    def remove_stale_temp(self, older_than: float = 3600.0) -> int:
        """Delete temp files that crashed writers left under the root (``file://`` publishes stage in
        them), modified more than ``older_than`` seconds ago; returns how many. Temp files of unknown
        age are kept: a live writer may still be filling one."""
        if older_than < 0:
            raise InvalidInputError(f"older_than must be >= 0 seconds, got {older_than!r}")
        self._check_open()
        listing = self._list_root()
        cutoff = time.time() - older_than
        removed = 0
        for path, info in listing.items():
            if path.endswith(TMP_SUFFIX) and 0 < _mtime(info) < cutoff:
                try:
                    self._io(self.fs.rm_file, path)
                    removed += 1
                except FileNotFoundError:
                    pass  # its writer finished or another gc got there first
        return removed

    def _stat(self, key: ChunkKey) -> int | None:
        """Size of ``key``'s object in storage, ``None`` if absent. Raises ``OSError`` on I/O failure."""
        path = self._path(key)
        try:
            if self._s3:  # one HEAD; fs.info would add a LIST for every miss
                bucket, name, _ = self.fs.split_path(path)
                return int(self._io(self.fs.call_s3, "head_object", self.fs.kwargs, Bucket=bucket,
                                    Key=name)["ContentLength"])
            info = self._io(self.fs.info, path)
        except FileNotFoundError:
            return None
        return info["size"] if info.get("type", "file") == "file" else None

    def _probe(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        def one(key: ChunkKey) -> int | None:
            try:
                return self._stat(key)
            except OSError as exc:
                self._count("errors")
                self._log_once("probe", "lookup failed (%s); treating as a miss", exc)
                return None

        return self._map(one, keys)

    # ------------------------------------------------------------------ data plane
    def _prepare(self, key: ChunkKey, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, int]:
        enc = objformat.encode(key, tensors, self.codec)
        return enc, enc.size

    def _store(self, key: ChunkKey, payload: objformat.Encoded, size: int) -> None:
        path = self._path(key)
        try:
            if self._local:
                self._publish_local(path, payload)
            else:
                self._publish(path, _join(payload))
        except FileExistsError:
            pass  # write-once: another writer published this key first
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                # the space is shared with other writers: skip the put, keep our capacity (no disk-style shrink)
                raise OSError(f"no space left under {self.url}: {exc}") from exc
            raise

    def _publish(self, path: str, data: bytes | bytearray) -> None:
        if self._create_mode:
            try:
                self._io(self.fs.pipe_file, path, data, mode="create")
                return
            except OSError as exc:
                if not isinstance(exc.__cause__, TypeError):
                    raise
                self._create_mode = False  # an fs without mode=: check, then write (same content anyway)
                self._log_once("create-mode", "%s has no create-only writes; checking existence first",
                               type(self.fs).__name__)
        if self._io(self.fs.exists, path):
            raise FileExistsError(path)
        self._io(self.fs.pipe_file, path, data)

    def _publish_local(self, path: str, enc: objformat.Encoded) -> None:
        """Write a unique temp file next to ``path``, then link it into place (fails if it exists)."""
        tmp = f"{path}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            f = open(tmp, "xb", opener=self._create_file)  # noqa: SIM115 - closed by the `with f:` below
        except FileNotFoundError:
            self._make_folders(os.path.dirname(path))
            f = open(tmp, "xb", opener=self._create_file)  # noqa: SIM115
        try:
            with f:
                for part in enc.parts:
                    f.write(part)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                if os.path.exists(path):
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _create_file(self, path: str, flags: int) -> int:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), self._file_mode)
        os.fchmod(fd, self._file_mode)  # exactly the configured mode, whatever the umask
        return fd

    def _make_folders(self, folder: str) -> None:
        """Create ``folder`` and its missing parents with the configured directory mode."""
        missing = []
        while folder and not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for d in reversed(missing):
            try:
                os.mkdir(d, self._dir_mode)
                os.chmod(d, self._dir_mode)
            except FileExistsError:
                pass  # a concurrent writer made it

    def _read(self, path: str) -> bytes:
        """The whole object in one GET: what is allocated is bounded by the object's real size."""
        data: bytes = self._io(self.fs.cat_file, path)
        return data

    def _load(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False) -> TensorDict | None:
        path = self._path(key)
        if self._local:  # a mount: read like the disk tier (no symlinks, no FIFOs, sizes checked first)
            fd, st = objfile.open_object(path)
            try:
                tensors = objfile.read_object(fd, st, key)
            finally:
                os.close(fd)
        else:
            tensors = objformat.decode(self._read(path), expected_key=key)
        device = torch.device(device)
        if device.type != "cpu":
            tensors = {name: t.to(device) for name, t in tensors.items()}
        return tensors

    def _drop(self, key: ChunkKey) -> None:
        try:
            self._io(self.fs.rm_file, self._path(key))
        except FileNotFoundError:
            pass

    def _close(self) -> None:
        self._pool.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "url": self.url, "compression": self.codec}
