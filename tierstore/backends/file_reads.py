"""The disk backend's batched read path: many objects straight into caller-owned tensors.

**Careful read** (first read of a key, and whenever anything looks different): ``open``
(``O_NOFOLLOW``), ``fstat`` (a regular file of exactly the size its header states), header parsed and
validated, then one pass of ``readv`` calls that land the prefix and header in a small scratch buffer
and the payload directly in the caller's tensors, hashing each ~256 KiB step while it is still in cache (an object
whose payload starts on a 4 KiB block, read into block-aligned tensors, is read with ``O_DIRECT`` instead and
hashed in place: :func:`read_verified_into`, which a ``remote`` tier on a mount uses too).

**Planned read.** Once an object's checksum passed, its read plan is remembered (bounded): path, exact
prefix-and-header bytes, size and tensor layout. A later read of that key opens the file and reads it
with one ``preadv`` into scratch + ``out`` + one byte beyond (objects up to :data:`ONE_READ`; larger ones
in hashed steps as above), and accepts it only if exactly the planned size arrived, the header bytes
equal the remembered ones *and* the checksum over what was read matches. By default the checksum is
never skipped: the plan only saves a ``stat``, parsing, validation and Python bookkeeping. Anything else — a
different size, other header bytes (the file was replaced), a failed checksum, an I/O error, an ``out``
that does not fit the plan — falls back to the careful read, which decides (and classifies: corrupt, gone, error).

**Trusted read** (``verify_reads: once``). A plan may also hold the file's *stamp*, ``(inode, ctime, size)``,
taken before the read that verified it, or after the rename that put a file this process wrote in place.
A planned read calls ``fstat`` on the file first; when the stamp is unchanged it reads exactly as above but skips
the checksum (size and header bytes are still compared). Any change made through the file system — a
rewrite in place, a truncation, ``utime``, a rename over it — moves the ctime or the inode, and the next read
is verified again. A stamp is kept only when a later change is sure to move the ctime: the directory's file
system stamps a change made after a ``stat`` with a newer ctime (probed when the tier opens: Linux 6.13+
multigrain timestamps on ext4, xfs, btrfs, tmpfs), or the ctime is more than :data:`SETTLED_NS` old. What it
does not catch is damage below the file system after the first verified read: a bit flipped in the page
cache (memory without ECC) or on a medium whose own checks miss it. Our own refresh of the mtime on a hit
moves the ctime too, so the next read is verified again.

On a checksum failure ``out`` holds unspecified bytes. Work is split into one slice per I/O thread (not
one task per object), so a batch of small objects costs a few pool hand-offs rather than one per object,
and into no more slices than there are cores (see :data:`CORES`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from .. import objformat
from ..errors import CorruptObjectError
from ..iov import IOV_MAX, read_into
from ..keys import ChunkKey
from ..tensors import byte_alias, callers_streams, copy_segments, fill_out
from . import direct_io, objfile
from .base import Hit

if TYPE_CHECKING:
    from .base import ReadResult
    from .file import FileBackend

#: remembered read plans (a few hundred bytes each)
PLANS = 16384
#: the first read of the careful path: the prefix and a typical header (a longer one costs a second read)
HEAD_READ = 4096
#: objects up to this size are read with one ``preadv`` and hashed afterwards (still in cache)
ONE_READ = 1 << 20

#: a batch runs on at most one I/O thread per core: what the page cache serves is CPU-bound (copy, checksum,
#: per-object Python), and more threads than cores only contend for the GIL (on 2 cores, 4 threads read
#: 256 KiB objects 35% and 4 MiB ones ~15% slower than 2)
CORES = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

_P = objformat.PREFIX_SIZE
#: a stamp taken from a ctime older than this is kept on a file system that stamps changes coarsely (a change
#: within the same clock tick as the stamp would not move the ctime; ticks are milliseconds)
SETTLED_NS = 1_000_000_000

#: a byte past a planned read's size: a longer file fills it (its content is never looked at, so every thread
#: may read into this one)
_BEYOND = bytearray(1)


#: memoryviews of caller buffers by (address, length): an engine reads into the same KV pages again and again,
#: and making a view costs more than a 256 KiB read's other bookkeeping. A view is only ever used for a live
#: tensor at exactly that address and length, so a view outliving its first tensor is never dangling when used.
_VIEWS: dict[tuple[int, int], memoryview] = {}
_VIEWS_MAX = 65536
#: one object per distinct object layout (see ``Plan.layout``)
_LAYOUTS: dict[tuple[Any, int], tuple[Any, int]] = {}
_LAYOUTS_MAX = 4096
#: segments kept per ``out`` mapping (see ``BatchedReader.segments``)
_SEGMENTS_MAX = 4096


def fine_ctime(folder: str) -> bool:
    """Whether the file system of ``folder`` gives a change made after a ``stat`` a newer ctime, however soon
    (Linux 6.13+ multigrain timestamps), probed on a scratch file there: three writes, each right after an
    ``fstat``, must each move the ctime. ``False`` where the probe cannot run."""
    name = os.path.join(folder, f".ctime-probe.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return False
    try:
        for _ in range(3):
            before = os.fstat(fd).st_ctime_ns
            os.write(fd, b"x")
            if os.fstat(fd).st_ctime_ns == before:
                return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)


def stamp_of(st: os.stat_result) -> tuple[int, int, int]:
    """A file's *stamp*, ``(inode, ctime, size)``: any change made through the file system moves one of them."""
    return st.st_ino, st.st_ctime_ns, st.st_size


