"""The loading pipeline: planned ranged reads, run concurrently, delivered as tensors as soon as they land.

Every load goes through :func:`_run`: groups (see :mod:`.plan`) are admitted while the bytes they pin
stay under ``memory_limit``, their pieces are read by a pool of ``concurrency`` threads, and a group's
tensors are delivered the moment its last piece completes (completion order, not file order).

A piece lands in one of two ways:

* **direct** — ``preadv``/ranged read straight into its final CPU memory: a fresh group buffer whose
  slices become the yielded tensors (no extra copy), or the caller's parameters in :func:`load_into`;
* **staged** — into a slot of a bounded ring (pinned with CUDA), then copied to its destination: a device
  buffer (non-blocking H2D overlapped with other reads), a parameter of another dtype or layout, or any
  destination when the range is also being cached (the cache needs the range contiguous).

Pieces of a content-addressed (published) object are also fed, in file order, to its digest check
(:mod:`.digest`), and such an object is read whole; a store that saw a version pass remembers it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidInputError, InvalidTypeError, MissingKeyError
from ..tensors import alloc_host, byte_alias, callers_streams, copy_segments
from .cache import RangeCache
from .checkpoint import Checkpoint, open_checkpoint
from .digest import DigestCheck
from .header import TensorInfo
from .options import (
    CASTABLE,
    HOST_ALIGN,
    LOCAL_BLOCK_SIZE,
    LOCAL_CONCURRENCY,
    REMOTE_BLOCK_SIZE,
    REMOTE_CONCURRENCY,
    Options,
)
from .plan import Group, Piece, plan
from .sources import Source
from .staging import StagingRing, get_ring, put_ring

if TYPE_CHECKING:
    from ..api import Store

#: ``(dst, dst_offset, lo, hi)``: bytes ``[lo, hi)`` of a piece go to ``dst[dst_offset:]``
Segment = tuple[torch.Tensor, int, int, int]


@dataclass
class _Job:
    """A group in flight: pieces to run, bytes it pins, and what to do once every piece is in."""

    group: Group
    tasks: list[Callable[[], None]]
    charge: int
    finish: Callable[[], list[tuple[str, torch.Tensor]]]
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.tasks)


def _select(ckpt: Checkpoint, names: Iterable[str] | Callable[[str], bool] | None) -> set[str]:
    if names is None:
        return set(ckpt.tensors)
    if callable(names):
        return {n for n in ckpt.tensors if names(n)}
    if isinstance(names, str):
        names = [names]
    wanted = set(names)
    missing = sorted(wanted - set(ckpt.tensors))
    if missing:
        raise MissingKeyError(f"{ckpt.uri}: {len(missing)} requested tensor(s) not in the checkpoint: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return wanted


def _read_into(source: Source, offset: int, out: torch.Tensor, cache: RangeCache | None) -> None:
    if cache is not None:
        cache.read_into(source, offset, out)
    else:
        source.read_into(offset, out.numpy().data)


def _segments(g: Group, p: Piece, dests: Mapping[str, torch.Tensor]) -> list[Segment]:
    """``(dst, dst_offset, lo, hi)`` for every selected tensor overlapping piece ``p``."""
    out = []
    for t in g.tensors:
        lo, hi = max(p.start, t.start), min(p.end, t.end)
        if lo < hi:
            out.append((dests[t.name], lo - t.start, lo - p.start, hi - p.start))
    return out


def _tiles(p: Piece, segs: list[Segment]) -> bool:
    pos = 0
    for _, _, lo, hi in segs:
        if lo != pos:
            return False
        pos = hi
    return pos == p.nbytes


def _view(buf: torch.Tensor, offset: int, t: TensorInfo) -> torch.Tensor:
    seg = buf[offset:offset + t.nbytes]
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=buf.device)
    itemsize = torch.empty((), dtype=t.dtype).element_size()
    if seg.data_ptr() % itemsize:  # the file put this tensor at an unaligned offset
        seg = seg.clone()
    return seg.view(t.dtype).view(t.shape)


class _Pipeline:
    def __init__(self, ckpt: Checkpoint, o: Options, cache: RangeCache | None, staged_device: bool):
        self.ckpt, self.o, self.cache = ckpt, o, cache
        remote = any(s.source.remote for s in ckpt.shards)
        self.concurrency = o.concurrency or (REMOTE_CONCURRENCY if remote else LOCAL_CONCURRENCY)
        self._ring: StagingRing | None = None
        self._pinned = staged_device and torch.cuda.is_available()
        self.checks: dict[int, DigestCheck] = {}  # shard index -> the check of its digest
        for i, s in enumerate(ckpt.shards):
            if o.verify and s.digest and not (cache is not None and cache.verified(s.source, s.digest)):
                self.checks[i] = DigestCheck(s.source.name, s.digest, s.source.size, s.head)

    def plan(self, selected: set[str]) -> list[Group]:
        assert self.o.block_size is not None  # resolved by _open
        return plan(_shard_tensors(self.ckpt), selected, self.o.block_size, whole=self.cache is not None,
                    complete=self.checks)

    def reads(self, g: Group, segs: list[Segment]) -> bool:
        """Whether a piece of ``g`` feeding ``segs`` must be read at all."""
        return bool(segs) or self.cache is not None or g.shard in self.checks

    def ring(self) -> StagingRing:
        if self._ring is None:
            assert self.o.block_size is not None  # resolved by _open
            slot = -(-self.o.block_size // 4096) * 4096
            count = max(2, min(self.concurrency, self.o.memory_limit // slot))
            self._ring = get_ring(count, slot, self._pinned)
        return self._ring

    def piece_task(self, g: Group, p: Piece, segs: list[Segment]) -> Callable[[], None]:
        """Direct when every destination is CPU memory the piece tiles (and a cache, if any, gets one
        contiguous range); staged otherwise."""
        source = self.ckpt.shards[g.shard].source
        cache = self.cache
        check = self.checks.get(g.shard)

        def feed(bufs: list[memoryview]) -> None:
            if check is not None:
                check.feed(p.start, bufs)

        direct = all(d.device.type == "cpu" for d, *_ in segs) and _tiles(p, segs) and (
            cache is None or len(segs) == 1)
        if direct and len(segs) == 1:
            dst, off, _, _ = segs[0]
            out = dst[off:off + p.nbytes]

            def one() -> None:
                _read_into(source, p.start, out, cache)
                feed([out.numpy().data])
            return one
        if direct:
            bufs = [d[off:off + hi - lo].numpy().data for d, off, lo, hi in segs]

            def several() -> None:
                source.readv_into(p.start, bufs)
                feed(bufs)
            return several

        after = callers_streams(d for d, *_ in segs)  # (this runs on the caller's thread, the copies on a worker's)

        def staged() -> None:
            ring = self.ring()
            slot = ring.acquire()
            try:
                buf = slot[:p.nbytes]
                _read_into(source, p.start, buf, cache)
                feed([buf.numpy().data])
                copy_segments(buf, segs, after)
            finally:
                ring.release(slot)
        self.ring()  # allocate up front, in the caller's thread
        return staged

    def run(self, groups: list[Group], prepare: Callable[[Group], _Job]) -> Iterator[tuple[str, torch.Tensor]]:
        """Run ``groups`` with bounded memory and yield each group's tensors as soon as it completes."""
        o, t0 = self.o, time.perf_counter()
        pending = deque(groups)
        running: dict[Future[None], _Job] = {}
        inflight = pieces = 0
        max_pieces = 4 * self.concurrency
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="tierstore-weights")
        delivered = landed = 0
        total = sum(g.nbytes for g in groups)

        def report(job: _Job) -> None:
            nonlocal landed
            landed += job.group.nbytes
            if o.progress is not None:
                o.progress(landed, total)

        try:
            while pending or running:
                while pending and (inflight == 0 or (inflight + pending[0].nbytes <= o.memory_limit
                                                     and pieces < max_pieces)):
                    job = prepare(pending.popleft())
                    inflight += job.charge
                    if not job.tasks:
                        inflight -= job.charge
                        report(job)
                        yield from job.finish()
                        continue
                    for task in job.tasks:
                        running[pool.submit(task)] = job
                    pieces += len(job.tasks)
                if not running:
                    continue
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                finished = []
                for f in done:
                    job = running.pop(f)
                    pieces -= 1
                    f.result()  # a failed read fails the load: never a partial result as complete
                    job.remaining -= 1
                    if job.remaining == 0:
                        finished.append(job)
                for job in finished:
                    inflight -= job.charge
                    report(job)
                    for item in job.finish():
                        delivered += 1
                        yield item
            self.ckpt.check_unchanged()
            for i in sorted({g.shard for g in groups} & set(self.checks)):
                self.checks[i].final()
                if self.cache is not None:
                    s = self.ckpt.shards[i]
                    self.cache.mark_verified(s.source, s.digest or "")
        finally:
            for check in self.checks.values():
                check.abort()  # pieces still waiting for their turn give up, so the pool can shut down
            for f in running:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            if self._ring is not None:
                put_ring(self._ring)
                self._ring = None
            if o.stats is not None:
                o.stats.update(self._stats(groups, time.perf_counter() - t0, delivered))
            self.ckpt.close()

    def _stats(self, groups: list[Group], seconds: float, delivered: int) -> dict[str, Any]:
        out = {"tensors": delivered, "bytes": sum(t.nbytes for g in groups for t in g.tensors),
               "bytes_planned": sum(g.nbytes for g in groups), "seconds": seconds,
               "source_reads": sum(s.source.reads for s in self.ckpt.shards),
               "source_bytes": sum(s.source.bytes_read for s in self.ckpt.shards),
               "concurrency": self.concurrency, "block_size": self.o.block_size,
               "digests_checked": len({g.shard for g in groups} & set(self.checks))}
        if self.cache is not None:
            out.update(self.cache.stats())
        return out


