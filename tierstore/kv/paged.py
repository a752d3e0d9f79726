"""Gather/scatter between paged engine KV caches and the canonical per-layer form.

Engines keep KV in fixed-size blocks (vLLM) or pages (SGLang) and give each request a block table:
``block_ids[i]`` holds the request's tokens ``[i * block_size, (i + 1) * block_size)``. These helpers copy
the KV of a token range ``[start, end)`` out of such a cache into the canonical form tierstore stores —
``(2, n_tokens, kv_heads, head_dim)`` per layer (K at 0, V at 1), or ``(n_tokens, latent_dim)`` for MLA —
and back into (newly allocated) blocks. The token range need not align with blocks, so chunk size and
block size are independent.

Supported layouts (:class:`PagedLayout`):

===========================  =============================================  ==========
layout                        cache shape                                    per call
===========================  =============================================  ==========
``vllm`` (FlashAttention)     ``(2, num_blocks, block_size, heads, dim)``    one layer
``flashinfer``                ``(num_blocks, 2, block_size, heads, dim)``    one layer
``vllm_cpu``                  ``(num_blocks, heads, block_size, 2 * dim)``   one layer
``mla``                       ``(num_blocks, block_size, latent_dim)``       one layer
``sglang_page_first``         ``(2, slots, layers, heads, dim)``             all layers
``sglang_page_first_direct``  ``(2, pages, layers, page_size, heads, dim)``  all layers
``sglang_mla_page_first``     ``(slots, layers, 1, latent_dim)``             all layers
===========================  =============================================  ==========

vLLM's CPU backend stores, per block and head, K of all ``block_size`` tokens followed by their V (it
views the cache as ``(num_blocks, heads, 2, block_size, dim)``); ``vllm_cpu`` reads it that way.

SGLang's page-first host pools index token *slots*; page ``p`` is slots ``[p * page_size, (p+1) *
page_size)``, so those layouts take page ids and ``block_size=page_size``.

Only torch ops are used (``index_select`` / ``index_copy_`` on a flat view of the cache, or advanced
indexing / ``index_put_`` when the cache's strides do not allow a flat view, e.g. vLLM's HND order), so
the same code runs on CPU and CUDA. A gather is one copy into the result (or into ``out``); a scatter
writes straight into the cache's blocks.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidInputError, InvalidTypeError


class PagedLayout(str, enum.Enum):
    VLLM = "vllm"
    FLASHINFER = "flashinfer"
    VLLM_CPU = "vllm_cpu"
    MLA = "mla"
    SGLANG_PAGE_FIRST = "sglang_page_first"
    SGLANG_PAGE_FIRST_DIRECT = "sglang_page_first_direct"
    SGLANG_MLA_PAGE_FIRST = "sglang_mla_page_first"

    @property
    def multi_layer(self) -> bool:
        """True when one cache tensor holds every layer (SGLang host pools)."""
        return self.value.startswith("sglang")

    @property
    def is_mla(self) -> bool:
        return self in (PagedLayout.MLA, PagedLayout.SGLANG_MLA_PAGE_FIRST)


#: a request's block table, and one cache per layer or one multi-layer pool
BlockIds = Sequence[int] | torch.Tensor
Caches = torch.Tensor | Sequence[torch.Tensor]

_INT64_MAX = (1 << 63) - 1

# rank of the cache tensor and how many leading dims are indexed (the rest is one row: heads×dim or latent)
_RANKS = {PagedLayout.VLLM: (5, 3), PagedLayout.FLASHINFER: (5, 3), PagedLayout.MLA: (3, 2),
          PagedLayout.VLLM_CPU: (4, 4),  # indexed on its (blocks, heads, 2, block_size, dim) view
          PagedLayout.SGLANG_PAGE_FIRST: (5, 3), PagedLayout.SGLANG_PAGE_FIRST_DIRECT: (6, 4),
          PagedLayout.SGLANG_MLA_PAGE_FIRST: (4, 3)}


def _layout(layout: PagedLayout | str) -> PagedLayout:
    try:
        return PagedLayout(layout)
    except ValueError:
        raise InvalidInputError(f"unknown paged layout {layout!r}; one of "
                                f"{[m.value for m in PagedLayout]}") from None


def _check_cache(cache: object, layout: PagedLayout) -> torch.Tensor:
    """``cache`` if it is a tensor of ``layout``'s rank and fixed dims, else raise."""
    if not isinstance(cache, torch.Tensor):
        raise InvalidTypeError(f"a {layout.value} KV cache must be a torch.Tensor, got {type(cache).__name__}")
    rank, _ = _RANKS[layout]
    if cache.dim() != rank:
        raise InvalidInputError(f"a {layout.value} KV cache has {rank} dims, got shape {tuple(cache.shape)}")
    if layout is PagedLayout.VLLM and cache.shape[0] != 2:
        raise InvalidInputError(f"vllm KV cache must be (2, blocks, block_size, heads, dim), got {tuple(cache.shape)}")
    if layout is PagedLayout.FLASHINFER and cache.shape[1] != 2:
        raise InvalidInputError(f"flashinfer KV cache must be (blocks, 2, block_size, heads, dim), "
                                f"got {tuple(cache.shape)}")
    if layout in (PagedLayout.SGLANG_PAGE_FIRST, PagedLayout.SGLANG_PAGE_FIRST_DIRECT) and cache.shape[0] != 2:
        raise InvalidInputError(f"{layout.value} host pool must start with a K/V dim of 2, got {tuple(cache.shape)}")
    if layout is PagedLayout.VLLM_CPU and cache.shape[3] % 2:
        raise InvalidInputError(f"vllm_cpu KV cache must be (blocks, heads, block_size, 2 * dim), "
                                f"got {tuple(cache.shape)}")
    if layout is PagedLayout.SGLANG_MLA_PAGE_FIRST and cache.shape[2] != 1:
        raise InvalidInputError(f"sglang MLA host pool must be (slots, layers, 1, latent), got {tuple(cache.shape)}")
    return cache