def head_digest(head: bytes | memoryview) -> bytes:
    """What ``verify_reads: once`` on a mount remembers of an object's prefix and header (:mod:`.stamps`)."""
    return xxhash.xxh3_128_digest(head)


def settled(stamp: tuple[int, int, int], fine: bool) -> tuple[int, int, int] | None:
    """``stamp`` if a later change is sure to move its ctime (``fine``: the file system's ctimes are fine, see
    :func:`fine_ctime`; else once it is :data:`SETTLED_NS` old), else ``None``."""
    return stamp if fine or time.time_ns() - stamp[1] > SETTLED_NS else None


def raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU ``t`` as a writable, flat ``"B"`` memoryview (any dtype, bfloat16 included).

    The view aliases ``t``'s memory without holding a reference to it: use it only while ``t`` is alive.
    Views are cached by (address, length), so reading into the same buffers again costs one dict lookup.
    """
    where = (t.data_ptr(), t.numel() * t.element_size())
    view = _VIEWS.get(where)
    if view is None:
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        view = _VIEWS[where] = memoryview((ctypes.c_char * where[1]).from_address(where[0])).cast("B")
    return view


#: a device ``out`` of up to this many bytes is read into the thread's pinned staging first (larger ones are
#: decoded and copied): at most this much pinned memory per I/O thread that fills device tensors
STAGE_MAX = 16 << 20


class _Staging(threading.local):
    """Per I/O thread: a host buffer (pinned when CUDA is present) and ``out``-shaped views of it by layout."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.views: dict[tuple[Any, ...], tuple[dict[str, torch.Tensor], list[tuple[int, int]]]] = {}


_staging = _Staging()


