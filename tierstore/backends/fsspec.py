"""The ``remote`` backend: chunk objects under any fsspec URL, shared by every process that opens it.

``s3://bucket/prefix`` (s3fs), ``file:///mnt/nfs/kv`` (a shared mount), ``memory://`` (tests), ``gs://`` …
Each chunk is one self-describing, checksummed object (:mod:`tierstore.objformat`) at
``<root>/ab/<hex>.tso`` (:mod:`tierstore.backends.layout`).

Rules this tier keeps:

* **Atomic publish, never an older value.** A put first reads the stored object's checksum (one
  ranged read of its first 32 bytes): the same value is there already (on a shared prefix another engine
  has often published it) and nothing is uploaded — unless a read here found that object damaged (its
  header, checksum field included, may be intact): then it is replaced. Otherwise a new object is
  published create-only — on S3 one PUT with ``If-None-Match: *``; on a local/shared mount a unique temp
  file in the same folder hard-linked into place (``os.replace`` where links are unsupported); elsewhere
  one ``pipe_file`` with ``mode="create"`` — and an object holding another value is replaced in one atomic
  step (a plain PUT; temp file + ``os.replace``). A reader never sees part of an object, and two processes
  publishing the same value at once is harmless.
* **Sharing.** The store's index is rebuilt by listing at open (``list_on_open``); keys missing from it are
  looked up in storage every time — negative results are never cached, since another process may publish
  a key at any moment. A lookup costs one HEAD per such key (concurrently); a read needs no HEAD at all:
  its GET is the lookup (a ``404`` is the miss: ``probe_on_read``).
* **Bounded, concurrent batches.** Batched writes, reads and lookups fan their per-key work out over
  ``max_in_flight`` workers shared by all callers of the backend: one pool each for reads, for lookups and for
  writes (and the rest), so that a read never queues behind writes (an engine's load waits on it) and a
  lookup behind neither.
* **Degrade, don't fail.** Any storage or network error is the item's result (the store counts a miss or a
  skipped write). A damaged object, or one this reader cannot represent (newer format, unknown dtype), is
  never deleted by a reader (``shared``): the store forgets it, and ``tierstore verify --repair`` removes
  damaged ones.
* **Never stuck.** Every storage request has a deadline (``timeout``, 5 s by default) and a sick
  endpoint makes the tier fail fast for a back-off (:mod:`.guarded`); ``close()``
  waits for in-flight requests at most ``timeout``. Local paths (``file://``) block as the mount does:
  use NFS ``soft`` mounts with ``timeo``.
* **A mount reads like the disk tier.** ``get_many(out=)`` reads an object straight into the caller's CPU
  tensors and verifies its checksum over the bytes there (no buffer of its own, no second copy); chunks of
  :data:`DIRECT_MIN` bytes or more are written with their payload on a 4 KiB block, so block-aligned memory is
  written and read with ``O_DIRECT`` (:mod:`.direct_io`), without the page cache's copy. With
  ``verify_reads: once`` such a read skips the checksum of an object this process wrote or verified, while its
  file is unchanged since (:mod:`.stamps`).
* **No capacity.** The prefix is shared, so a per-process LRU over it would delete other writers' fresh
  objects. Nothing evicts here; :meth:`FsspecBackend.collect_garbage`
  (``tierstore gc --max-size / --older-than``, :mod:`.prefix_gc`) keeps the prefix within a budget for
  every writer alike, from a listing, least recently used first.
* **Last use without a coordinator.** A read that finds its object last modified more than
  ``touch_after`` seconds ago (default 600) refreshes the modification time, in the background: an S3
  object is copied onto itself (one request, no bytes through the client), a mount's file gets
  ``utime``. Every reader sees the fresh time on its next read and skips, so an object costs about one
  extra request per ``touch_after`` seconds across the fleet, and the listing's time is its last use.
  Hits in tiers above count too (:meth:`FsspecBackend.note_use`, scheduled by :mod:`.last_use`).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import errno
import inspect
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from .. import objformat, sealing
from ..config import check_tier_options
from ..errors import (
    ClosedError,
    ConfigError,
    CorruptObjectError,
    ForgedObjectError,
    InvalidInputError,
    UnsupportedObjectError,
)
from ..keyring import Keyring
from ..keys import ChunkKey
from ..telemetry import Failures
from ..tensors import fill_out
from . import direct_io, file_reads, listing, objfile, prefix_gc
from .base import Backend, Capabilities, Chunk, Hit, Listed, Prepared, ReadResult, results_of
from .guarded import DEFAULT_TIMEOUT, GuardedStorage, read_s3_object, read_s3_range, with_client_defaults
from .last_use import UseClock
from .layout import PERMISSIONS, PUBLISH_PREFIX, TMP_SUFFIX, key_from_name, object_relpath
from .stamps import Stamps

log = logging.getLogger("tierstore")

T = TypeVar("T")
R = TypeVar("R")

#: errno values for which a hard link cannot be made but ``os.replace`` works (FAT, some FUSE/SMB mounts)
_NO_LINK = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV, errno.ENOSYS}

#: seconds after which a read refreshes its object's modification time (its last use, for ``gc --max-size``)
TOUCH_AFTER_S = 600.0
#: keys whose objects this process could not open (or found damaged) that it remembers (see
#: ``FsspecBackend._refused`` and ``_damaged``)
REFUSED_KEPT = 65536
#: chunks of at least this many bytes are written with their payload on a block (a header padded to 4 KiB, at most
#: 1.6% more), so that a mount reads and writes them with direct I/O (:mod:`.direct_io`)
DIRECT_MIN = 256 << 10
#: paths removed per request by ``collect_garbage`` (S3 DeleteObjects takes at most 1,000)
_DELETE_BATCH = 1000

#: the temp file a ``file://`` publish stages in, ``<64 hex>.tso.<32 hex>.tmp`` (see ``_publish_local``)
_TEMP_NAME = re.compile(r"(?P<key>[0-9a-f]{64})\.tso\.[0-9a-f]{32}" + re.escape(TMP_SUFFIX))


def _join(enc: objformat.Encoded) -> bytearray:
    """The object as one buffer for a single PUT, with one copy (``Encoded.tobytes`` makes two)."""
    buf = bytearray(enc.size)
    pos = 0
    for part in enc.parts:
        mv = memoryview(part).cast("B")
        buf[pos:pos + mv.nbytes] = mv
        pos += mv.nbytes
    return buf


class FsspecBackend(Backend):
    """Chunks as write-once objects under an fsspec URL, shared between processes and nodes.

    Parameters
    ----------
    name:
        As for every tier. There is no ``capacity`` (passing one raises :class:`ConfigError`): see the
        module docstring.
    url:
        Any fsspec URL: ``s3://bucket/prefix``, ``file:///mnt/nfs/kv``, ``memory://kv``, ``gs://…``.
        An unknown scheme, or one whose package is missing, raises :class:`ConfigError` before any I/O.
    storage_options:
        Keyword arguments for the filesystem (``endpoint_url``, ``key``, ``secret``, ``config_kwargs`` …).
        For ``s3://``, ``config_kwargs`` defaults to ``guarded.S3_CLIENT_DEFAULTS`` key by key.
    compression:
        ``None``/``"none"`` or ``"zstd"`` for objects this tier writes; it reads either.
    max_in_flight:
        Concurrent storage requests of this tier (all callers together; default 32, so a cold 64-chunk
        lookup is two round trips). An S3 client gets as many pooled connections unless
        ``config_kwargs`` says otherwise.
    list_on_open:
        Rebuild the index by listing the prefix at open (bounded by :attr:`list_timeout`). Without it the
        index fills lazily, as lookups find objects in storage.
    timeout:
        Seconds one storage request may take (default :data:`DEFAULT_TIMEOUT`). A lookup of a key this
        process has not seen makes one request (a HEAD), a get one GET (seen or not), a put one PUT (plus
        a HEAD for an unseen key): against a silent endpoint each returns a miss/``False`` within
        ``timeout``, and later calls return at once while the tier backs off.
    permissions:
        For a local or mounted path: ``"private"`` (folders 0700, objects 0600) or ``"group"`` (0770,
        0660) for the folders and objects this tier creates.
    verify_reads:
        ``"always"`` (default): every read checks its object's checksum. ``"once"`` (a local or mounted path,
        without ``auth``): a read into ``out`` skips the checksum of an uncompressed object this process wrote or
        already verified, as long as its file's inode, size and change time are still those it saw then and its
        header is unchanged (:mod:`.stamps` says what that does and does not catch).
    auth:
        Keys of the trust domain that shares the prefix (``keys_file`` or ``keys_env``, ``write_key``,
        ``tenant``, ``legacy``: :mod:`tierstore.keyring`). With keys every object written is sealed and
        every object read (or promoted into a tier above) must open with one of them
        (:mod:`tierstore.sealing`); one that does not is a miss counted ``forged`` and left in place.
    """

    kind = "remote"
    #: seconds the listing at open may take (at least ``timeout``); a prefix too large to list in that
    #: time starts with an empty index that fills as lookups find objects (or use ``list_on_open=False``)
    list_timeout: float = 30.0

    def __init__(self, name: str | None = None, capacity: None = None, url: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, compression: str | None = None,
                 max_in_flight: int = 32, list_on_open: bool = True, timeout: float = DEFAULT_TIMEOUT,
                 permissions: str = "private", touch_after: float | None = TOUCH_AFTER_S,
                 auth: Mapping[str, Any] | None = None, verify_reads: str = "always"):
        self.name = name or self.kind
        where = f"remote tier {self.name!r}"
        check_tier_options("remote", {"url": url, "capacity": capacity, "compression": compression,
                                      "max_in_flight": max_in_flight, "storage_options": storage_options,
                                      "list_on_open": list_on_open, "timeout": timeout,
                                      "permissions": permissions, "touch_after": touch_after,
                                      "verify_reads": verify_reads}, where=where)
        #: the keys objects are sealed and opened with; ``None``: objects are neither (see ``auth``)
        self.keyring = None if auth is None else Keyring.from_options(auth, f"{where}.auth")
        # keys whose object failed to open here: absent to lookups (no HEAD), so the next save replaces a
        # forgery instead of skipping a key that looks held; a read or put that succeeds clears the mark
        self._refused: OrderedDict[ChunkKey, None] = OrderedDict()
        # keys whose object a read here found damaged: the next write replaces it whatever its checksum field
        # says (a damaged payload keeps the header, and with it the checksum of the value it was); cleared as
        # ``_refused`` is
        self._damaged: OrderedDict[ChunkKey, None] = OrderedDict()
        self._lock = threading.Lock()
        self.failures = Failures(log, f"tier {self.name}: ")
        self._touches = 0
        self._closed = False
        self._dir_mode, self._file_mode = PERMISSIONS[permissions]
        self.url: str = url  # type: ignore[assignment]  # checked above
        self.codec = compression or "none"
        self.capabilities = Capabilities(objects=True, shared=True, persistent=True, probe_on_read=True,
                                         codec=self.codec)
        self.list_on_open = list_on_open
        self.max_in_flight = self.concurrency = max_in_flight
        self.timeout = float(timeout)
        options = with_client_defaults(self.url, storage_options or {}, connections=max_in_flight)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ValueError, TypeError, ImportError) as exc:
            raise ConfigError(f"remote tier url {url!r}: {exc}") from None
        self.root = root.rstrip("/")
        self.storage = GuardedStorage(self.fs, self.url, self.timeout, self._log_down)
        self._io = self.storage.call
        self._async = bool(getattr(self.fs, "async_impl", False))
        self._local = isinstance(self.fs, LocalFileSystem)
        #: ``verify_reads: once``: the files this process wrote or verified, unchanged since
        self._stamps = self._trust(verify_reads, auth, where)
        self._s3 = type(self.fs).__module__.startswith("s3fs")
        self._create_mode = True  # whether pipe_file takes mode="create" (cleared if the fs rejects it)
        self._worker = threading.local()
        # reads and lookups have pools of their own: behind a batch of multi-MiB writes an engine's load would
        # wait for all of them (its request waits), and a lookup for those and the reads (a scheduler step per
        # retry); lookups one by one would pay a mount's round trip (NFS) per key
        self._pool, self._read_pool, self._lookup_pool = (
            ThreadPoolExecutor(max_in_flight, thread_name_prefix=f"tierstore-{self.name}{role}",
                               initializer=self._mark_worker) for role in ("", "-read", "-lookup"))
        self._in_flight: set[Future[Any]] = set()  # pool tasks not finished yet (close waits for them)
        self.touch_after = touch_after
        self._uses = UseClock(touch_after or 0.0)  # when to refresh which object's last use
        if not list_on_open:
            self.storage.start_client()

    def _trust(self, verify_reads: str, auth: Any, where: str) -> Stamps | None:
        if verify_reads == "always":
            return None
        if not self._local:
            raise ConfigError(f"{where}.verify_reads: 'once' needs a local or mounted path (file://), not "
                              f"{self.url!r}: only a file's inode and change time show that it is unchanged")
        if auth is not None:
            raise ConfigError(f"{where}.verify_reads: 'once' with auth: a sealed object's MAC is checked on "
                              "every read")
        with contextlib.suppress(OSError):  # where its ctimes are probed (a reader may not create it: coarse)
            os.makedirs(self.root, mode=self._dir_mode, exist_ok=True)
        return Stamps(self.root)

    # ------------------------------------------------------------------ paths and plumbing
    def _path(self, key: ChunkKey) -> str:
        return f"{self.root}/{object_relpath(key)}"

    def _mark_worker(self) -> None:
        self._worker.active = True

    def _map(self, fn: Callable[[T], R], items: Iterable[T], pool: ThreadPoolExecutor | None = None
             ) -> list[R | BaseException]:
        """``[fn(x) for x in items]`` on ``pool`` (default the write pool; inline inside a worker of any: no
        deadlock), each item's exception its result; raises :class:`ClosedError` if a racing close dropped
        queued work."""
        items = list(items)
        if len(items) <= 1 or self.max_in_flight == 1 or getattr(self._worker, "active", False):
            return results_of(fn, items)
        futures = []
        try:
            for x in items:
                future = (pool or self._pool).submit(results_of, fn, [x])
                self._in_flight.add(future)
                future.add_done_callback(self._in_flight.discard)
                futures.append(future)
        except RuntimeError:  # pool shut down by a racing close()
            for future in futures:
                future.cancel()
            raise ClosedError(f"tier {self.name!r} is closed") from None
        try:
            return [f.result()[0] for f in futures]
        except concurrent.futures.CancelledError:  # queued work dropped by a racing close()
            raise ClosedError(f"tier {self.name!r} is closed") from None

    def _log_down(self, exc: BaseException, seconds: float) -> None:
        self.failures.report("down", "%s unreachable (%s: %s); requests fail fast for %.1fs at a time",
                             self.url, type(exc).__name__, exc, seconds)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"tier {self.name!r} is closed")

    # ------------------------------------------------------------------ listing
    def list(self) -> Iterator[Listed]:
        """Every finished object under the root, least recently modified first; a listing that fails gives
        nothing (counted, logged: the index then fills as lookups find objects)."""
        try:
            found = [Listed(key, f.size, f.mtime) for f in self._walk() if (key := self._own_name(f.rel, temp=False))]
        except OSError as exc:
            self.failures.report("list", "listing %s failed (%s); starting with an empty index", self.url, exc)
            return iter(())
        found.sort(key=lambda f: f.mtime)
        return iter(found)

    def _walk(self) -> Iterator[listing.Listed]:
        """Every file under the root, page by page (:mod:`.listing`): each S3 page has its own deadline
        (:attr:`list_timeout`). Raises ``OSError`` if the storage fails on the way."""
        if self._local:
            yield from listing.walk_local(self.root)
            return
        if self._s3:
            bucket, prefix, _ = self.fs.split_path(self.root)
            yield from listing.walk_s3(lambda params: self._io("call_s3", "list_objects_v2", self.fs.kwargs,
                                                               timeout=self.list_timeout, **params), bucket, prefix)
            return
        try:
            yield from listing.walk_fs(lambda: self._io("find", self.root, detail=True,
                                                        timeout=max(self.list_timeout, self.timeout)), self.root)
        except FileNotFoundError:
            return
        finally:  # a listing cache would go stale as other processes publish; lookups must hit storage
            try:
                self.fs.invalidate_cache(self.root)
            except Exception:
                pass

    def remove_stale_temp(self, older_than: float = 3600.0) -> int:
        """Delete temp files that crashed writers left under the root, modified more than ``older_than``
        seconds ago; returns how many (see :meth:`collect_garbage`)."""
        return self.collect_garbage(stale_after=older_than, grace=0.0, objects=False).removed_temp

    def remove_older_than(self, older_than: float) -> int:
        """Delete chunk objects last used more than ``older_than`` seconds ago, whoever wrote them; returns
        how many (see :meth:`collect_garbage`)."""
        return self.collect_garbage(older_than=older_than, grace=0.0, temp=False).removed_objects

    def collect_garbage(self, *, max_size: int | None = None, older_than: float | None = None,
                        grace: float = prefix_gc.GRACE_S, stale_after: float = 3600.0, objects: bool = True,
                        temp: bool = True) -> prefix_gc.Plan:
        """Keep the prefix within ``max_size`` bytes (least recently used first) and/or remove objects last
        used more than ``older_than`` seconds ago, and temp files older than ``stale_after``, deciding from
        one listing (:func:`prefix_gc.plan`): no object is read. Nothing younger than ``grace`` seconds is
        removed. Only this tier's own names are touched (objects ``<ab>/<64 hex>.tso``, temp files
        ``<ab>/<64 hex>.tso.<32 hex>.tmp`` and a publish's ``.publish-*``), never through a symlink.
        Removal is batched (one S3 DeleteObjects per 1,000); what another gc removed first is skipped."""
        for value, what in ((older_than, "older_than"), (stale_after, "stale_after"), (grace, "grace")):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value >= 0):
                raise InvalidInputError(f"{what} must be a number of seconds >= 0, got {value!r}")
        if max_size is not None and (not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 0):
            raise InvalidInputError(f"max_size must be a number of bytes >= 0, got {max_size!r}")
        self._check_open()
        entries = []
        for f in self._walk():
            key = self._own_name(f.rel, temp=False)
            if key is not None and objects:
                entries.append(prefix_gc.Entry(f"{self.root}/{f.rel}", f.size, f.mtime, key))
            elif key is None and temp and (self._own_name(f.rel, temp=True) is not None
                                           or f.rel.rpartition("/")[2].startswith(PUBLISH_PREFIX)):
                entries.append(prefix_gc.Entry(f"{self.root}/{f.rel}", f.size, f.mtime))
        decided = prefix_gc.plan(entries, time.time(), max_size=max_size, older_than=older_than, grace=grace,
                                 stale_after=stale_after)
        if self._local:  # never through a symlink (a mount's folder may have been swapped for one)
            decided.remove = [e for e in decided.remove
                              if not (os.path.islink(e.path) or os.path.islink(os.path.dirname(e.path)))]
        for i in range(0, len(decided.remove), _DELETE_BATCH):
            self._remove([e.path for e in decided.remove[i:i + _DELETE_BATCH]])
        return decided

    def _own_name(self, rel: str, temp: bool) -> ChunkKey | None:
        """The key if ``rel`` (a path under the root) is where this tier puts an object (``temp=False``)
        or a temp file of one (``temp=True``)."""
        folder, _, base = rel.partition("/")
        if temp:
            match = _TEMP_NAME.fullmatch(base)
            key = ChunkKey.from_hex(match["key"]) if match else None
        else:
            key = key_from_name(base)
        return key if key is not None and rel.startswith(key.hex()[:2] + "/") and "/" not in base else None

    def _remove(self, paths: builtins.list[str]) -> None:
        """Remove ``paths`` (one request on S3); already gone is fine."""
        if self._s3:
            try:
                self._io("rm", paths, timeout=max(self.timeout, self.list_timeout))
            except FileNotFoundError:
                pass
            return
        for path in paths:
            try:
                self._io("rm_file", path)
            except FileNotFoundError:
                pass  # its writer finished or another gc got there first

    def note_use(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` were served by a tier above: their objects here are in use too. Refreshed in the
        background as :class:`~.last_use.UseClock` decides (about one request per object per interval
        across the fleet), so a prefix every instance serves from its own memory is not the first thing
        ``gc --max-size`` removes."""
        if self.touch_after is not None:
            for key, check in self._uses.served_above(keys, time.time()):
                self._refresh(key, check)

    def _note_use(self, key: ChunkKey, modified: float) -> None:
        """A read found ``key``'s object last modified at ``modified``: refresh it in the background when
        that is more than ``touch_after`` seconds ago (see the module docstring)."""
        if self.touch_after is not None and self._uses.read(key, modified, time.time()):
            self._refresh(key, check=False)

    def _refresh(self, key: ChunkKey, check: bool) -> None:
        try:
            future = self._pool.submit(self._touch, key, check)
        except RuntimeError:  # closing
            return
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)

    def _touch(self, key: ChunkKey, check: bool = False) -> None:
        """Refresh the object's modification time; with ``check``, on S3, only when a HEAD finds it older
        than ``touch_after`` (another instance may have refreshed it: a HEAD costs less than a copy)."""
        path = self._path(key)
        try:
            if self._s3:  # a copy onto itself: a new Last-Modified, no bytes through this client
                if check:
                    modified = listing.mtime_of(self._head(path))
                    if time.time() - modified < self._uses.every:
                        self._uses.found_fresh(key, modified)
                        return
                bucket, name, _ = self.fs.split_path(path)
                self._io("call_s3", "copy_object", self.fs.kwargs, Bucket=bucket, Key=name,
                         CopySource={"Bucket": bucket, "Key": name}, MetadataDirective="REPLACE")
            elif self._local:
                os.utime(path, follow_symlinks=False)
            else:
                self._io("touch", path, truncate=False)
            self._uses.refreshed(key, time.time())
            with self._lock:
                self._touches += 1
        except FileNotFoundError:
            pass  # removed meanwhile (a gc): nothing to refresh
        except Exception as exc:  # a refresh is best effort: the object is still there and still valid
            self.failures.report("touch", "could not refresh the last use of %s (%s: %s)", key.hex(),
                                 type(exc).__name__, exc)

    def _head(self, path: str) -> Mapping[str, Any]:
        """One S3 HEAD of ``path`` (``fs.info`` would add a LIST for every miss)."""
        bucket, name, _ = self.fs.split_path(path)
        head: Mapping[str, Any] = self._io("call_s3", "head_object", self.fs.kwargs, Bucket=bucket, Key=name)
        return head

    # ------------------------------------------------------------------ one request per key, batched
    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>`` as part of one key's work: on an asynchronous filesystem its coroutine (awaited inside
        the batch's gather, which guards it), on others the guarded call's result."""
        if self._async:
            return getattr(self.fs, "_" + name)(*args, **kwargs)
        return self._io(name, *args, **kwargs)

    def _each(self, what: str, fn: Callable[[T], Coroutine[Any, Any, R]], items: Sequence[T]
              ) -> builtins.list[R | BaseException]:
        """``await fn(x)`` for every item, each item's exception its result: on an asynchronous filesystem one
        ``asyncio.gather`` on its event loop (at most ``max_in_flight`` at a time, each under ``timeout``); on
        others on the backend's pool, where ``fn``'s coroutine never suspends and runs to its end at once."""
        if self._async:
            return self.storage.gather(what, [partial(fn, x) for x in items], self.max_in_flight)
        return self._map(lambda x: _run_inline(fn(x)), items)

    def _stat(self, key: ChunkKey) -> int | None:
        """Size of ``key``'s object in storage, ``None`` if absent (a filesystem that is not asynchronous).
        Raises ``OSError`` on I/O failure."""
        return _run_inline(self._astat(key))

    async def _astat(self, key: ChunkKey) -> int | None:
        path = self._path(key)
        try:
            if self._s3:
                bucket, name, _ = self.fs.split_path(path)
                head = await _resolved(self._call("call_s3", "head_object", self.fs.kwargs, Bucket=bucket, Key=name))
                return int(head["ContentLength"])
            info = await _resolved(self._call("info", path))
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            # S3 answers a HEAD of a missing key with 403, not 404, when the caller may not list the bucket
            # (least-privilege credentials): a miss, not an error storm. A real denial shows on GET/PUT.
            self.failures.report("head-403", "lookup of %s denied (%s): treating as a miss; grant s3:ListBucket "
                                 "to tell misses from denials", self.url, exc)
            return None
        return info["size"] if info.get("type", "file") == "file" else None

    def stat_many(self, keys: Sequence[ChunkKey]) -> builtins.list[int | None]:
        """Sizes of the objects stored for ``keys`` (a HEAD each, concurrently); ``None`` for a key that has
        none, whose object this reader refused (forged), or whose lookup failed (counted)."""
        self._check_open()
        with self._lock:
            refused = {k for k in keys if k in self._refused}

        ask = [k for k in keys if k not in refused]
        if self._async:
            found = self.storage.gather("head", [partial(self._astat, k) for k in ask], self.max_in_flight)
        else:
            found = self._map(self._stat, ask, self._lookup_pool)
        size = dict(zip(ask, found, strict=True))
        for r in found:
            if isinstance(r, BaseException):
                self.failures.report("probe", "lookup failed (%s); treating as a miss", r)
        return [None if isinstance(r := size.get(k), BaseException) else r for k in keys]

    # ------------------------------------------------------------------ writes
    def prepare(self, key: ChunkKey, chunk: Chunk) -> Prepared:
        align = objformat.ALIGN
        if (self._local and self.keyring is None and self.codec == "none" and not isinstance(chunk, objformat.Encoded)
                and sum(t.nbytes for t in chunk.values() if isinstance(t, torch.Tensor)) >= DIRECT_MIN):
            align = direct_io.BLOCK  # the payload starts on a block: written and read with direct I/O
        enc = objformat.as_encoded(key, chunk, self.codec, payload_align=align)
        if self.keyring is not None:
            enc = sealing.seal(enc, self.keyring)
        return Prepared(enc, enc.size)

    def write_many(self, items: Sequence[tuple[ChunkKey, Prepared]]) -> builtins.list[BaseException | None]:
        self._check_open()
        return [r if isinstance(r, BaseException) else None
                for r in self._each("put", lambda item: self._store(item[0], item[1].payload), items)]

    async def _store(self, key: ChunkKey, payload: objformat.Encoded) -> None:
        path = self._path(key)
        with self._lock:
            damaged = key in self._damaged
        try:
            if damaged:  # a read found it damaged: its checksum field may name this very value, replace it
                await _resolved(self._replace(path, payload, key))
            elif await _resolved(self._stored_checksum(path)) == payload.checksum:
                return  # this value is there already (published by another writer, or by us before)
            else:
                try:
                    if self._local:
                        self._publish_local(path, payload, key=key)
                    else:
                        await _resolved(self._publish(path, _join(payload)))
                except FileExistsError:  # another value appeared meanwhile: ours is the newer put
                    if await _resolved(self._stored_checksum(path)) != payload.checksum:
                        await _resolved(self._replace(path, payload, key))
            self._uses.refreshed(key, time.time())
            self._mark_refused(key, False)
            self._mark_damaged(key, False)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                # the space is shared with other writers: skip the put, keep our capacity (no disk-style shrink)
                raise OSError(f"no space left under {self.url}: {exc}") from exc
            raise

    async def _stored_checksum(self, path: str) -> bytes | None:
        """The checksum field of the object at ``path`` (its bytes 16-32), from one small ranged read;
        ``None`` if there is none (or no valid prefix). Raises ``OSError`` on I/O failure."""
        try:
            if self._local:
                fd, _ = objfile.open_object(path)
                try:
                    head = os.pread(fd, objformat.PREFIX_SIZE, 0)
                finally:
                    os.close(fd)
            elif self._s3:
                head = await read_s3_range(self.fs, path, 0, objformat.PREFIX_SIZE)
            else:
                head = await _resolved(self._call("cat_file", path, start=0, end=objformat.PREFIX_SIZE))
        except (FileNotFoundError, CorruptObjectError):
            return None
        return bytes(head[16:32]) if len(head) == objformat.PREFIX_SIZE else None

    async def _replace(self, path: str, enc: objformat.Encoded, key: ChunkKey | None = None) -> None:
        """Put ``enc`` (``key``'s object) at ``path`` in place of what is there, in one atomic step."""
        if self._local:
            self._publish_local(path, enc, replace=True, key=key)
        else:
            await _resolved(self._call("pipe_file", path, _join(enc)))

    async def _publish(self, path: str, data: bytes | bytearray) -> None:
        if self._create_mode:
            try:
                await _resolved(self._call("pipe_file", path, data, mode="create"))
                return
            except (TypeError, OSError) as exc:
                if not isinstance(exc, TypeError) and not isinstance(exc.__cause__, TypeError):
                    raise
                # an fs without mode=: check, then write. A writer racing in between may have its object
                # replaced by ours, whole (pipe_file publishes at once); both are valid values of the key
                self._create_mode = False
                self.failures.report("create-mode", "%s has no create-only writes; checking existence first",
                                     type(self.fs).__name__)
        if await _resolved(self._call("exists", path)):
            raise FileExistsError(path)
        await _resolved(self._call("pipe_file", path, data))

    def _publish_local(self, path: str, enc: objformat.Encoded, replace: bool = False,
                       key: ChunkKey | None = None) -> None:
        """Write a unique temp file next to ``path``, then link it into place (fails if it exists), or with
        ``replace`` rename it over what is there. With ``verify_reads: once``, ``key``'s file is stamped as
        written: from its own descriptor once in place (another writer's file there since has another inode)."""
        tmp = f"{path}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = self._create_file(tmp, flags)
        except FileNotFoundError:
            self._make_folders(os.path.dirname(path))
            fd = self._create_file(tmp, flags)
        try:
            try:
                direct_io.write_object(fd, enc.parts)  # header and tensors as they are: no joined copy
                self._put_in_place(tmp, path, replace)
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            if self._stamps is not None and key is not None:
                self._stamps.keep(key, os.fstat(fd), enc.parts[0])  # linked and unlinked: its ctime as it stays
        finally:
            os.close(fd)

    @staticmethod
    def _put_in_place(tmp: str, path: str, replace: bool) -> None:
        if replace:
            os.replace(tmp, path)
            return
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

    def _create_file(self, path: str, flags: int) -> int:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), self._file_mode)
        try:
            os.fchmod(fd, self._file_mode)  # exactly the configured mode, whatever the umask
        except BaseException:
            os.close(fd)
            raise
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

    def _read(self, path: str) -> tuple[torch.Tensor | bytes, float]:
        """The whole object in one request (on S3 one GET, no HEAD first) and its modification time (0 when
        unknown); what is allocated is bounded by the object's real size. Raises ``FileNotFoundError`` if it
        does not exist."""
        if self._s3:
            return self.storage.run("get", lambda: read_s3_object(self.fs, path))
        data: bytes = self._io("cat_file", path)
        return data, 0.0

    async def _aread(self, path: str) -> tuple[torch.Tensor | bytes, float]:
        """:meth:`_read` as part of a batch on an asynchronous filesystem."""
        if self._s3:
            return await read_s3_object(self.fs, path)
        return await self.fs._cat_file(path), 0.0

    def _read_verified(self, key: ChunkKey, fetched: Any = None) -> tuple[objformat.Encoded, int, float]:
        """``key``'s whole object, checked (header, size, checksum and, with keys, its seal) but not decoded
        (an encrypted one decrypted into its plain object), its size as stored, and its modification time
        (0 when unknown). With keys, a sealed object's MAC stands for its checksum (on a mount it is computed
        as the object is read, while in cache). ``fetched``: what a batch's request got for it already (the
        object's bytes and time, or the request's exception)."""
        path = self._path(key)
        mac = None
        try:
            if self._local:  # a mount: read like the disk tier (no symlinks, no FIFOs, sizes checked first)
                fd, st = objfile.open_object(path)
                try:
                    buf, hdr, mac = objfile.read_verified(fd, st, key, self._mac_for)
                finally:
                    os.close(fd)
                enc, modified = objformat.Encoded.of_object(buf, hdr), st.st_mtime
            else:
                if isinstance(fetched, BaseException):
                    raise fetched
                raw, modified = self._read(path) if fetched is None else fetched
                enc = objformat.verified(raw, key, sealed_checked=self.keyring is not None)
            if self.keyring is not None:
                try:
                    if mac is not None:
                        sealing.finish(enc.header, mac)
                    else:
                        sealing.open_sealed(enc, self.keyring)
                except ForgedObjectError:
                    if enc.header.seal is not None and not enc.intact():  # damaged, not (only) forged
                        raise CorruptObjectError(f"checksum mismatch for {key.hex()}") from None
                    raise
            stored = enc.size
            if enc.header.seal is not None and enc.header.seal.enc is not None:
                if self.keyring is None:
                    raise UnsupportedObjectError(f"object {key.hex()} is encrypted and tier {self.name!r} has no keys")
                enc = sealing.decrypted(enc, self.keyring)
        except ForgedObjectError:
            self._mark_refused(key, True)
            raise
        except CorruptObjectError:
            self._mark_damaged(key, True)
            raise
        if self.keyring is not None:
            self._mark_refused(key, False)
        self._mark_damaged(key, False)
        return enc, stored, modified

    def _mac_for(self, hdr: objformat.Header, first: memoryview) -> Any:
        return sealing.start(hdr, first, self.keyring) if self.keyring is not None and hdr.seal is not None else None

    def _mark_refused(self, key: ChunkKey, refused: bool) -> None:
        self._remember(self._refused, key, refused)

    def _mark_damaged(self, key: ChunkKey, damaged: bool) -> None:
        self._remember(self._damaged, key, damaged)

    def _remember(self, table: OrderedDict[ChunkKey, None], key: ChunkKey, flag: bool) -> None:
        """Add ``key`` to ``table`` (the oldest entry goes past :data:`REFUSED_KEPT`) or take it out."""
        if not flag and not table:
            return  # the common case (a good read, nothing remembered): no lock
        with self._lock:
            if flag:
                table[key] = None
                table.move_to_end(key)
                if len(table) > REFUSED_KEPT:
                    table.popitem(last=False)
            else:
                table.pop(key, None)

    def _read_encoded(self, key: ChunkKey, fetched: Any = None) -> Hit | None:
        """``key``'s object, verified, not decoded, with its stored size; ``None`` if there is none (or S3
        denied the read: a missing key without s3:ListBucket). ``fetched`` as for :meth:`_read_verified`."""
        try:
            enc, stored, modified = self._read_verified(key, fetched)
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            if not self._s3:
                raise
            # as for a HEAD (see _stat): S3 answers 403 for a missing key without s3:ListBucket
            self.failures.report("get-403", "read of %s denied (%s): treating as a miss; grant s3:ListBucket to "
                                 "tell misses from denials", self.url, exc)
            return None
        self._note_use(key, modified)
        return Hit(enc, stored)

    def _objects(self, keys: Sequence[ChunkKey]) -> builtins.list[ReadResult]:
        """Each key's object, verified, not decoded: on an asynchronous filesystem the GETs are one gather and
        the objects are checked here, afterwards; on others each is read and checked on the pool."""
        self._check_open()
        keys = builtins.list(keys)
        if not self._async:
            return self._map(self._read_encoded, keys, self._read_pool)
        fetched = self.storage.gather("get", [partial(self._aread, self._path(k)) for k in keys], self.max_in_flight)
        return results_of(lambda kf: self._read_encoded(*kf), builtins.list(zip(keys, fetched, strict=True)))

    def read_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> builtins.list[ReadResult]:
        device = torch.device(device)

        def decoded(hit: Hit) -> Hit:
            tensors = objformat.decode_encoded(hit.value)
            if device.type != "cpu":
                tensors = {n: t.to(device) for n, t in tensors.items()}
            return Hit(tensors, hit.size)

        return [_then(r, decoded) for r in self._objects(keys)]

    def read_into_many(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]
                       ) -> builtins.list[ReadResult]:
        if self._local and self.keyring is None:
            self._check_open()
            return self._map(self._read_local_into, builtins.list(zip(keys, outs, strict=True)), self._read_pool)
        got = self._objects(keys)
        return [_then(r, partial(_filled, out)) for r, out in zip(got, outs, strict=True)]

    def _read_local_into(self, item: tuple[ChunkKey, Mapping[str, torch.Tensor]]) -> Hit | None:
        """One object on a mount straight into ``out`` as the disk tier reads it (no buffer of its own, checksum
        verified over the bytes in ``out``); an object or ``out`` that cannot be read so is read, verified and
        copied as on any other filesystem. Raises as :meth:`_read_verified` (``out`` then holds unspecified bytes)."""
        key, out = item
        path = self._path(key)
        stamps = self._stamps
        try:
            fd, st = objfile.open_object(path)  # st: before the read (a change after it moves the ctime)
        except FileNotFoundError:
            return None
        except CorruptObjectError:
            self._mark_damaged(key, True)
            raise
        try:
            trusted = stamps.trusted(key, st) if stamps is not None else None
            plan = file_reads.read_verified_into(fd, st, path, key, out, unsealed=True, trusted=trusted)
        except CorruptObjectError:
            self._mark_damaged(key, True)
            if stamps is not None:
                stamps.forget(key)
            raise
        finally:
            os.close(fd)
        if plan is None:
            hit = self._read_encoded(key)
            return None if hit is None else _filled(out, hit)
        if stamps is not None and trusted is None:
            stamps.keep(key, st, plan.head)
        self._mark_damaged(key, False)
        self._note_use(key, st.st_mtime)
        return Hit(dict(out), plan.size)

    def read_objects(self, keys: Sequence[ChunkKey]) -> builtins.list[ReadResult]:
        return self._objects(keys)

    def delete_many(self, keys: Sequence[ChunkKey]) -> builtins.list[BaseException | None]:
        self._check_open()
        return [r if isinstance(r, BaseException) else None for r in self._each("rm", self._remove_one, keys)]

    async def _remove_one(self, key: ChunkKey) -> None:
        try:
            await _resolved(self._call("rm_file", self._path(key)))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Stop the pool without waiting for stuck work: queued tasks are cancelled and running ones are
        given at most ``timeout`` seconds (their requests end by then on asynchronous filesystems)."""
        if self._closed:
            return
        self._closed = True
        for pool in (self._pool, self._read_pool, self._lookup_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        concurrent.futures.wait(self._in_flight | self.storage.in_flight, timeout=self.timeout)
        self.storage.cancel()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            touches = self._touches
        return {"url": self.url, "compression": self.codec, "backoff_s": self.storage.backoff,
                "touches": touches, "failures": self.failures.counts()}

    def __repr__(self) -> str:
        return f"<FsspecBackend {self.name!r} {self.url}>"


def _run_inline(coro: Coroutine[Any, Any, R]) -> R:
    """Run a coroutine that never suspends (one key's work on a filesystem that is not asynchronous) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a coroutine suspended outside an event loop")


async def _resolved(value: Any) -> Any:
    """``value``, awaited first if it is awaitable (a request on an asynchronous filesystem)."""
    return await value if inspect.isawaitable(value) else value


def _filled(out: Mapping[str, torch.Tensor], hit: Hit) -> Hit:
    return Hit(fill_out(out, objformat.decode_encoded(hit.value)), hit.size)


def _then(result: ReadResult, fn: Callable[[Hit], Hit]) -> ReadResult:
    """``fn(hit)`` for a hit, its exception as the result if it raises; a miss or an error as it is."""
    if not isinstance(result, Hit):
        return result
    try:
        return fn(result)
    except Exception as exc:  # noqa: BLE001 - the item's result
        return exc