def _geometry(cache: torch.Tensor, layout: PagedLayout, block_size: int | None) -> tuple[int, int, int]:
    """``(block_size, num_blocks, num_layers)`` of ``cache``."""
    s = cache.shape
    dim = {PagedLayout.VLLM: 2, PagedLayout.FLASHINFER: 2, PagedLayout.MLA: 1, PagedLayout.VLLM_CPU: 2,
           PagedLayout.SGLANG_PAGE_FIRST_DIRECT: 3}.get(layout)
    inherent = None if dim is None else s[dim]
    if inherent is not None:
        if block_size is not None and block_size != inherent:
            raise InvalidInputError(f"block_size={block_size} disagrees with the cache's block size {inherent}")
        block_size = inherent
    elif block_size is None:
        raise InvalidInputError(f"{layout.value} needs block_size= (the page size)")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidInputError(f"block_size must be a positive int, got {block_size!r}")
    if layout is PagedLayout.VLLM:
        return block_size, s[1], 1
    if layout in (PagedLayout.FLASHINFER, PagedLayout.MLA, PagedLayout.VLLM_CPU):
        return block_size, s[0], 1
    if layout is PagedLayout.SGLANG_PAGE_FIRST_DIRECT:
        return block_size, s[1], s[2]
    slots = s[1] if layout is PagedLayout.SGLANG_PAGE_FIRST else s[0]
    layers = s[2] if layout is PagedLayout.SGLANG_PAGE_FIRST else s[1]
    if slots % block_size:
        raise InvalidInputError(f"{slots} slots are not a whole number of {block_size}-token pages")
    return block_size, slots // block_size, layers


def block_table(block_ids: BlockIds, device: torch.device) -> torch.Tensor:
    """``block_ids`` as a 1-D long tensor on ``device``.

    Takes a list/tuple of ints (Python or numpy integers) or a 1-D integer ``torch.Tensor`` / numpy array.
    Raises :class:`InvalidTypeError` for non-integer ids and :class:`InvalidInputError` for another shape
    or an id outside int64 (whether the ids name blocks of the cache is checked where they are used).
    """
    if isinstance(block_ids, torch.Tensor):
        t = block_ids
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() != 1:
            raise InvalidInputError(f"block_ids must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
        if t.dtype == torch.uint64 and bool((t.view(torch.int64) < 0).any()):  # >= 2**63 would wrap negative
            raise InvalidInputError("block_ids holds an id >= 2**63")
        return t.to(device=device, dtype=torch.long)
    if type(block_ids).__module__ == "numpy" and hasattr(block_ids, "dtype"):
        arr: Any = block_ids  # a numpy array, recognised without importing numpy
        if arr.dtype.kind not in "iu":
            raise InvalidTypeError(f"block_ids must have an integer dtype, got numpy {arr.dtype}")
        if arr.ndim != 1:
            raise InvalidInputError(f"block_ids must be 1-D, got shape {tuple(arr.shape)}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
            raise InvalidInputError(f"block_ids holds an id >= 2**63: {int(arr.max())}")
        return torch.from_numpy(arr.astype("int64")).to(device)  # a copy: also for read-only arrays
    if isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
        if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in block_ids):
            raise InvalidTypeError("block_ids must be ints")
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not -_INT64_MAX - 1 <= b <= _INT64_MAX]
        if bad:
            raise InvalidInputError(f"block id {bad[0]} is out of range")
        return torch.tensor(ids, dtype=torch.long, device=device)
    raise InvalidTypeError(f"block_ids must be a sequence of ints or a tensor, got {type(block_ids).__name__}")


