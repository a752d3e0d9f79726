"""The rows of one paged KV transfer: where each layer's tokens live in an engine's cache, and the copies in
and out of them.

A :class:`PagedTransfer` checks the block table once and computes, on the host, the rows of every window of
chunks (:class:`Piece`) in the cache's flat row view, grouped a block at a time where the layout allows, moved
to the cache's device once and reused by every layer. A window whose chunks are adjacent in memory (staging)
moves with one ``index_copy_`` / ``index_select`` per layer; chunks elsewhere (the host pool's memory, lent or
reserved) with one per chunk and layer, from the same index cut per piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError, InvalidTypeError
from ..tensors import wait_for_copies
from .paged import _HOST, PagedLayout, _layout, _on, _Plan, block_table


@dataclass(frozen=True)
class Piece:
    """Chunk ``index`` (stored tokens ``[first, first + stored)``) moves tokens ``[a, b)``."""

    index: int
    first: int
    stored: int
    a: int
    b: int

    @property
    def whole(self) -> bool:
        return self.a == self.first and self.b == self.first + self.stored


class PagedTransfer:
    """The caches, layout and block table of one transfer, and the rows of any token range in them."""

    def __init__(self, caches: Sequence[torch.Tensor] | torch.Tensor, layout: str | PagedLayout,
                 block_ids: Sequence[int] | torch.Tensor, block_size: int | None, dtype: torch.dtype, is_mla: bool):
        self.layout = _layout(layout)
        if self.layout.is_mla != is_mla:
            raise InvalidInputError(f"layout {self.layout.value!r} does not match the namespace "
                                    f"({'MLA' if is_mla else 'MHA'})")
        self.pool: torch.Tensor | None = None
        self.caches: list[torch.Tensor] = []  # per-layer layouts; a pool layout has ``pool`` instead
        if self.layout.multi_layer:
            if not isinstance(caches, torch.Tensor):
                raise InvalidTypeError(f"{self.layout.value} takes the one pool tensor holding every layer")
            self.pool = caches
            probe = _Plan(caches, self.layout, block_ids, 0, 0, block_size, 0)
            self.num_layers = probe.num_layers
        else:
            if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or not caches:
                raise InvalidTypeError(f"{self.layout.value} takes a non-empty list with one cache tensor per layer")
            self.caches = list(caches)
            probe = _Plan(self.caches[0], self.layout, block_ids, 0, 0, block_size, None)
            for c in self.caches[1:]:
                probe.rebind(c)  # same shape, strides, dtype and device, or InvalidInputError
            self.num_layers = len(self.caches)
        first = self.pool if self.pool is not None else self.caches[0]
        if first.dtype != dtype:
            raise InvalidInputError(f"the KV cache is {first.dtype}, the namespace says {dtype}")
        self.block_ids, self.block_size = block_table(block_ids, _HOST), probe.block_size  # once, on the host
        self.device = first.device
        self.dtype = dtype
        self.token_dim = 0 if is_mla else 1
        self._canon = list(probe.result_shape())
        self._bases: dict[tuple[int, int], _Plan] = {}
        self._bases_at: dict[int, int] = {}  # id of a base plan -> its first token
        self._flats: dict[int, torch.Tensor | None] = {}
        #: per-layer caches: the rows of a window of pieces (run, index on the device, entries per piece)
        self._indexes: dict[tuple[tuple[int, int], ...], tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def canonical_shape(self, n_tokens: int) -> tuple[int, ...]:
        shape = list(self._canon)
        shape[self.token_dim] = n_tokens
        return tuple(shape)

    def plan(self, layer: int, a: int, b: int) -> _Plan:
        """Rows of tokens ``[a, b)`` of ``layer`` (validates the block table on first use)."""
        if self.pool is not None:
            return _Plan(self.pool, self.layout, self.block_ids, a, b, self.block_size, layer)
        base = self._bases.get((a, b))
        if base is None:
            base = self._bases[(a, b)] = _Plan(self.caches[0], self.layout, self.block_ids, a, b,
                                               self.block_size, None)
            self._bases_at[id(base)] = a
        return base if layer == 0 else base.rebind(self.caches[layer])

    def _cover(self, a: int, b: int) -> _Plan | None:
        """A plan of the first layer made before whose tokens include ``[a, b)`` (the whole transfer's, made when
        its block table was checked): windows cut their rows out of it instead of planning again."""
        for (lo, hi), base in self._bases.items():
            if lo <= a and b <= hi:
                return base
        return None

    def _flat(self, layer: int) -> torch.Tensor | None:
        """The flat row view of a per-layer cache (``None`` if its strides allow none), made once per layer."""
        if layer not in self._flats:
            base = next(iter(self._bases.values()))
            self._flats[layer] = (base if layer == 0 else base.rebind(self.caches[layer])).flat
        return self._flats[layer]

    def _window(self, layer: int, pieces: list[Piece]
                ) -> tuple[torch.Tensor | None, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The flat row view of ``layer``'s cache (``None`` if its strides allow none), the rows of every piece's
        tokens in piece order, grouped a block at a time where they allow, and that index cut per piece (to copy
        a piece on its own). Computed on the host for the first layer of a window and moved
        to the cache's device once; per-layer caches reuse it."""
        span = tuple((p.a, p.b) for p in pieces)
        got = self._indexes.get(span) if self.pool is None else None
        whole = self._cover(pieces[0].a, pieces[-1].b) if self.pool is None else None
        if whole is None:
            whole = self.plan(layer, pieces[0].a, pieces[-1].b)
        if got is None:
            # one plan covering every piece, cut per piece (each piece's rows stay together, in canonical order)
            a = self._bases_at.get(id(whole), pieces[0].a)
            grid = whole.host_index.view(whole.order)
            parts = [grid.narrow(self.token_dim, p.a - a, p.b - p.a).reshape(-1) for p in pieces]
            index = torch.cat(parts) if len(parts) > 1 else parts[0]
            lengths = [t.numel() for t in parts]
            run = 1
            if all(n % self.block_size == 0 for n in lengths):  # each piece whole groups of ``run`` rows
                run, index = _coarsen(whole.flat, index, self.block_size)
            index = _on(index, self.device)
            got = (run, index, index.split([n // run for n in lengths]))
            if self.pool is None:
                self._indexes[span] = got
        run, index, per_piece = got
        flat = self._flat(layer) if self.pool is None else whole.flat
        if flat is not None and run > 1:
            flat = flat.view(flat.shape[0] // run, run, *flat.shape[1:])
        return flat, index, per_piece

    def scatter(self, layer: int, pieces: list[Piece], staged: list[torch.Tensor]) -> None:
        """Write each piece's tokens from its canonical chunk tensor (staging, or a chunk the store lends) into
        the cache's blocks: adjacent whole chunks with one ``index_copy_``, others one ``index_copy_`` each."""
        flat, index, per_piece = self._window(layer, pieces)
        if flat is None:  # no flat view (interleaved strides): advanced indexing, piece by piece
            for p, t in zip(pieces, staged, strict=True):
                self.plan(layer, p.a, p.b).scatter(_to(self._part(p, t), self.device))
            return
        if all(p.whole for p in pieces) and _adjacent(staged):
            _copy_rows_in(flat, index, _span(staged))
            return
        words = _words(flat)
        for p, t, idx in zip(pieces, staged, per_piece, strict=True):
            _copy_rows_in(flat, idx, self._part(p, t), words)

    def _part(self, p: Piece, t: torch.Tensor) -> torch.Tensor:
        """The tokens piece ``p`` moves, out of its whole chunk ``t``."""
        return t if p.whole else t.narrow(self.token_dim, p.a - p.first, p.b - p.a)

    def gather(self, layer: int, pieces: list[Piece], staged: list[torch.Tensor]) -> None:
        """Copy each piece's tokens (whole chunks) out of the cache into its canonical tensor (staging, or
        pool memory reserved for the chunk): adjacent tensors with one ``index_select``, others one each."""
        flat, index, per_piece = self._window(layer, pieces)
        if flat is None:
            for p, t in zip(pieces, staged, strict=True):
                t.copy_(self.plan(layer, p.a, p.b).gather(None), non_blocking=True)
            return
        if _adjacent(staged):
            _copy_rows_out(flat, index, _span(staged))
            return
        words = _words(flat)  # once per layer, not per piece: a save into the pool is one call per chunk
        for t, idx in zip(staged, per_piece, strict=True):
            _copy_rows_out(flat, idx, t, words)

    def synchronize(self) -> None:
        first = self.pool if self.pool is not None else self.caches[0]
        wait_for_copies(first)


def _coarsen(flat: torch.Tensor | None, index: torch.Tensor, run: int) -> tuple[int, torch.Tensor]:
    """Copy whole blocks instead of single rows where possible: when ``index`` is made of aligned runs of
    ``run`` consecutive rows (block-aligned tokens of the layouts whose block rows are adjacent), return
    ``run`` and the index of the groups of ``run`` rows, else ``1`` and ``index`` (``index_copy_`` /
    ``index_select`` cost is per row)."""
    if flat is None or run <= 1 or index.numel() % run or flat.shape[0] % run:
        return 1, index
    runs = index.view(-1, run)
    first = runs[:, 0]
    if bool((first % run).any()) or not bool((runs == first[:, None] + torch.arange(run, device=index.device)).all()):
        return 1, index
    try:
        flat.view(flat.shape[0] // run, run, *flat.shape[1:])
    except RuntimeError:
        return 1, index
    return run, first // run


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: asynchronously onto a GPU (ordered before the kernels that read it on the stream);
    onto the host synchronously (the CPU op that follows would not wait for an asynchronous copy)."""
    return t.to(device, non_blocking=device.type == "cuda")


def _copy_rows_in(flat: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                  flat_words: torch.Tensor | None = None) -> None:
    """``flat[index] = src`` (``src``: the rows in index order, anywhere; one DMA first when on another device).
    ``flat_words``: ``_words(flat)`` when the caller has it."""
    rows = _to(src.reshape(index.numel(), *flat.shape[1:]), flat.device)
    flat_words, row_words = _words(flat) if flat_words is None else flat_words, _words(rows)
    if flat_words is not None and row_words is not None:  # 8-byte elements: ~1.7x the bf16 copy rate
        flat_words.index_copy_(0, index, row_words)
    else:
        flat.index_copy_(0, index, rows)


def _copy_rows_out(flat: torch.Tensor, index: torch.Tensor, dst: torch.Tensor,
                   flat_words: torch.Tensor | None = None) -> None:
    """``dst = flat[index]`` for a contiguous ``dst`` (on another device: gathered there, then one DMA).
    ``flat_words``: ``_words(flat)`` when the caller has it."""
    rows = dst.view(index.numel(), *flat.shape[1:])
    if rows.device != flat.device:
        rows.copy_(flat.index_select(0, index), non_blocking=True)
        return
    flat_words, row_words = _words(flat) if flat_words is None else flat_words, _words(rows)
    if flat_words is not None and row_words is not None:
        torch.index_select(flat_words, 0, index, out=row_words)
    else:
        torch.index_select(flat, 0, index, out=rows)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s rows as 8-byte words (``index_copy_`` runs per element), or ``None`` where no such view exists."""
    try:
        return t.view(t.shape[0], -1).view(torch.int64)
    except RuntimeError:
        return None


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """Whether contiguous ``tensors`` follow each other in one storage, so their span is one view."""
    for t, nxt in zip(tensors, tensors[1:], strict=False):
        if t.data_ptr() + t.numel() * t.element_size() != nxt.data_ptr():
            return False
    return all(t.is_contiguous() for t in tensors)


def _span(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The flat elements of adjacent ``tensors`` as one view."""
    first = tensors[0]
    n = sum(t.numel() for t in tensors)
    return first.as_strided((n,), (1,))