def _open(uri: str | os.PathLike[str], store: Store | None, storage_options: dict[str, Any] | None,
          o: Options) -> tuple[Checkpoint, RangeCache | None, int]:
    if not isinstance(uri, (str, bytes)) and not hasattr(uri, "__fspath__"):
        raise InvalidTypeError(f"uri must be a path or URL, got {type(uri).__name__}")
    uri = str(uri.__fspath__() if hasattr(uri, "__fspath__") else uri)
    cache = RangeCache(store, write=o.cache_writes) if store is not None else None
    conc = o.concurrency or REMOTE_CONCURRENCY
    ckpt = open_checkpoint(uri, storage_options, cache, conc, o.max_header_size, o.objects_url)
    if o.block_size is None:
        remote = any(s.source.remote for s in ckpt.shards)
        o.block_size = REMOTE_BLOCK_SIZE if remote else LOCAL_BLOCK_SIZE
    return ckpt, cache, o.block_size


def _shard_tensors(ckpt: Checkpoint) -> list[tuple[TensorInfo, ...]]:
    return [s.header.tensors for s in ckpt.shards]


def iter_tensors(uri: str | os.PathLike[str], device: str | torch.device = "cpu", store: Store | None = None,
                 storage_options: dict[str, Any] | None = None, **opts: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs of a safetensors checkpoint, each as soon as its bytes land.

    Every header (and the index, if any) is read and validated when this is called, before any tensor
    data is read; tensors are then yielded in completion order, on ``device``. CPU tensors are views
    over freshly read buffers owned by the caller (no extra copy); on CUDA the bytes pass through a
    bounded ring of pinned buffers with non-blocking copies.

    Args:
        uri: a ``.safetensors`` file, an ``*.safetensors.index.json``, or a directory / prefix of them;
            a local path or any fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).
        device: where the tensors go (``"cpu"``, ``"cuda:0"`` ...).
        store: a tierstore store; fetched byte ranges are cached in it, so a second load of the same
            file version is served by the store's tiers.
        storage_options: fsspec options for ``uri`` (e.g. ``{"endpoint_url": ...}``).
        **opts: ``names`` (iterable of names or a predicate) to load a subset; ``concurrency`` (reads
            in flight, default 8 local / 16 remote); ``block_size`` (read size, default 64 MiB local /
            16 MiB remote);
            ``memory_limit`` (bytes of read-but-undelivered data and staging, default 1 GiB — one
            group larger than the limit still loads, alone); ``dtype`` (cast F16/BF16/F32/F64 tensors
            to this float dtype; other dtypes are left alone); ``max_header_size``; ``stats`` (a dict
            filled with counters when the iteration ends); ``progress`` (called as
            ``progress(bytes_done, bytes_total)`` as tensors land); ``cache_writes`` (default True: with a
            ``store``, write fetched ranges into it; False reads from it only); ``objects_url`` (where an index may name
            shards besides its own directory: the ``objects_url`` given to :func:`publish`); ``verify``
            (default True: check every object of a published checkpoint against the digest in its name —
            such an object is then read whole, and a store remembers a version that passed).

    Raises:
        CheckpointError: a malformed or truncated file, index or header (names the file and tensor), or
            a published object whose bytes do not match its name (raised by the iteration, before it ends).
        CheckpointNotFoundError: ``uri`` or a shard named by the index does not exist.
        MissingKeyError: a name in ``names`` is not in the checkpoint.
    """
    o = Options.build(opts)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device {device} requested but CUDA is not available")
    ckpt, cache, _ = _open(uri, store, storage_options, o)
    try:
        selected = _select(ckpt, o.names)
    except BaseException:
        ckpt.close()
        raise
    pipe = _Pipeline(ckpt, o, cache, staged_device=device.type != "cpu")
    groups = pipe.plan(selected)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(o.dtype) if o.dtype is not None and t.dtype in CASTABLE and t.dtype != o.dtype else t

    def prepare(g: Group) -> _Job:
        pad = g.start % HOST_ALIGN  # tensors keep their file alignment in memory
        buf = (alloc_host(pad + g.nbytes) if device.type == "cpu"
               else torch.empty(pad + g.nbytes, dtype=torch.uint8, device=device))
        body = buf[pad:]
        dests = {t.name: body[t.start - g.start:t.end - g.start] for t in g.tensors}
        tasks = []
        for p in g.pieces:
            if device.type == "cpu":  # land the whole piece, selected or not, in the group buffer
                tasks.append(pipe.piece_task(g, p, [(body, p.start - g.start, 0, p.nbytes)]))
            else:
                segs = _segments(g, p, dests)
                if pipe.reads(g, segs):
                    tasks.append(pipe.piece_task(g, p, segs))
        return _Job(g, tasks, g.nbytes,
                    lambda: [(t.name, cast(_view(body, t.start - g.start, t))) for t in g.tensors])

    return pipe.run(groups, prepare)


def load(uri: str | os.PathLike[str], device: str | torch.device = "cpu", store: Store | None = None,
         storage_options: dict[str, Any] | None = None, **opts: Any) -> dict[str, torch.Tensor]:
    """Load a whole safetensors checkpoint (or the ``names`` subset) into a dict on ``device``.

    Same arguments and errors as :func:`iter_tensors`; either every tensor is returned or an error is
    raised (never a partial dict).
    """
    return dict(iter_tensors(uri, device, store, storage_options, **opts))


def load_into(params: Mapping[str, torch.Tensor], uri: str | os.PathLike[str], store: Store | None = None,
              storage_options: dict[str, Any] | None = None, *, strict: bool = True, **opts: Any) -> list[str]:
    """Fill the existing tensors ``params`` (e.g. ``model.state_dict()``) in place from a checkpoint.

    Reads land straight in the parameters' memory where they can (CPU, contiguous, same dtype, no
    cache) — one ``preadv`` fills several parameters — and go through the bounded staging ring
    otherwise (GPU parameters with non-blocking H2D copies, another dtype: cast on copy, a cache).
    Checkpoint tensors not in ``params`` are not read.

    Args:
        params: name → tensor to fill; shapes must match the checkpoint's.
        strict: if False, names of ``params`` missing from the checkpoint are left untouched instead
            of raising.
        uri, store, storage_options, **opts: as for :func:`iter_tensors` (``names`` and ``dtype``
            are not accepted: ``params`` decides both).

    Returns:
        The names that were filled.

    Raises:
        MissingKeyError: (strict) a name of ``params`` is not in the checkpoint; nothing is read.
        InvalidInputError: a shape differs from the checkpoint's.
        CheckpointError / CheckpointNotFoundError: as for :func:`iter_tensors`.
    """
    if not isinstance(params, Mapping):
        raise InvalidTypeError(f"params must be a Mapping[str, Tensor], got {type(params).__name__}")
    if "names" in opts or "dtype" in opts:
        raise InvalidInputError("load_into takes neither names= nor dtype=: params decides both")
    o = Options.build(opts)
    for name, p in params.items():
        if not isinstance(p, torch.Tensor):
            raise InvalidTypeError(f"params[{name!r}] is {type(p).__name__}, not a torch.Tensor")
    ckpt, cache, _ = _open(uri, store, storage_options, o)
    try:
        missing = sorted(set(params) - set(ckpt.tensors))
        if missing and strict:
            raise MissingKeyError(f"{ckpt.uri}: {len(missing)} parameter(s) missing from the checkpoint: "
                                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        selected = set(params) & set(ckpt.tensors)
        for name in selected:
            shard, info = ckpt.tensors[name]
            if tuple(params[name].shape) != info.shape:
                raise InvalidInputError(f"{ckpt.shards[shard].source.name}: tensor {name!r} has shape "
                                        f"{list(info.shape)} but params[{name!r}] has "
                                        f"{list(params[name].shape)}")
    except BaseException:
        ckpt.close()
        raise
    pipe = _Pipeline(ckpt, o, cache, staged_device=any(p.device.type != "cpu" for p in params.values()))
    groups = pipe.plan(selected)

    def prepare(g: Group) -> _Job:
        dests, post, charge = {}, [], 0
        for t in g.tensors:
            p = params[t.name]
            if p.dtype == t.dtype and p.is_contiguous():
                dests[t.name] = byte_alias(p)
            else:  # land in a temporary, then cast / restride into the parameter
                tmp = torch.empty(t.nbytes, dtype=torch.uint8)
                dests[t.name] = tmp
                post.append((p, tmp, t))
                charge += t.nbytes
        tasks = [pipe.piece_task(g, pc, segs) for pc in g.pieces if pipe.reads(g, segs := _segments(g, pc, dests))]

        def finish() -> list[tuple[str, torch.Tensor]]:
            for p, tmp, t in post:
                with torch.no_grad():
                    p.copy_(_view(tmp, 0, t))
            return [(t.name, params[t.name]) for t in g.tensors]
        return _Job(g, tasks, charge, finish)

    filled = [name for name, _ in pipe.run(groups, prepare)]
    if any(p.device.type == "cuda" for p in params.values()):
        torch.cuda.synchronize()
    return filled


