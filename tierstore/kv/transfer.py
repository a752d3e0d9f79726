"""Moving KV between stored chunk objects and an engine's paged KV cache (``load_into`` / ``save_from``).

The data path of one call: the chunks to move are cut into *tasks* — one layer group (the layers one
stored object holds) times one window of chunks — processed in layer order. One copy each way where the
host tier holds the bytes: a load scatters the chunks the store lends (``store.lend``: the pool's own
memory) straight into the cache's blocks, a save gathers the blocks straight into pool memory the store
reserves for the chunks (``store.reserve``) and commits them. Other chunks are read with one batched
``store.get_many(out=...)`` into a reusable staging buffer while the previous task's rows are scattered, or
gathered into staging and stored with one ``store.put_many``. Staging holds at most two tasks, never the
whole transfer, and layer ``i`` is complete as soon as its group's last window is scattered:
:class:`LayerwiseLoad` resolves one future per layer then. Where the rows are and how they are copied:
:mod:`tierstore.kv.rows`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..keys import ChunkKey
from ..tensors import alloc_host
from .rows import PagedTransfer, Piece

#: bytes of staging per task (two tasks are in flight); a window holds as many chunks as fit
STAGING_BYTES = 64 << 20


class LayerwiseLoad:
    """Handle of a layer-wise :meth:`~tierstore.KVCacheStore.load_into`: one future per layer.

    ``layer(i)`` resolves to the number of leading tokens written into layer ``i`` once they are in the
    cache (attention over layer ``i`` may start); :meth:`result` is the number valid in *every* layer —
    what the engine may treat as loaded (a chunk that vanished mid-load shortens it; the blocks past it
    must be recomputed). Any error fails every pending future.
    """

    def __init__(self, num_layers: int):
        self._layers: list[Future[int]] = [Future() for _ in range(num_layers)]
        self._done: Future[int] = Future()

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, i: int) -> Future[int]:
        return self._layers[i]

    def wait_for_layer(self, i: int, timeout: float | None = None) -> int:
        """Block until layer ``i`` is in the cache; returns its loaded token count."""
        return self._layers[i].result(timeout)

    def result(self, timeout: float | None = None) -> int:
        """Block until every layer is in the cache; returns the tokens valid in all of them."""
        return self._done.result(timeout)

    def done(self) -> bool:
        return self._done.done()

    def _fail(self, exc: BaseException) -> None:
        for f in (*self._layers, self._done):
            if not f.done():
                f.set_exception(exc)


@dataclass
class Task:
    group: tuple[int, int]  # layers [lo, hi) stored in one object
    pieces: list[Piece]
    keys: list[ChunkKey]  # one object key per piece


class Staging:
    """Reusable host buffers for staged chunks (pinned under CUDA), so transfers do not page-fault fresh
    memory on every call. At most ``keep_bytes`` are kept between transfers (the largest buffers)."""

    def __init__(self, keep_bytes: int = 4 * STAGING_BYTES):
        self._free: list[torch.Tensor] = []
        self._keep = keep_bytes
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes and buf.is_pinned() == pinned:
                    return self._free.pop(i)
        if pinned:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return alloc_host(max(nbytes, 1))

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel())
            kept = sum(b.numel() for b in self._free)
            while kept > self._keep:
                kept -= self._free.pop(0).numel()

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


#: layer-wise loads of one store running at once, over all its KVCacheStores and tenants (each holds up to two
#: staging buffers); more queue
_LOADERS = 4


class _PerStore:
    """What every :class:`KVCacheStore` over one store shares, whatever its tenant or namespace: the staging
    buffers and the threads of layer-wise loads (one engine, many tenants: one set, not one per tenant)."""

    def __init__(self) -> None:
        self.staging = Staging()
        self._loader: ThreadPoolExecutor | None = None  # started on first use
        self._lock = threading.Lock()

    def loader(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(_LOADERS, thread_name_prefix="tierstore-kv-load")
            return self._loader


_PER_STORE: weakref.WeakKeyDictionary[object, _PerStore] = weakref.WeakKeyDictionary()
_PER_STORE_LOCK = threading.Lock()


def per_store(store: object) -> _PerStore:
    """``store``'s shared staging and loader threads (gone with the store)."""
    with _PER_STORE_LOCK:
        try:
            got = _PER_STORE.get(store)
            if got is None:
                got = _PER_STORE[store] = _PerStore()
        except TypeError:  # a store that cannot be weakly referenced: its own set per KVCacheStore
            got = _PerStore()
        return got