_HOST = torch.device("cpu")


def _positions(block_ids: BlockIds, start: int, end: int, block_size: int, num_blocks: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block id and in-block offset of every token in ``[start, end)``, on the host: the block table is checked
    there (a table on a GPU is copied once), so no check waits on a device stream."""
    for name, v in (("start", start), ("end", end)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidTypeError(f"{name} must be an int, got {type(v).__name__}")
    if not 0 <= start <= end:
        raise InvalidInputError(f"need 0 <= start <= end, got start={start}, end={end}")
    ids = block_table(block_ids, _HOST)
    needed = math.ceil(end / block_size)
    if ids.numel() < needed:
        raise InvalidInputError(f"tokens up to {end} need {needed} blocks of {block_size}, "
                                f"the block table has {ids.numel()}")
    used = ids[start // block_size:needed]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise InvalidInputError(f"block ids must lie in [0, {num_blocks}), got "
                                f"[{int(used.min())}, {int(used.max())}]")
    if used.unique().numel() != used.numel():
        raise InvalidInputError("a request's block table lists the same block twice")
    pos = torch.arange(start, end)
    return ids[pos // block_size], pos % block_size


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index ``t`` on ``device``: for a GPU one asynchronous copy from pinned memory (nothing waits for
    the stream; the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type == "cpu":
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def _index(layout: PagedLayout, blk: torch.Tensor, off: torch.Tensor, block_size: int, layers: int,
           layer: int | None, heads: int = 0) -> tuple[torch.Tensor, ...]:
    """Multi-index into the cache's leading dims, broadcast to the result order.

    Result order is ``(2, n)`` for one MHA layer (``(2, n, heads)`` for ``vllm_cpu``), ``(n,)`` for one
    MLA layer, and ``(layers, 2, n)`` / ``(layers, n)`` for all layers of a multi-layer pool.
    """
    n = blk.shape[0]
    kv = torch.arange(2, device=blk.device).view(2, 1)
    if layout is PagedLayout.VLLM_CPU:
        head = torch.arange(heads, device=blk.device).view(1, 1, heads)
        return blk.view(1, n, 1), head, kv.view(2, 1, 1), off.view(1, n, 1)
    if layout is PagedLayout.VLLM:
        return kv, blk.view(1, n), off.view(1, n)
    if layout is PagedLayout.FLASHINFER:
        return blk.view(1, n), kv, off.view(1, n)
    if layout is PagedLayout.MLA:
        return blk, off
    lyr = (torch.arange(layers, device=blk.device) if layer is None
           else torch.tensor([layer], device=blk.device))
    if layout is PagedLayout.SGLANG_MLA_PAGE_FIRST:
        slot = (blk * block_size + off).view(1, n)
        return slot, lyr.view(-1, 1), torch.zeros(1, 1, dtype=torch.long, device=blk.device)
    kv, lyr = kv.view(1, 2, 1), lyr.view(-1, 1, 1)
    if layout is PagedLayout.SGLANG_PAGE_FIRST:
        return kv, (blk * block_size + off).view(1, 1, n), lyr
    return kv, blk.view(1, 1, n), lyr, off.view(1, 1, n)  # page_first_direct


class _Plan:
    """Where the rows of one gather/scatter live in ``cache``; the shape of the canonical result."""

    def __init__(self, cache: Caches, layout: PagedLayout | str, block_ids: BlockIds, start: int, end: int,
                 block_size: int | None, layer: int | None) -> None:
        layout = _layout(layout)
        cache = _check_cache(cache, layout)
        self._source = cache
        bs, nblocks, layers = _geometry(cache, layout, block_size)
        self.layout, self.block_size = layout, bs
        self._bind(cache)
        cache = self.cache
        if layer is not None and not layout.multi_layer:
            raise InvalidInputError(f"{layout.value} caches hold one layer; pass that layer's tensor, not layer=")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < layers):
            raise InvalidInputError(f"layer must be an int in [0, {layers}), got {layer!r}")
        self.num_layers = layers
        blk, off = _positions(block_ids, start, end, bs, nblocks)
        self.n = end - start
        _, lead = _RANKS[layout]
        self.tail = tuple(cache.shape[lead:])
        idx = torch.broadcast_tensors(*_index(layout, blk, off, bs, layers, layer, heads=cache.shape[1]))
        self.order = tuple(idx[0].shape)  # result dims before the row shape
        if layer is not None:
            self.order = self.order[1:]  # one layer of a pool: drop the layer dim
        self._host_parts = tuple(i.reshape(-1) for i in idx)
        lead_shape = cache.shape[:lead]
        flat = torch.zeros_like(self._host_parts[0])
        for part, size in zip(self._host_parts, lead_shape, strict=True):
            flat = flat * size + part
        #: the rows of the flat view, computed on the host (``flat_index`` is the same on the cache's device)
        self.host_index = flat
        self.flat_index = _on(flat, cache.device)

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The multi-index into the cache's leading dims, on its device (the path without a flat view)."""
        return tuple(_on(p, self.cache.device) for p in self._host_parts)

    def _bind(self, cache: torch.Tensor) -> None:
        """Index ``cache`` (its ``vllm_cpu`` 5-D view) and, where the strides allow, its flat row view."""
        if self.layout is PagedLayout.VLLM_CPU:
            b, h, _, two_d = cache.shape
            try:
                cache = cache.view(b, h, 2, self.block_size, two_d // 2)
            except RuntimeError:
                raise InvalidInputError("a vllm_cpu KV cache must be contiguous in its last two dims") from None
        self.cache = cache
        lead = _RANKS[self.layout][1]
        try:  # a flat (rows, *row_shape) view exists unless the strides interleave (e.g. vLLM HND)
            self.flat: torch.Tensor | None = cache.view(-1, *cache.shape[lead:])
        except RuntimeError:
            self.flat = None

    def rebind(self, cache: torch.Tensor) -> _Plan:
        """The same token rows in another cache of identical shape, strides, dtype and device (the next
        layer of a per-layer layout): no new index computation."""
        ref = self._source
        if (cache.shape != ref.shape or cache.stride() != ref.stride() or cache.dtype != ref.dtype
                or cache.device != ref.device):
            raise InvalidInputError(f"every layer's cache must match the first: {tuple(cache.shape)} {cache.dtype} "
                                    f"on {cache.device} vs {tuple(ref.shape)} {ref.dtype} on {ref.device}")
        other = copy.copy(self)
        other._source = cache
        other._bind(cache)
        return other

    def result_shape(self) -> tuple[int, ...]:
        return self.order + self.tail

    def gather(self, out: torch.Tensor | None) -> torch.Tensor:
        shape = self.result_shape()
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise InvalidTypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if tuple(out.shape) != shape or out.dtype != self.cache.dtype or out.device != self.cache.device:
                raise InvalidInputError(f"out must be {shape} {self.cache.dtype} on {self.cache.device}, "
                                        f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        if self.flat is not None and (out is None or out.is_contiguous()):
            rows = self.flat.index_select(0, self.flat_index) if out is None else torch.index_select(
                self.flat, 0, self.flat_index, out=out.view(-1, *self.flat.shape[1:]))
            return rows.view(shape)
        rows = self.cache[self.parts].view(shape)
        return rows if out is None else out.copy_(rows)

    def scatter(self, values: torch.Tensor) -> None:
        shape = self.result_shape()
        if not isinstance(values, torch.Tensor):
            raise InvalidTypeError(f"KV to scatter must be a torch.Tensor, got {type(values).__name__}")
        if tuple(values.shape) != shape:
            raise InvalidInputError(f"KV to scatter must have shape {shape}, got {tuple(values.shape)}")
        if values.dtype != self.cache.dtype:
            raise InvalidInputError(f"KV dtype {values.dtype} differs from the cache's {self.cache.dtype}")
        values = values.to(self.cache.device)
        if self.flat is not None:
            self.flat.index_copy_(0, self.flat_index, values.reshape(-1, *self.flat.shape[1:]))
        else:
            self.cache.index_put_(self.parts, values.reshape(-1, *self.tail))


def gather(cache: torch.Tensor, layout: PagedLayout | str, block_ids: BlockIds, start: int, end: int, *,
           block_size: int | None = None, layer: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy tokens ``[start, end)`` of one layer out of a paged ``cache`` in canonical form.

    Returns ``(2, end - start, heads, dim)`` (MLA: ``(end - start, latent_dim)``), on the cache's device;
    with ``out`` (that shape, contiguous) the rows are written there. ``block_ids`` is the request's block
    table (ints: a list/tuple, tensor or numpy array). Multi-layer SGLang pools need ``layer=``; their page
    size is ``block_size=``. Raises :class:`~tierstore.InvalidInputError` on shape, range or table mismatches.
    """
    layout = _layout(layout)
    if layout.multi_layer and layer is None:
        raise InvalidInputError(f"{layout.value} pools hold every layer: pass layer= or use gather_layers()")
    return _Plan(cache, layout, block_ids, start, end, block_size, layer).gather(out)


def scatter(cache: torch.Tensor, layout: PagedLayout | str, block_ids: BlockIds, kv: torch.Tensor, start: int = 0, *,
            block_size: int | None = None, layer: int | None = None) -> None:
    """Write canonical ``kv`` (one layer) into the blocks of ``cache`` holding tokens ``[start, start+n)``.

    The inverse of :func:`gather`; ``kv`` must match the cache's dtype and head geometry.
    """
    layout = _layout(layout)
    if layout.multi_layer and layer is None:
        raise InvalidInputError(f"{layout.value} pools hold every layer: pass layer= or use scatter_layers()")
    if not isinstance(kv, torch.Tensor):
        raise InvalidTypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    n = kv.shape[0 if layout.is_mla else 1] if kv.dim() >= 2 else -1
    if n < 0:
        raise InvalidInputError(f"kv has too few dims: {tuple(kv.shape)}")
    plan = _Plan(cache, layout, block_ids, start, start + n, block_size, layer)
    plan.scatter(kv)


def gather_layers(caches: Caches, layout: PagedLayout | str, block_ids: BlockIds, start: int, end: int, *,
                  block_size: int | None = None) -> list[torch.Tensor]:
    """:func:`gather` for every layer: ``caches`` is the list of per-layer tensors (vLLM) or one pool
    tensor (SGLang). Returns one canonical tensor per layer; a pool is read with a single index op."""
    layout = _layout(layout)
    if layout.multi_layer:
        plan = _Plan(caches, layout, block_ids, start, end, block_size, None)
        return list(plan.gather(None).unbind(0))
    _check_layer_list(caches)
    return [gather(c, layout, block_ids, start, end, block_size=block_size) for c in caches]


def scatter_layers(caches: Caches, layout: PagedLayout | str, block_ids: BlockIds, layers: Sequence[torch.Tensor],
                   start: int = 0, *, block_size: int | None = None) -> None:
    """:func:`scatter` for every layer; ``layers`` holds one canonical tensor per layer."""
    layout = _layout(layout)
    if not isinstance(layers, Sequence) or not all(isinstance(t, torch.Tensor) for t in layers):
        raise InvalidTypeError("layers must be a sequence of torch.Tensor")
    if layout.multi_layer:
        if not layers:
            raise InvalidInputError("layers is empty")
        n = layers[0].shape[0 if layout.is_mla else 1]
        plan = _Plan(caches, layout, block_ids, start, start + n, block_size, None)
        if len(layers) != plan.num_layers:
            raise InvalidInputError(f"the pool has {plan.num_layers} layers, got {len(layers)} tensors")
        plan.scatter(torch.stack(list(layers)))
        return
    _check_layer_list(caches)
    if len(layers) != len(caches):
        raise InvalidInputError(f"{len(caches)} layer caches but {len(layers)} KV tensors")
    for c, kv in zip(caches, layers, strict=True):
        scatter(c, layout, block_ids, kv, start, block_size=block_size)


def _check_layer_list(caches: object) -> None:
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise InvalidTypeError("per-layer layouts take a sequence with one cache tensor per layer")
