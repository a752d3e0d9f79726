"""KV-cache namespaces and token ids in canonical form.

A :class:`KVNamespace` names everything that makes one engine's KV cache unusable by another: model,
revision, dtype, layout, tensor/pipeline-parallel rank and size, chunk size, a tenant salt and the key
format version. Its canonical bytes go into every chunk key, so two namespaces that differ in any field
never share a key.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidInputError, InvalidTypeError
from ..keys import ChunkKey
from ..tensors import DTYPES, dtype_name

if TYPE_CHECKING:
    import numpy as np

    #: token ids as callers hold them: a list/tuple of ints or a 1-D integer tensor / array
    TokenIds = Sequence[int] | torch.Tensor | np.ndarray[Any, Any]

#: Version of the KV key derivation; bump it when the canonical bytes or chunking change.
KV_FORMAT_VERSION = 1
_MAGIC = b"tierstore.kv\x00"


def _check_str(name: str, value: object, *, allow_empty: bool = False) -> None:
    if not isinstance(value, str):
        raise InvalidTypeError(f"KVNamespace.{name} must be a str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise InvalidInputError(f"KVNamespace.{name} must not be empty")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"KVNamespace.{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidInputError(f"KVNamespace.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class KVNamespace:
    """Identity of a KV cache: which engine configuration produced it.

    Parameters
    ----------
    model:
        Model name or fingerprint, e.g. ``"Qwen/Qwen3-8B"``.
    revision:
        Weights revision (commit, checksum); ``""`` when unknown.
    dtype:
        KV dtype as a name (``"bfloat16"``) or a ``torch.dtype``; stored as the name.
    layout:
        Tensor form of the stored chunks. ``"mha"`` (default) is the canonical per-layer
        ``(2, tokens, kv_heads, head_dim)``; a layout starting with ``"mla"`` is ``(tokens, latent_dim)``.
        Anything after the form (``"mha:vllm-hnd"``) only namespaces the keys.
    tp_rank, tp_size, pp_rank, pp_size:
        Tensor- and pipeline-parallel position; a rank holds its own heads/layers, so ranks never share.
    chunk_tokens:
        Tokens per chunk; ``None`` until a :class:`~tierstore.kv.KVCacheStore` binds it.
    tenant:
        Optional salt isolating one tenant's cache from everyone else's (``None`` = shared).
    format_version:
        Key derivation version (:data:`KV_FORMAT_VERSION`).

    Raises :class:`~tierstore.InvalidTypeError` / :class:`~tierstore.InvalidInputError` on bad fields.
    """

    model: str
    revision: str = ""
    dtype: str = "bfloat16"
    layout: str = "mha"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    chunk_tokens: int | None = None
    tenant: str | None = None
    format_version: int = KV_FORMAT_VERSION

    def __post_init__(self) -> None:
        _check_str("model", self.model)
        _check_str("revision", self.revision, allow_empty=True)
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        _check_str("dtype", self.dtype)
        if self.dtype not in DTYPES:
            raise InvalidInputError(f"KVNamespace.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        _check_str("layout", self.layout)
        for name in ("tp_size", "pp_size", "format_version"):
            _check_int(name, getattr(self, name), 1)
        _check_int("tp_rank", self.tp_rank, 0)
        _check_int("pp_rank", self.pp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise InvalidInputError(f"KVNamespace.tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise InvalidInputError(f"KVNamespace.pp_rank {self.pp_rank} must be < pp_size {self.pp_size}")
        if self.chunk_tokens is not None:
            _check_int("chunk_tokens", self.chunk_tokens, 1)
        if self.tenant is not None:
            _check_str("tenant", self.tenant)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_mla(self) -> bool:
        """True when chunks hold MLA latents ``(tokens, latent_dim)`` instead of K and V."""
        return self.layout.lower().startswith("mla")

    def replace(self, **changes: Any) -> KVNamespace:
        """A copy with ``changes`` applied (validated like a new namespace)."""
        return dataclasses.replace(self, **changes)

    def to_bytes(self) -> bytes:
        """Canonical bytes: sorted-key compact JSON of every field behind a fixed magic.

        Depends only on field values, never on the process (no ``hash()``), so every node derives the
        same keys.
        """
        fields = dataclasses.asdict(self)
        return _MAGIC + json.dumps(fields, sort_keys=True, separators=(",", ":"),
                                   ensure_ascii=True).encode("ascii")


def token_tensor(token_ids: TokenIds) -> torch.Tensor:
    """``token_ids`` as a 1-D contiguous CPU ``int64`` tensor.

    Accepts a list/tuple of ints (Python or numpy integers), or a 1-D integer ``torch.Tensor`` /
    ``numpy.ndarray`` of any integer dtype on any device. The same ids give the same tensor whatever the
    container or dtype. Raises :class:`InvalidTypeError` for non-integers (floats, bools, strings) and
    :class:`InvalidInputError` for negative ids or more than one dimension.
    """
    if isinstance(token_ids, torch.Tensor):
        t = token_ids
    elif isinstance(token_ids, (list, tuple)):
        for tok in token_ids:
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
                raise InvalidTypeError(f"token ids must be integers, got {type(tok).__name__} {tok!r}")
        ids = [int(tok) for tok in token_ids]
        if ids and not (min(ids) >= 0 and max(ids) < 1 << 63):  # (torch would raise its own overflow error)
            raise InvalidInputError(f"token ids must lie in [0, 2**63), got [{min(ids)}, {max(ids)}]")
        t = torch.tensor(ids, dtype=torch.int64)
    elif type(token_ids).__module__ == "numpy" and hasattr(token_ids, "dtype"):
        arr: Any = token_ids  # a numpy array, recognised without importing numpy
        if arr.dtype.kind not in "iu":
            raise InvalidTypeError(f"token ids must have an integer dtype, got numpy {arr.dtype}")
        t = torch.from_numpy(arr.astype("int64", copy=False).reshape(arr.shape))
    elif isinstance(token_ids, Sequence) and not isinstance(token_ids, (str, bytes)):
        return token_tensor(list(token_ids))
    else:
        raise InvalidTypeError("token ids must be a list/tuple of ints or an integer tensor/array, "
                               f"got {type(token_ids).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidTypeError(f"token ids must have an integer dtype, got {t.dtype}")
    if t.dim() != 1:
        raise InvalidInputError(f"token ids must be 1-D, got shape {tuple(t.shape)}")
    t = t.detach().to(device="cpu", dtype=torch.int64).contiguous()
    if t.numel() and int(t.min()) < 0:
        raise InvalidInputError(f"token ids must be >= 0, got {int(t.min())}")
    return t


def prefix_keys(namespace: KVNamespace, tokens: torch.Tensor, *, partial: bool = False) -> list[ChunkKey]:
    """Chained keys of ``tokens`` (a :func:`token_tensor`) split into ``namespace.chunk_tokens`` chunks.

    ``key[i] = H(key[i-1] ‖ namespace bytes ‖ int64-LE token ids of chunk i)``, so a key names the whole
    prefix up to the end of its chunk. One key per full chunk; with ``partial`` also one for a trailing
    partial chunk (its key differs from the full chunk's it will later become part of).
    """
    size = namespace.chunk_tokens
    if size is None:
        raise InvalidInputError("the namespace has no chunk_tokens; bind it through KVCacheStore")
    ns = namespace.to_bytes()
    data = tokens.numpy().astype("<i8", copy=False)
    n = len(data)
    end = n if partial else n - n % size
    keys, parent = [], None
    for start in range(0, end, size):
        parent = ChunkKey.chain(parent, ns, data[start:start + size].tobytes())
        keys.append(parent)
    return keys