def stage(buf: torch.Tensor, task: Task, transfer: PagedTransfer, layer_name: Callable[[int], str]
          ) -> tuple[list[dict[str, torch.Tensor]], dict[int, list[torch.Tensor]]]:
    """Carve ``buf`` into one canonical tensor per (layer, piece), layer-major so that a layer's pieces
    are adjacent. Returns the per-object ``out`` mappings and the per-layer tensors."""
    lo, hi = task.group
    outs: list[dict[str, torch.Tensor]] = [{} for _ in task.pieces]
    by_layer: dict[int, list[torch.Tensor]] = {}
    pos = 0
    for j in range(lo, hi):
        by_layer[j] = []
        for i, p in enumerate(task.pieces):
            shape = transfer.canonical_shape(p.stored)
            n = torch.Size(shape).numel() * transfer.dtype.itemsize
            t = buf[pos:pos + n].view(transfer.dtype).view(shape)
            pos += n
            outs[i][layer_name(j)] = t
            by_layer[j].append(t)
    return outs, by_layer


def task_bytes(task: Task, transfer: PagedTransfer) -> int:
    per_token = torch.Size(transfer.canonical_shape(1)).numel() * transfer.dtype.itemsize
    return sum(p.stored for p in task.pieces) * per_token * (task.group[1] - task.group[0])


