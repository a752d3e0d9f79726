"""vLLM's per-layer paged KV tensors named as a :class:`tierstore.kv.PagedLayout` (as is, no copy)."""

from __future__ import annotations

import torch

from tierstore.errors import InvalidInputError
from tierstore.kv import PagedLayout


def paged_view(cache: torch.Tensor, block_size: int, num_kv_heads: int,
               head_size: int) -> tuple[torch.Tensor, PagedLayout]:
    """One layer's vLLM KV cache and the :mod:`tierstore.kv.paged` layout it has (every vLLM layout here
    has a core equivalent, so the tensor is returned as is).

    * FlashAttention and friends: ``(2, blocks, block_size, heads, dim)`` (any stride order), as is.
    * FlashInfer: ``(blocks, 2, block_size, heads, dim)``, as is.
    * vLLM's CPU backend ("LBHNC"): ``(blocks, heads, block_size, 2 * dim)``, which the backend reads as
      ``(blocks, heads, 2 * block_size, dim)``: per block and head, K of every token, then V — the core's
      ``vllm_cpu`` layout.

    Raises :class:`tierstore.InvalidInputError` for any other shape (MLA, quantized caches).
    """
    n, h, d = block_size, num_kv_heads, head_size
    s = tuple(cache.shape)
    if len(s) == 5 and s[0] == 2 and s[2:] == (n, h, d):
        return cache, PagedLayout.VLLM
    if len(s) == 5 and s[1] == 2 and s[2:] == (n, h, d):
        return cache, PagedLayout.FLASHINFER
    if len(s) == 4 and s[1:] == (h, n, 2 * d) and cache.is_contiguous():
        return cache, PagedLayout.VLLM_CPU
    raise InvalidInputError(f"unsupported vLLM KV cache shape {s} for block_size={n}, kv_heads={h}, "
                            f"head_size={d} (MLA and other layouts are not supported yet)")