def _staging_for(out: Mapping[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]], torch.Tensor] | None:
    """For an ``out`` of contiguous tensors on a CUDA device: CPU tensors shaped like it in this thread's
    staging, their byte spans in it, and the buffer; ``None`` for any other ``out``."""
    if not all(t.is_cuda and t.is_contiguous() for t in out.values()) or len({t.device for t in out.values()}) != 1:
        return None
    layout = tuple((name, t.shape, t.dtype) for name, t in out.items())
    kept = _staging.views.get(layout)
    if kept is not None:
        return (*kept, _staging.buffer)
    spans, end = [], 0
    for t in out.values():
        spans.append((end, end + t.nbytes))
        end += -(-t.nbytes // 64) * 64
    if end > STAGE_MAX:
        return None
    if end > _staging.buffer.numel():
        _staging.buffer = torch.empty(max(end, 1 << 20), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        _staging.views.clear()
    buf = _staging.buffer
    staged = {name: buf[lo:hi].view(t.dtype).view(t.shape) for (name, t), (lo, hi) in zip(out.items(), spans,
                                                                                            strict=True)}
    if len(_staging.views) >= 64:
        _staging.views.clear()
    _staging.views[layout] = (staged, spans)
    return staged, spans, buf


@dataclass(slots=True)  # slots: fewer cache lines per read (they are cold after the previous object's copy)
class Plan:
    """How a verified object was laid out: enough to read it again without parsing its header."""

    path: str
    head: bytes  # the prefix and header, exactly as verified (the checksum sits in head[16:32])
    size: int
    #: per tensor in payload order: name, shape, dtype, bytes of padding before it
    tensors: tuple[tuple[str, torch.Size, torch.dtype | None, int], ...]
    tail: int  # padding after the last tensor
    mtime_ns: int  # the file's mtime as last seen or set (when to touch it again)
    #: ``(tensors, tail)``, one shared object for every plan of the same layout (so ``is`` compares them)
    layout: tuple[Any, int] = field(default=((), 0), repr=False, compare=False)
    #: ``(inode, ctime_ns, size)`` of the file when it was verified or written (``verify_reads: once``)
    stamp: tuple[int, int, int] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, path: str, head: bytes, hdr: objformat.Header, mtime_ns: int) -> Plan:
        specs, pos = [], 0
        for s in hdr.tensors:
            specs.append((s.name, torch.Size(s.shape), s.dtype, s.offset - pos))
            pos = s.offset + s.nbytes
        tensors, tail = tuple(specs), hdr.raw_size - pos
        layout = _LAYOUTS.setdefault((tensors, tail), (tensors, tail))
        if len(_LAYOUTS) > _LAYOUTS_MAX:
            _LAYOUTS.clear()
        return cls(path, head, hdr.object_size, tensors, tail, mtime_ns, layout)

    def segments(self, out: Mapping[str, torch.Tensor]) -> list[memoryview] | None:
        if len(out) != len(self.tensors):
            return None
        segs: list[memoryview] = []
        for name, shape, dtype, gap in self.tensors:
            t = out.get(name)
            if t is None or t.shape != shape or t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
                return None
            if gap:
                segs.append(memoryview(bytearray(gap)))
            if t.numel():
                segs.append(raw_view(t))
        if self.tail:
            segs.append(memoryview(bytearray(self.tail)))
        return segs


def read_verified_into(fd: int, st: os.stat_result, path: str, key: ChunkKey, out: Mapping[str, torch.Tensor],
                       unsealed: bool = False, trusted: bytes | None = None) -> Plan | None:
    """The careful read (see the module doc) of the open object ``fd`` at ``path``: its payload straight into the
    contiguous CPU tensors of ``out`` (no other buffer), hashed as it arrives, or with ``O_DIRECT`` and hashed once
    in ``out`` where the payload starts on a block and ``out`` is block-aligned (:mod:`.direct_io`); the object's
    plan once header, size and checksum passed. ``None``, with ``out`` untouched or holding unspecified bytes, when
    it cannot be read so: compressed, sealed (with ``unsealed``), an ``out`` that does not fit its header, or a file
    that changed between the header read and the payload's; the caller then reads it another way, which decides.
    ``trusted`` (``verify_reads: once``, :mod:`.stamps`): the digest of the prefix and header as this process last
    verified or wrote them, its file unchanged since; where the header read now has it, a payload read with
    ``O_DIRECT`` is not hashed (sizes are still checked).

    Raises:
        CorruptObjectError: damaged (header, size, checksum); ``out`` then holds unspecified bytes.
        UnsupportedObjectError: a newer format version.
        OSError: an I/O failure.
    """
    head, hdr = objfile.read_header(fd, st, key, first=HEAD_READ)  # sizes checked against the file's
    if hdr.codec != "none" or (unsealed and hdr.seal is not None):
        return None
    plan = Plan.of(path, bytes(head[:hdr.payload_offset]), hdr, st.st_mtime_ns)
    segments = plan.segments(out)
    if segments is None:  # out differs from the (unverified) header
        return None
    got = direct_io.read_payload(fd, segments, hdr.payload_offset)  # no page-cache copy where aligned
    if got is not None:  # the header as parsed is the one hashed: no second read of it to compare
        got += hdr.payload_offset
        if trusted is not None and got == hdr.object_size and head_digest(plan.head) == trusted:
            return plan
        h = xxhash.xxh3_128(memoryview(plan.head)[_P:])
        for s in segments:
            h.update(s)
    else:
        scratch = bytearray(hdr.payload_offset)  # prefix and header land here, the payload in out
        h = xxhash.xxh3_128()
        os.lseek(fd, 0, os.SEEK_SET)
        got = read_into(fd, [memoryview(scratch), *segments], h, skip=_P)
        if got == hdr.object_size and scratch != plan.head:  # changed under us between the header read and this one
            return None
    if got != hdr.object_size:
        raise CorruptObjectError(f"short read: {got} of {hdr.object_size} bytes")
    if h.digest() != plan.head[16:32]:
        raise CorruptObjectError(f"checksum mismatch for {key.hex()}")
    return plan


class BatchedReader:
    """Reads batches of objects of one :class:`~tierstore.backends.file.FileBackend` into ``out`` tensors."""

    def __init__(self, backend: FileBackend, trust: bool = False):
        self.backend = backend
        self.trust = trust  # verify_reads: once (see the module doc)
        self._fine_ctime = trust and not backend.read_only and fine_ctime(backend.path)
        self._plans: dict[ChunkKey, Plan] = {}  # read without the lock (one dict lookup); written under it
        self._lock = threading.Lock()
        # id(out) -> (out, [(name, tensor, address, numel)], layout, segments): see segments()
        self._segments: dict[int, tuple[Any, list[tuple[str, torch.Tensor, int, int]], Any, list[memoryview]]] = {}

    def segments(self, plan: Plan, out: Mapping[str, torch.Tensor]) -> list[memoryview] | None:
        """``plan.segments(out)``, kept per ``out`` with the tensors it was made for (and their addresses and
        sizes): an engine reads key after key into the same staging buffers, and checking shapes, dtypes and
        layout costs more than the rest of a 256 KiB read's bookkeeping. Reused for any plan of the same
        layout while ``out`` holds the same tensors."""
        kept = self._segments.get(id(out))
        if kept is not None and kept[0] is out and kept[2] is plan.layout and len(out) == len(kept[1]):
            for name, t, ptr, n in kept[1]:  # (a loop: a generator costs more than a 256 KiB read's bookkeeping)
                if out.get(name) is not t or t.data_ptr() != ptr or t.numel() != n:
                    break
            else:
                return kept[3]
        segs = plan.segments(out)
        if segs is not None:
            if len(self._segments) >= _SEGMENTS_MAX:
                self._segments.clear()
            self._segments[id(out)] = (out, [(name, t, t.data_ptr(), t.numel()) for name, t in out.items()],
                                       plan.layout, segs)
        return segs

    def read_many_into(self, keys: list[ChunkKey], outs: list[Mapping[str, torch.Tensor]]) -> list[ReadResult]:
        """Each object into its ``out``, one slice of the batch per I/O thread; per item ``out`` as a dict,
        ``None`` (no such object) or the exception (damaged, unsupported, an ``out`` that does not fit)."""
        n = len(keys)
        threads = min(self.backend.io_threads, n, CORES)
        results: list[ReadResult] = [None] * n
        # device outs are filled by the I/O threads: their copies must follow the work the caller queued
        after = callers_streams(t for o in outs for t in o.values()) if torch.cuda.is_initialized() else None
        hit = tuple.__new__  # a NamedTuple's own __new__ is a Python call

        def run(first: int) -> None:
            for i in range(first, n, threads):
                key, out = keys[i], outs[i]
                size = self._read_planned(key, out)
                if size:  # verified: nothing to classify
                    results[i] = hit(Hit, (out if type(out) is dict else dict(out), size))
                    continue
                try:
                    results[i] = self.read_into(key, out, after)
                except Exception as exc:  # noqa: BLE001 - the item's result
                    results[i] = exc

        if threads <= 1:
            run(0)
        else:
            self.backend.run_on_pool(run, threads)
        return results

    def _read_planned(self, key: ChunkKey, out: Mapping[str, torch.Tensor]) -> int:
        """Read ``key``'s object as its plan says into ``out``; its size when a plan exists and the read is
        verified, else 0 (see module doc)."""
        plan = self._plans.get(key)  # no lock: one dict lookup
        if plan is None:
            return 0
        segments = self.segments(plan, out)
        if segments is None or len(segments) + 2 > IOV_MAX:
            return 0
        scratch = bytearray(len(plan.head))
        try:
            fd = objfile.open_for_read(plan.path)  # a FIFO or directory fails the read below, a symlink the open
        except OSError:
            return 0
        try:
            stamp = None
            if self.trust:
                stamp = stamp_of(os.fstat(fd))  # before the read: a change after it moves the ctime
                if stamp == plan.stamp:
                    got = os.preadv(fd, [scratch, *segments, _BEYOND], 0)
                    if got != plan.size or scratch != plan.head:
                        return 0
                    plan.mtime_ns = self.backend.touch(fd, plan.mtime_ns)
                    return plan.size
            if plan.size <= ONE_READ:
                got = os.preadv(fd, [scratch, *segments, _BEYOND], 0)
                h = xxhash.xxh3_128(memoryview(scratch)[_P:])
                for s in segments:
                    h.update(s)
            else:
                h = xxhash.xxh3_128()
                got = read_into(fd, [scratch, *segments, _BEYOND], h, skip=_P)
            if got != plan.size or scratch != plan.head or h.digest() != plan.head[16:32]:
                return 0
            if stamp is not None:
                plan.stamp = self._settled(stamp)
            plan.mtime_ns = self.backend.touch(fd, plan.mtime_ns)
            return plan.size
        except OSError:
            return 0
        finally:
            os.close(fd)

    def read_into(self, key: ChunkKey, out: Mapping[str, torch.Tensor], after: Any = None) -> Hit | None:
        """One object into ``out``: planned when a plan exists and holds, else the careful read; ``None`` if
        there is no such object. ``after``: per CUDA device, the stream whose work a copy into ``out`` must
        follow (see :func:`~tierstore.tensors.copy_segments`; this thread's current stream by default)."""
        size = self._read_planned(key, out)
        if size:
            return Hit(dict(out), size)
        staging = _staging_for(out)
        if staging is not None:
            return self._read_staged(key, out, *staging, after)
        return self._read_carefully(key, out)

    def _read_staged(self, key: ChunkKey, out: Mapping[str, torch.Tensor], staged: dict[str, torch.Tensor],
                     spans: list[tuple[int, int]], buffer: torch.Tensor, after: Any) -> Hit | None:
        """A device ``out``: the object read as into CPU tensors (planned or careful, verified) into
        ``staged``, this thread's pinned host memory shaped like ``out``, then copied to the device."""
        hit = self.read_into(key, staged)
        if hit is None:
            return None
        copy_segments(buffer, [(byte_alias(t), 0, lo, hi) for t, (lo, hi) in zip(out.values(), spans, strict=True)],
                      after)
        return Hit(dict(out), hit.size)

    def _copy(self, key: ChunkKey, out: Mapping[str, torch.Tensor]) -> Hit | None:
        """Decode the whole object, then copy it into ``out`` (whatever its device, layout or codec)."""
        hit = self.backend.read_tensors(key)
        return None if hit is None else Hit(fill_out(out, hit.value), hit.size)

    def _read_carefully(self, key: ChunkKey, out: Mapping[str, torch.Tensor]) -> Hit | None:
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in out.values()):
            return self._copy(key, out)
        path = self.backend.object_path(key)
        try:
            fd, st = objfile.open_object(path)  # never a symlink, FIFO or directory
        except FileNotFoundError:
            return None
        try:
            plan = read_verified_into(fd, st, path, key, out)
            if plan is None:
                return self._copy(key, out)
            if self.trust:
                plan.stamp = self._settled(stamp_of(st))
            plan.mtime_ns = self.backend.touch(fd, plan.mtime_ns)
            self._remember(key, plan)  # only once its object verified
        finally:
            os.close(fd)
        return Hit(dict(out), plan.size)

    def remember_written(self, key: ChunkKey, path: str, written: objformat.Encoded, mtime_ns: int,
                         st: os.stat_result | None = None) -> None:
        """Plan the reads of an object this tier has just written, from its encoding (nothing re-parsed);
        ``st``: the file as renamed into place (its stamp, with ``verify_reads: once``)."""
        plan = Plan.of(path, bytes(written.parts[0]), written.header, mtime_ns)
        if self.trust and st is not None:
            plan.stamp = self._settled(stamp_of(st))
        self._remember(key, plan)

    def _settled(self, stamp: tuple[int, int, int]) -> tuple[int, int, int] | None:
        return settled(stamp, self._fine_ctime)

    def _remember(self, key: ChunkKey, plan: Plan) -> None:
        with self._lock:
            self._plans.pop(key, None)
            self._plans[key] = plan
            while len(self._plans) > PLANS:  # oldest first
                del self._plans[next(iter(self._plans))]