def windows(pieces: list[Piece], per_chunk_bytes: int, budget: int | None = None) -> list[list[Piece]]:
    """``pieces`` cut into windows of at most ``budget`` bytes (default :data:`STAGING_BYTES`, read at the call),
    at least one chunk each."""
    size = max(1, (STAGING_BYTES if budget is None else budget) // max(1, per_chunk_bytes))
    return [pieces[i:i + size] for i in range(0, len(pieces), size)]


def _lent(loan: Any, task: Task, transfer: PagedTransfer, layer_name: Callable[[int], str]
          ) -> list[dict[str, torch.Tensor] | None]:
    """Per piece of ``task``, the chunk the store lent if it has exactly the tensors a stored chunk of that piece
    has (else ``None``: it is read like any other)."""
    lo, hi = task.group
    got: list[dict[str, torch.Tensor] | None] = []
    for p, d in zip(task.pieces, loan.tensors if loan is not None else [None] * len(task.pieces), strict=True):
        shape = transfer.canonical_shape(p.stored)
        ok = d is not None and len(d) == hi - lo and all(
            (t := d.get(layer_name(j))) is not None and t.dtype == transfer.dtype and tuple(t.shape) == shape
            and t.is_contiguous() for j in range(lo, hi))
        got.append(d if ok else None)
    return got


class _Loading:
    """One task on its way into the cache: the chunks the store lent (scattered from its memory: no copy
    before the scatter) and a read of the others into a staging buffer."""

    def __init__(self, loan: Any, lent: list[dict[str, torch.Tensor] | None], read: Future[list[Any]] | None,
                 by_layer: dict[int, list[torch.Tensor]], buf: torch.Tensor | None):
        self.loan, self.lent, self.read, self.by_layer, self.buf = loan, lent, read, by_layer, buf


def run_load(store: Any, transfer: PagedTransfer, tasks: list[Task], staging: Staging, layer_name: Callable[[int], str],
             valid: int, handle: LayerwiseLoad | None = None) -> tuple[int, int, int]:
    """Move ``tasks`` in order (the next one read while the current one is scattered) into the cache.

    Chunks the store's top tier lends (``store.lend``: the host pool's own memory, pinned against eviction and
    reuse until the loan is closed) are scattered straight from there: one copy. The others are read with one
    batched ``get_many(out=...)`` into a staging buffer and scattered from it. The next task is submitted once
    the current one's objects are in, not before: two reads at once would only share the CPU and delay the
    current one (and with it the layer an engine is waiting for); after a task the store lent whole, only once
    its layers are resolved (there is no read to overlap, and lending the next first delays them).

    ``valid`` is the token count the caller expects; a missing or mismatching object lowers it to the
    start of its chunk and nothing from that chunk on is written. Layer futures of ``handle`` resolve as
    their group's last window lands. Returns ``(valid, objects read, objects missed)``. On an error it
    returns (raises) only once no read it submitted is still running (see :func:`_give_back`).
    """
    pinned = transfer.device.type == "cuda" and torch.cuda.is_available()
    size = max(task_bytes(t, transfer) for t in tasks)
    lend = getattr(store, "lend", None)
    spare: list[torch.Tensor] = []  # staging buffers of this load not in use by a task
    held: list[torch.Tensor] = []  # every staging buffer this load acquired
    last_of_group = {t.group: i for i, t in enumerate(tasks)}
    read = missed = 0
    reads: list[Future[list[Any]]] = []
    loans: list[Any] = []

    def submit(task: Task) -> _Loading:
        loan = lend(task.keys) if lend is not None else None
        if loan is not None:
            loans.append(loan)
        lent = _lent(loan, task, transfer, layer_name)
        todo = [k for k, d in enumerate(lent) if d is None]
        if not todo:
            return _Loading(loan, lent, None, {}, None)
        if not spare:
            held.append(staging.acquire(size, pinned))
            spare.append(held[-1])
        buf = spare.pop()
        outs, by_layer = stage(buf, task, transfer, layer_name)
        reads.append(store.get_many_async([task.keys[k] for k in todo], out=[outs[k] for k in todo]))
        return _Loading(loan, lent, reads[-1], by_layer, buf)

    try:
        pending = submit(tasks[0])
        for i, task in enumerate(tasks):
            cur = pending
            results: list[Any] = list(cur.lent)
            if cur.read is not None:
                got = iter(cur.read.result())
                results = [d if d is not None else next(got) for d in cur.lent]
            # next task's read overlaps this scatter when this one read from below; when the store lent every chunk
            # of this one (likely the next's too: no I/O to overlap) its layers are finished first
            early = cur.read is not None
            if early and i + 1 < len(tasks):
                pending = submit(tasks[i + 1])
            for p, r in zip(task.pieces, results, strict=True):
                if r is None:
                    missed += 1
                    valid = min(valid, p.first)
            read += sum(r is not None for r in results)
            keep = [k for k, p in enumerate(task.pieces) if p.first < valid]  # valid is a chunk start or the goal
            if keep:
                pieces = [task.pieces[k] for k in keep]
                for j in range(*task.group):
                    name = layer_name(j)
                    sources = [d[name] if (d := cur.lent[k]) is not None else cur.by_layer[j][k] for k in keep]
                    transfer.scatter(j, pieces, sources)
            transfer.synchronize()  # copies out of this staging buffer or lent memory finish before either goes
            if cur.loan is not None:
                for k in cur.loan.changed():  # lent memory reused mid-copy (a node server's expired lease): a miss
                    if cur.lent[k] is not None:
                        missed += 1
                        valid = min(valid, task.pieces[k].first)
                cur.loan.close()
            if cur.buf is not None:
                spare.append(cur.buf)
            if last_of_group[task.group] == i and handle is not None:
                for j in range(*task.group):
                    handle.layer(j).set_result(valid)
            if not early and i + 1 < len(tasks):
                pending = submit(tasks[i + 1])
    finally:
        _give_back(staging, held, transfer, reads, loans)
    return valid, read, missed


def run_save(store: Any, transfer: PagedTransfer, tasks: list[Task], staging: Staging,
             layer_name: Callable[[int], str], wait: bool = True) -> list[bool]:
    """Store each task's chunks out of the cache; per piece (in task order) whether it is stored.

    Where the store reserves pool memory (``store.reserve``: its top tier is a host pool) the chunks are
    gathered straight into it and committed once the copy is done: one copy, nothing visible before the commit,
    everything given back on an error. The others are gathered into staging and stored with one ``put_many``;
    with ``wait=False`` (a store that reserves) they are not stored: the reservation waits for nothing."""
    reserve = getattr(store, "reserve", None)
    if reserve is not None and not wait:
        reserve = partial(reserve, wait=False)
    reserved: dict[int, list[bool | None]] = {}  # task -> per piece: stored, not, or None (put it)
    if reserve is not None:  # a layer group's chunks in one reservation: one commit, one gather per piece
        groups: dict[tuple[int, int], list[int]] = {}
        for i, t in enumerate(tasks):
            groups.setdefault(t.group, []).append(i)
        limit = getattr(store, "reserve_limit", None)  # what one reservation holds (a node server's staging area)
        for group, members in groups.items():
            for batch in _within(members, [task_bytes(t, transfer) for t in tasks], limit):
                whole = Task(group, [p for i in batch for p in tasks[i].pieces],
                             [k for i in batch for k in tasks[i].keys])
                got = iter(_save_reserved(reserve, transfer, whole, layer_name))
                for i in batch:
                    reserved[i] = [next(got) for _ in tasks[i].pieces]
    ok: list[bool] = []
    buf: list[torch.Tensor] = []
    stored = True  # False while a put_many runs: one that raised may leave per-key work reading ``buf``
    try:
        for ti, task in enumerate(tasks):
            done: list[bool | None] = reserved.get(ti) or [None] * len(task.pieces)
            if not wait:
                done = [bool(d) for d in done]
            rest = [k for k, d in enumerate(done) if d is None]
            if rest:
                part = Task(task.group, [task.pieces[k] for k in rest], [task.keys[k] for k in rest])
                if not buf:
                    buf.append(staging.acquire(max(task_bytes(t, transfer) for t in tasks), False))
                outs, by_layer = stage(buf[0], part, transfer, layer_name)
                for j, staged in by_layer.items():
                    transfer.gather(j, part.pieces, staged)
                transfer.synchronize()
                stored = False
                put = store.put_many(list(zip(part.keys, outs, strict=True)))  # copies/writes before returning
                stored = True
                for k, r in zip(rest, put, strict=True):
                    done[k] = r
            ok += [bool(d) for d in done]
    finally:
        _give_back(staging, buf if stored else [], transfer, [])
    return ok


def _within(members: list[int], sizes: list[int], limit: int | None) -> list[list[int]]:
    """``members`` (task indices) in consecutive runs of at most ``limit`` bytes (one run if ``None``), at least one
    task each."""
    if limit is None:
        return [members]
    runs: list[list[int]] = []
    total = 0
    for i in members:
        if not runs or total + sizes[i] > limit:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += sizes[i]
    return runs


def _save_reserved(reserve: Callable[..., Any], transfer: PagedTransfer, task: Task,
                   layer_name: Callable[[int], str]) -> list[bool | None]:
    """Gather ``task``'s chunks into pool memory the store reserves for them and commit them; per piece whether
    it is stored, ``None`` where nothing was reserved (put it the usual way)."""
    lo, hi = task.group
    shaped = {n: torch.empty(transfer.canonical_shape(n), dtype=transfer.dtype, device="meta")  # no memory
              for n in {p.stored for p in task.pieces}}
    likes = [{layer_name(j): shaped[p.stored] for j in range(lo, hi)} for p in task.pieces]
    with reserve(list(zip(task.keys, likes, strict=True))) as reservation:
        got = [k for k, t in enumerate(reservation.tensors) if t is not None]
        if not got:
            return [None] * len(task.pieces)
        pieces = [task.pieces[k] for k in got]
        for j in range(lo, hi):
            transfer.gather(j, pieces, [reservation.tensors[k][layer_name(j)] for k in got])
        transfer.synchronize()  # the bytes are in the pool before the chunks are published
        committed = reservation.commit()
    return [committed[k] if t is not None else None for k, t in enumerate(reservation.tensors)]


def _give_back(staging: Staging, bufs: list[torch.Tensor], transfer: PagedTransfer,
               reads: list[Future[list[Any]]], loans: Sequence[Any] = ()) -> None:
    """Return a transfer's ``bufs`` to the shared ``staging`` only once nothing can write into or copy out
    of them any more: every read submitted into them has finished (waited for here, result or error
    ignored) and the transfer's CUDA copies are done. Otherwise another transfer could acquire a buffer
    a read of this one still fills and scatter this request's KV into its own blocks. Buffers a failed
    read or synchronize leaves in doubt are dropped, not reused (a batch that raised may leave per-key
    work running in a tier's pool)."""
    wait(reads)
    try:
        transfer.synchronize()
    except Exception:
        return  # the error that matters is the one propagating, if any (lent memory stays lent: in doubt)
    for loan in loans:
        loan.close()  # a second close does nothing
    if all(f.cancelled() or f.exception() is None for f in reads):
        for b in bufs:
            staging.release(b)
