"""One SGLang host-pool page as the tensors of one stored chunk.

SGLang's host KV pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) hand out a page with
``get_data_page(index, flat=False)``: a strided view of the pool's ``kv_buffer`` whose shape depends on
the layout (MHA ``layer_first``: ``(2, layers, page, heads, dim)``; ``page_first``: ``(2, page, layers,
heads, dim)``; MLA ``layer_first``: ``(layers, page, 1, dim)`` ...). A :class:`PageGeometry` splits that
view along its leading dimensions into the fewest pieces that are each contiguous (one per K/V and layer
for ``layer_first``, one per K/V for ``page_first``), so the store reads a chunk straight into the pool
and writes it straight out of it: no staging copy. The flat page of SGLang's legacy path
(``get_data_page(index)``, ``get_dummy_flat_data_page()``) has the same bytes in the same order, so it
splits into the same pieces and both paths store the same chunk.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.errors import ConfigError, InvalidInputError, InvalidTypeError
from tierstore.tensors import DTYPE_NAMES

#: host-pool layouts whose ``get_data_page(index, flat=False)`` is a view of the pool (zero-copy)
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PageGeometry:
    """How one page of a host pool is stored: the page view's shape and its contiguous pieces.

    Attributes
    ----------
    layout, page_size, dtype:
        The pool's ``layout``, tokens per page and KV dtype.
    page_shape:
        Shape of ``pool.get_data_page(index, flat=False)``.
    split_dims:
        How many leading dimensions of the page are split into pieces (each piece is contiguous).
    names:
        The stored tensor names, one per piece in row-major order (``"0.3"`` = index 0, 3 of the
        split dimensions).
    pool_tokens:
        Token slots in the pool (``pool.size``); a page must start inside it.
    """

    layout: str
    page_size: int
    dtype: torch.dtype
    page_shape: tuple[int, ...]
    split_dims: int
    names: tuple[str, ...]
    pool_tokens: int

    @classmethod
    def of_pool(cls, pool: Any, *, is_mla: bool) -> PageGeometry:
        """Measure ``pool`` (a registered SGLang host pool). Raises :class:`~tierstore.ConfigError` for a
        layout this backend cannot read in place, :class:`~tierstore.InvalidTypeError` for an object that
        is not a host KV pool."""
        if pool is None:
            raise InvalidTypeError("no host KV pool: SGLang registers one with register_mem_pool_host(pool)")
        missing = [a for a in ("layout", "page_size", "dtype", "size", "kv_buffer", "get_data_page")
                   if not hasattr(pool, a)]
        if missing:
            raise InvalidTypeError(f"{type(pool).__name__} is not an SGLang host KV pool (lacks {missing})")
        supported = MLA_LAYOUTS if is_mla else MHA_LAYOUTS
        if pool.layout not in supported:
            raise ConfigError(f"host pool layout {pool.layout!r} is not supported by TierstoreHiCacheStorage "
                              f"for {'MLA' if is_mla else 'MHA'} pools; use --hicache-mem-layout "
                              f"{' or '.join(supported)}")
        page_size = int(pool.page_size)
        if page_size < 1 or int(pool.size) < page_size:
            raise InvalidInputError(f"host pool page_size={page_size} does not fit its size={pool.size}")
        if pool.dtype not in DTYPE_NAMES:
            raise ConfigError(f"host pool dtype {pool.dtype} cannot be stored")
        page = pool.get_data_page(0, flat=False)
        buffer = pool.kv_buffer
        if (not isinstance(page, torch.Tensor) or not isinstance(buffer, torch.Tensor)
                or page.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()):
            raise ConfigError(f"host pool layout {pool.layout!r}: get_data_page does not return a view of "
                              "kv_buffer, so pages cannot be read in place")
        split = next(k for k in range(page.dim() + 1) if page[(0,) * k].is_contiguous())
        names = tuple(".".join(map(str, idx)) or "page" for idx in itertools.product(*map(range, page.shape[:split])))
        return cls(layout=str(pool.layout), page_size=page_size, dtype=pool.dtype, page_shape=tuple(page.shape),
                   split_dims=split, names=names, pool_tokens=int(pool.size))

    @property
    def numel(self) -> int:
        """Elements of one page (the length of SGLang's flat data page)."""
        return math.prod(self.page_shape)

    def split(self, page: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pieces of ``page`` (shaped :attr:`page_shape`) as views, keyed by :attr:`names`."""
        index = itertools.product(*map(range, self.page_shape[:self.split_dims]))
        return {name: page[idx] for name, idx in zip(self.names, index, strict=True)}

    def pool_page(self, pool: Any, start: int) -> dict[str, torch.Tensor]:
        """The pieces of the pool page starting at token slot ``start``: views into the pool."""
        return self.split(pool.get_data_page(start, flat=False))

    def flat_page(self, flat: object, what: str) -> dict[str, torch.Tensor]:
        """The pieces of SGLang's flat data page ``flat`` (views when it is contiguous).

        Raises :class:`~tierstore.InvalidTypeError` / :class:`~tierstore.InvalidInputError` when ``flat`` is
        not a tensor of this pool's dtype and page size.
        """
        if not isinstance(flat, torch.Tensor):
            raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(flat).__name__}")
        if flat.dtype != self.dtype or flat.numel() != self.numel:
            raise InvalidInputError(f"{what} is {flat.numel()} x {flat.dtype}; a page of this pool is "
                                    f"{self.numel} x {self.dtype}")
        return self.split(flat.reshape(self.page_shape))

    def page_starts(self, n_keys: int, host_indices: object) -> list[int]:
        """The first token slot of each of ``n_keys`` pages in ``host_indices`` (SGLang's token slots,
        ``page_size`` per key, each page a contiguous page-aligned run inside the pool).

        Raises :class:`~tierstore.InvalidInputError` for anything else, before any I/O.
        """
        if not isinstance(host_indices, torch.Tensor) or host_indices.dtype.is_floating_point:
            raise InvalidTypeError("host_indices must be an integer torch.Tensor of host-pool token slots")
        p = self.page_size
        if host_indices.dim() != 1 or host_indices.numel() != n_keys * p:
            raise InvalidInputError(f"host_indices has shape {tuple(host_indices.shape)}; {n_keys} keys of "
                                    f"page_size {p} need {n_keys * p} token slots")
        pages = host_indices.detach().to("cpu", torch.int64).view(n_keys, p)
        starts = pages[:, 0]
        if n_keys and (bool((starts % p != 0).any()) or bool((starts < 0).any())
                       or bool((starts + p > self.pool_tokens).any())
                       or not torch.equal(pages - starts[:, None], torch.arange(p).expand(n_keys, p))):
            raise InvalidInputError(f"host_indices must be whole pages: runs of {p} consecutive slots starting "
                                    f"at a multiple of {p} inside the pool's {self.pool_tokens} slots")
        return [int(s) for s in starts.tolist()]
