"""A compact Llama/Qwen-style decoder with random weights, for KV-cache tests, the demo and benches.

Standard architecture: token embedding; per layer RMSNorm → grouped-query attention with rotary position
embeddings (K stored after RoPE, as engines do) → residual, RMSNorm → SwiGLU MLP → residual; final
RMSNorm and an untied LM head. Weights are drawn from a fixed seed, so every process builds the same
model from the same :class:`TinyConfig`.

Numerics: weights and activations in the model dtype; RMSNorm statistics and rotary tables in float32
(like HF Llama); attention is ``torch.nn.functional.scaled_dot_product_attention`` (fused, float32
accumulation). On CPU the forward pass is deterministic for a fixed thread count: the same
call on the same inputs gives bit-identical outputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInputError, InvalidTypeError
from ..tensors import dtype_name

#: Max |Δlogit| allowed between a prefix/suffix split and a full recompute, by dtype (tests, demo, bench).
#: Continuing from the same past KV is bit-identical; a different split only reorders float sums.
RECOMPUTE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class TinyConfig:
    """Architecture hyper-parameters (names follow HF ``LlamaConfig``) plus the weight seed."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    seed: int = 0
    name: str = "tierstore/tiny-llama"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidInputError(f"TinyConfig.{f} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidInputError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise InvalidInputError("head_dim must be even for rotary embeddings")

    @property
    def revision(self) -> str:
        """Digest of every field: a different config or seed is a different model (and KV namespace)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """KV bytes one token occupies across all layers (K and V)."""
        return (self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim
                * torch.empty((), dtype=dtype).element_size())


@dataclass
class PrefillOutput:
    """Result of :meth:`TinyDecoder.prefill`.

    ``logits``: ``(n_new, vocab)`` float32 (``(1, vocab)`` with ``last_only``). ``kv``: per layer
    ``(2, n_past + n_new, kv_heads, head_dim)`` — the past followed by the new tokens' K (after RoPE)
    and V, in the model dtype.
    """

    logits: torch.Tensor
    kv: list[torch.Tensor]

    def new_kv(self, n_past: int) -> list[torch.Tensor]:
        """Views of the KV of the new tokens only."""
        return [t[:, n_past:] for t in self.kv]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, past: torch.Tensor | None):
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        q = (q * cos + _rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + _rotate_half(k) * sin).to(x.dtype)
        kv = torch.stack((k, v)) if past is None else torch.cat((past, torch.stack((k, v))), dim=1)
        n_past = kv.shape[1] - n
        # (1, heads, T, dim): with a batch dim, CPU SDPA takes its fused flash kernel (3-D inputs fall
        # back to the ~10x slower math path)
        q, keys, values = (t.transpose(0, 1)[None] for t in (q, kv[0], kv[1]))
        if n_past == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:  # query i (absolute position n_past + i) sees keys 0 .. n_past + i
            mask = torch.ones(n, kv.shape[1], dtype=torch.bool, device=x.device).tril(n_past)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1)), kv


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, past):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class TinyDecoder(nn.Module):
    """The decoder. Build with ``TinyDecoder(config, dtype=torch.bfloat16)``; call :meth:`prefill`."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, config: TinyConfig | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__()
        cfg = config or TinyConfig()
        if not isinstance(cfg, TinyConfig):
            raise InvalidTypeError(f"config must be a TinyConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        self.to(device=device, dtype=dtype)
        self.eval()
        self.requires_grad_(False)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        self.register_buffer("inv_freq", inv.float().to(device), persistent=False)

    def _init_weights(self) -> None:
        # drawn in float32 from one seeded generator in a fixed order, then cast: identical in every process
        gen = torch.Generator().manual_seed(self.config.seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=gen) * self.config.initializer_range)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def namespace_fields(self) -> dict:
        """``model``, ``revision``, ``dtype`` for a :class:`~tierstore.KVNamespace` of this model."""
        return {"model": self.config.name, "revision": self.config.revision, "dtype": dtype_name(self.dtype)}

    def _rope(self, start: int, n: int):
        pos = torch.arange(start, start + n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (n, 1, head_dim)
        return emb.cos(), emb.sin()

    def _check_past(self, past) -> int:
        cfg = self.config
        if past is None:
            return 0
        if isinstance(past, torch.Tensor) or not isinstance(past, Sequence):
            raise InvalidTypeError("past must be a list with one (2, n, kv_heads, head_dim) tensor per layer")
        if len(past) != cfg.num_hidden_layers:
            raise InvalidInputError(f"past has {len(past)} layers, the model has {cfg.num_hidden_layers}")
        n = None
        for i, t in enumerate(past):
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"past[{i}] is {type(t).__name__}, not a tensor")
            want = (2, t.shape[1] if t.dim() == 4 else -1, cfg.num_key_value_heads, cfg.head_dim)
            if t.dim() != 4 or tuple(t.shape) != want or (n is not None and t.shape[1] != n):
                raise InvalidInputError(f"past[{i}] must be (2, n_past, {cfg.num_key_value_heads}, "
                                        f"{cfg.head_dim}) like every layer, got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise InvalidInputError(f"past[{i}] has dtype {t.dtype}, the model runs in {self.dtype}")
            n = t.shape[1]
        return 0 if n is None else n

    @torch.inference_mode()
    def prefill(self, token_ids, past: Sequence[torch.Tensor] | None = None, *,
                last_only: bool = False, before_layer: Callable[[int], object] | None = None) -> PrefillOutput:
        """Run the new tokens ``token_ids`` after ``past`` (the KV of the preceding tokens, or ``None``).

        ``token_ids``: list/tuple/1-D integer tensor of new tokens (at least one). ``past``: one
        ``(2, n_past, kv_heads, head_dim)`` tensor per layer in the model dtype. Returns the logits of the
        new tokens (only the last with ``last_only``) and the full per-layer KV (past + new).
        ``before_layer(i)`` runs before layer ``i`` attends: an engine's wait for that layer's KV
        (e.g. :meth:`tierstore.kv.LayerwiseLoad.wait_for_layer`).
        """
        from ..kv.namespace import token_tensor

        ids = token_tensor(token_ids)
        if ids.numel() == 0:
            raise InvalidInputError("prefill needs at least one new token")
        if int(ids.max()) >= self.config.vocab_size:
            raise InvalidInputError(f"token id {int(ids.max())} >= vocab_size {self.config.vocab_size}")
        n_past = self._check_past(past)
        if n_past + len(ids) > self.config.max_position_embeddings:
            raise InvalidInputError(f"{n_past + len(ids)} positions exceed max_position_embeddings")
        ids = ids.to(self.device)
        x = self.embed_tokens(ids)
        cos, sin = self._rope(n_past, len(ids))
        kv = []
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x, layer_kv = layer(x, cos, sin, None if past is None else past[i].to(self.device))
            kv.append(layer_kv)
        if last_only:
            x = x[-1:]
        logits = self.lm_head(self.norm(x)).float()
        return PrefillOutput(logits=logits, kv=kv)

    @torch.inference_mode()
    def generate(self, token_ids, past: Sequence[torch.Tensor] | None = None,
                 max_new_tokens: int = 16) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding: prefill ``token_ids`` after ``past``, then decode ``max_new_tokens`` tokens.

        Returns the generated ids and the KV of everything up to (not including) the last generated token.
        """
        out = self.prefill(token_ids, past, last_only=True)
        generated, kv = [], out.kv
        for _ in range(max_new_tokens):
            nxt = int(out.logits[-1].argmax())
            generated.append(nxt)
            if len(generated) == max_new_tokens:
                break
            out = self.prefill([nxt], kv, last_only=True)
            kv = out.kv
        return generated, kv
