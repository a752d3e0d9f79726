"""A minimal inference engine: the tiny decoder with a :class:`~tierstore.KVCacheStore` in front.

What a vLLM/SGLang connector does, in a few lines: look the prompt up, load the cached prefix's KV,
prefill only the rest, then save the prompt's new full chunks. Used by ``tierstore demo`` and
``tierstore bench kv``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import MissingKeyError
from ..kv.namespace import token_tensor
from .tiny import TinyDecoder


@dataclass
class CachedPrefill:
    """One prefill through the engine.

    ``logits``: float32 logits of the computed tokens (last one only with ``last_only``); ``kv``: the
    prompt's full per-layer KV; ``tiers``: cached tokens per tier name they were served from; times in
    seconds (``ttft_s`` = lookup + load + compute).
    """

    logits: torch.Tensor
    kv: list[torch.Tensor]
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str | None, int] = field(default_factory=dict)
    lookup_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    save_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.lookup_s + self.load_s + self.compute_s


class TinyEngine:
    """Prefill prompts with ``model``, reusing and filling ``kv`` (a ``KVCacheStore``; ``None`` = no cache).

    At least the last prompt token is always computed (its logits start decoding), so a fully cached
    prompt loads ``len(prompt) - 1`` tokens — as vLLM does.
    """

    def __init__(self, model: TinyDecoder, kv=None, *, save: bool = True, last_only: bool = True):
        self.model, self.kv, self.save, self.last_only = model, kv, save, last_only

    def prefill(self, prompt) -> CachedPrefill:
        tokens = token_tensor(prompt)
        n = len(tokens)
        t0 = time.perf_counter()
        hit, where, past = 0, [], None
        if self.kv is not None:
            hit = min(self.kv.lookup(tokens), n - 1)
            if hit:  # which tier serves each chunk (index checks, before the load promotes them)
                keys = self.kv.keys(tokens)[:math.ceil(hit / self.kv.chunk_tokens)]
                where = [self.kv.store.where(k) or "miss" for k in keys]
        t1 = time.perf_counter()
        if hit:
            try:
                past = self.kv.load(tokens, hit)
            except MissingKeyError:  # a chunk vanished after lookup: take the leading run still there
                past = self.kv.load(tokens[:hit])
            hit = 0 if past is None else past[0].shape[1]
        t2 = time.perf_counter()
        tiers: Counter[str | None] = Counter()
        for i, tier in enumerate(where):
            tiers[tier] += max(0, min(self.kv.chunk_tokens, hit - i * self.kv.chunk_tokens))
        out = self.model.prefill(tokens[hit:], past, last_only=self.last_only)
        t3 = time.perf_counter()
        if self.kv is not None and self.save:
            self.kv.save(tokens, out.kv)
        t4 = time.perf_counter()
        return CachedPrefill(out.logits, out.kv, n, hit, {k: v for k, v in tiers.items() if v},
                             t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    def decode(self, result: CachedPrefill, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy-decode ``max_new_tokens`` after a prefill; returns the ids and the KV before the last."""
        kv, logits, generated = result.kv, result.logits, []
        for _ in range(max_new_tokens):
            generated.append(int(logits[-1].argmax()))
            if len(generated) == max_new_tokens:
                break
            out = self.model.prefill(generated[-1:], kv, last_only=True)
            kv, logits = out.kv, out.logits
        return generated, kv
