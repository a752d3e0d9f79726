"""Synthetic checkpoints with realistic LLM tensor shapes, for tests, benchmarks and examples.

:func:`llm_shapes` lays out a Llama-style decoder (embedding, per-layer attention q/k/v/o with grouped
KV heads, gated MLP, RMSNorm weights, final norm, untied LM head) sized to roughly ``size`` bytes;
:func:`write_checkpoint` writes tensors as HF-style safetensors shards plus an index, producing one
tensor at a time (never the whole checkpoint in memory).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import InvalidInputError
from .header import build_header

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def llm_shapes(size: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a Llama-like model of about ``size`` bytes in bf16 (at least one layer).

    TinyLlama-1.1B dimensions (hidden 2048, MLP 5632, 4 KV heads of 64, vocab 32000) from 1 GiB up,
    narrower models below that.
    """
    hidden, inter, kv, vocab = 2048, 5632, 256, 32000
    if size < 1 << 30:
        hidden, inter, kv, vocab = 1024, 2816, 256, 32000
    if size < 128 << 20:
        hidden, inter, kv, vocab = 256, 704, 64, 4096
    layer = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
             ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
             ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
             ("post_attention_layernorm.weight", (hidden,))]
    per_layer = 2 * sum(math.prod(s) for _, s in layer)
    fixed = 2 * (2 * vocab * hidden + hidden)
    n = max(1, round((size - fixed) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(n):
        shapes += [(f"model.layers.{i}.{name}", shape) for name, shape in layer]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def random_tensor(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype``: weight-like for 16/32/64-bit floats, random bits otherwise."""
    shape = tuple(shape)
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize(dtype),), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def write_checkpoint(directory: str, specs: Sequence[Spec] | Mapping[str, torch.Tensor],
                     make: Callable[[int], torch.Tensor] | None = None, shard_size: int = 1 << 30,
                     prefix: str = "model") -> list[str]:
    """Write tensors as safetensors shards of at most ``shard_size`` bytes; return the shard paths.

    Args:
        specs: a mapping name → tensor, or ``(name, dtype, shape)`` specs with ``make(i)`` producing
            tensor ``i`` when it is written.
    One shard is named ``{prefix}.safetensors``; several ``{prefix}-0000k-of-0000n.safetensors`` plus a
    ``{prefix}.safetensors.index.json``.
    """
    if isinstance(specs, Mapping):
        values = list(specs.values())
        make = values.__getitem__
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in specs.items()]
    elif make is None:
        raise InvalidInputError("write_checkpoint: specs without tensors need make=")
    os.makedirs(directory, exist_ok=True)
    sizes = [math.prod(shape) * itemsize(dt) for _, dt, shape in specs]
    shards: list[list[int]] = []
    cur: list[int] = []
    cur_size = 0
    for i, n in enumerate(sizes):
        if cur and cur_size + n > shard_size:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(i)
        cur_size += n
    if cur or not shards:
        shards.append(cur)
    paths, weight_map = [], {}
    for k, idx in enumerate(shards):
        fname = (f"{prefix}.safetensors" if len(shards) == 1
                 else f"{prefix}-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        path = os.path.join(directory, fname)
        with open(path, "wb") as f:
            f.write(build_header([(*specs[i], sizes[i]) for i in idx], {"format": "pt"}))
            for i in idx:
                t = make(i).contiguous()
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                weight_map[specs[i][0]] = fname
        paths.append(path)
    if len(shards) > 1:
        with open(os.path.join(directory, f"{prefix}.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=1)
    return paths


def write_llm_checkpoint(directory: str, size: int, shard_size: int = 1 << 30, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """A synthetic Llama-like checkpoint of about ``size`` bytes in ``directory``."""
    g = torch.Generator().manual_seed(seed)
    specs = [(name, dtype, shape) for name, shape in llm_shapes(size)]
    return write_checkpoint(directory, specs, lambda i: random_tensor(specs[i][2], dtype, g), shard_size)
