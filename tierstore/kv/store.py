"""``KVCacheStore``: an engine's KV cache as prefix-chained chunks in a tiered store."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidInputError, InvalidTypeError, MissingKeyError
from ..keys import ChunkKey
from .namespace import KVNamespace, prefix_keys, token_tensor

if TYPE_CHECKING:
    from ..store import TieredStore
    from ..tensors import TensorDict
    from .namespace import TokenIds

log = logging.getLogger("tierstore.kv")

DEFAULT_CHUNK_TOKENS = 256
_LAYER = "layer.{}"


class KVCacheStore:
    """Save and load per-layer KV caches of token sequences, keyed by prefix.

    Token ids are cut into chunks of ``chunk_tokens``; chunk ``i`` is stored under
    ``H(key[i-1] ‖ namespace ‖ tokens of chunk i)`` (see :func:`~tierstore.kv.prefix_keys`), holding that
    chunk's KV for every layer. A chunk is therefore reusable only after exactly the same prefix, under
    exactly the same namespace (model, revision, dtype, layout, ranks, chunk size, tenant).

    **Partial chunks.** By default a trailing partial chunk is neither stored nor looked up, like
    LMCache's ``save_unfull_chunk=False``: its key would name a prefix that the next, longer request no
    longer has, so it rarely hits and costs a write per request. With ``partial_chunks=True`` it is stored
    under its own key and hits only a request whose tokens end exactly there (e.g. a resent prompt).

    Parameters
    ----------
    store:
        A :class:`~tierstore.TieredStore` (anything with ``put/get/lookup/contains/where/prefetch``).
    namespace:
        The :class:`KVNamespace` of the engine producing/consuming the cache.
    chunk_tokens:
        Tokens per chunk; default the namespace's ``chunk_tokens`` or 256. Passing one that contradicts
        the namespace raises :class:`~tierstore.InvalidInputError`.
    partial_chunks:
        Store and look up a trailing partial chunk (see above).
    """

    def __init__(self, store: TieredStore, namespace: KVNamespace, chunk_tokens: int | None = None, *,
                 partial_chunks: bool = False) -> None:
        if not isinstance(namespace, KVNamespace):
            raise InvalidTypeError(f"namespace must be a tierstore.KVNamespace, got {type(namespace).__name__}")
        for method in ("put", "get", "lookup", "where", "prefetch"):
            if not callable(getattr(store, method, None)):
                raise InvalidTypeError(f"store has no {method}(); pass a tierstore.TieredStore")
        if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool)
                                         or chunk_tokens < 1):
            raise InvalidInputError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        if namespace.chunk_tokens is None:
            namespace = namespace.replace(chunk_tokens=chunk_tokens or DEFAULT_CHUNK_TOKENS)
        elif chunk_tokens is not None and chunk_tokens != namespace.chunk_tokens:
            raise InvalidInputError(f"chunk_tokens={chunk_tokens} contradicts the namespace's "
                                    f"chunk_tokens={namespace.chunk_tokens}")
        self.store = store
        self.namespace = namespace
        assert namespace.chunk_tokens is not None  # set just above
        self.chunk_tokens: int = namespace.chunk_tokens
        self.partial_chunks = bool(partial_chunks)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("lookups", "lookup_tokens", "hit_tokens", "saved_chunks",
                                      "skipped_chunks", "loaded_chunks", "load_misses", "bad_chunks"), 0)

    # ------------------------------------------------------------------ keys
    def keys(self, token_ids: TokenIds) -> list[ChunkKey]:
        """One chained key per full chunk of ``token_ids`` (plus the trailing partial chunk when
        ``partial_chunks``). ``token_ids``: list/tuple of ints or a 1-D integer tensor/array of any
        integer dtype — the same ids always give the same keys."""
        return prefix_keys(self.namespace, token_tensor(token_ids), partial=self.partial_chunks)

    def _covered(self, n_chunks: int, n_tokens: int) -> int:
        """Tokens covered by the first ``n_chunks`` chunks of an ``n_tokens``-long sequence."""
        return min(n_chunks * self.chunk_tokens, n_tokens)

    def lookup(self, token_ids: TokenIds) -> int:
        """Number of leading tokens whose KV the store holds (index checks only, nothing is read)."""
        tokens = token_tensor(token_ids)
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        hit = self._covered(self.store.lookup(keys) if keys else 0, len(tokens))
        self._count(lookups=1, lookup_tokens=len(tokens), hit_tokens=hit)
        return hit

    def where(self, token_ids: TokenIds) -> list[str | None]:
        """Per chunk key of ``token_ids``: name of the highest tier holding it, or ``None``."""
        return [self.store.where(k) for k in self.keys(token_ids)]

    def prefetch(self, token_ids: TokenIds) -> Future[int]:
        """Start promoting the chunks of ``token_ids`` toward the top tier (``store.prefetch``); call it
        when a request arrives so a later :meth:`load` reads from memory."""
        return self.store.prefetch(self.keys(token_ids))

    # ------------------------------------------------------------------ save
    def save(self, token_ids: TokenIds, layers: Sequence[torch.Tensor]) -> int:
        """Store the KV of ``token_ids``; return how many tokens' chunks were newly written.

        ``layers`` holds one tensor per layer, ``(2, n_tokens, kv_heads, head_dim)`` (MLA namespaces:
        ``(n_tokens, latent_dim)``), all of the namespace's dtype, with ``n_tokens == len(token_ids)``.
        Chunks already held (the leading run found by ``lookup``) are skipped. Returns once the top tier
        holds every new chunk; lower tiers are written in the background (``store.flush()`` waits).
        """
        tokens = token_tensor(token_ids)
        self._check_layers(layers, len(tokens))
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        have = self.store.lookup(keys) if keys else 0
        written = 0
        for i in range(have, len(keys)):
            start = i * self.chunk_tokens
            end = min(start + self.chunk_tokens, len(tokens))
            self.store.put(keys[i], {_LAYER.format(j): self._slice(t, start, end) for j, t in enumerate(layers)})
            written += end - start
        self._count(saved_chunks=len(keys) - have, skipped_chunks=have)
        return written

    def _check_layers(self, layers: object, n_tokens: int) -> None:
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise InvalidTypeError("layers must be a list/tuple with one tensor per layer, got "
                                   f"{type(layers).__name__}")
        if not layers:
            raise InvalidInputError("layers is empty")
        first = layers[0]
        for j, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"layers[{j}] is {type(t).__name__}, not a torch.Tensor")
            if self.namespace.is_mla:
                if t.dim() != 2:
                    raise InvalidInputError(f"layers[{j}] must be (n_tokens, latent_dim) for layout "
                                            f"{self.namespace.layout!r}, got {tuple(t.shape)}")
            elif t.dim() != 4 or t.shape[0] != 2:
                raise InvalidInputError(f"layers[{j}] must be (2, n_tokens, kv_heads, head_dim), got {tuple(t.shape)}")
            if t.shape != first.shape or t.device != first.device:
                raise InvalidInputError(f"layers[{j}] is {tuple(t.shape)} on {t.device}, layers[0] is "
                                        f"{tuple(first.shape)} on {first.device}")
            if t.dtype != self.namespace.torch_dtype:
                raise InvalidInputError(f"layers[{j}] has dtype {t.dtype}, the namespace says {self.namespace.dtype}")
        n = first.shape[self._token_dim]
        if n != n_tokens:
            raise InvalidInputError(f"layers hold {n} tokens but {n_tokens} token ids were given")

    @property
    def _token_dim(self) -> int:
        return 0 if self.namespace.is_mla else 1

    def _slice(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return t[start:end] if self.namespace.is_mla else t[:, start:end]

    # ------------------------------------------------------------------ load
    def load(self, token_ids: TokenIds, n_tokens: int | None = None, *,
             device: str | torch.device = "cpu") -> list[torch.Tensor] | None:
        """The KV of the first ``n_tokens`` tokens, one tensor per layer, or ``None`` if nothing is cached.

        Tensors have the :meth:`save` shape with ``n_tokens`` tokens, on ``device``, bit-identical to
        what was saved. ``n_tokens=None`` loads every leading hit; if a chunk disappears between lookup
        and read (evicted, unreachable) the result stops before it — check the token dim. An explicit
        ``n_tokens`` beyond what is cached raises :class:`~tierstore.MissingKeyError` (a ``KeyError``);
        beyond ``len(token_ids)``, or not reachable with full chunks, :class:`~tierstore.InvalidInputError`.
        """
        tokens = token_tensor(token_ids)
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        total = len(tokens)
        if n_tokens is None:
            want = self._covered(self.store.lookup(keys) if keys else 0, total)
            strict = False
        else:
            if not isinstance(n_tokens, int) or isinstance(n_tokens, bool):
                raise InvalidTypeError(f"n_tokens must be an int or None, got {type(n_tokens).__name__}")
            if not 0 <= n_tokens <= total:
                raise InvalidInputError(f"n_tokens={n_tokens} is outside [0, {total}] (the number of token ids)")
            storable = self._covered(len(keys), total)
            if n_tokens > storable:
                raise InvalidInputError(f"n_tokens={n_tokens} exceeds the {storable} tokens held in full chunks "
                                        f"of {self.chunk_tokens} (partial_chunks is off)")
            want, strict = n_tokens, True
            have = self._covered(self.store.lookup(keys[:math.ceil(want / self.chunk_tokens)]), total)
            if have < want:
                raise MissingKeyError(f"only {have} of the requested {want} tokens are cached")
        if want == 0:
            return None
        chunks: list[TensorDict] = []
        for i in range(math.ceil(want / self.chunk_tokens)):
            data = self.store.get(keys[i], device=device)
            if data is not None and not self._valid(data, chunks, i, total):
                data = None
            if data is None:
                self._count(load_misses=1)
                if strict:
                    raise MissingKeyError(f"chunk {i} of the requested {want} tokens vanished before it was read")
                want = i * self.chunk_tokens
                break
            chunks.append(data)
        self._count(loaded_chunks=len(chunks))
        return self._assemble(chunks, want, device) if want else None

    def _valid(self, data: TensorDict, chunks: list[TensorDict], index: int, total: int) -> bool:
        """Whether a fetched chunk has the layout its key promises: the same layer names and per-token
        shape as the first chunk, the namespace dtype, and the chunk's token count."""
        d = self._token_dim
        ref = chunks[0] if chunks else data
        first = ref.get(_LAYER.format(0))
        per_token = None if first is None else first.shape[:d] + first.shape[d + 1:]
        ok = (first is not None and per_token is not None and first.dim() == (2 if self.namespace.is_mla else 4)
              and set(data) == {_LAYER.format(j) for j in range(len(ref))}
              and all(t.dtype == self.namespace.torch_dtype and t.dim() == first.dim()
                      and t.shape[d] == min(self.chunk_tokens, total - index * self.chunk_tokens)
                      and t.shape[:d] + t.shape[d + 1:] == per_token for t in data.values()))
        if not ok:
            self._count(bad_chunks=1)
            log.warning("KV chunk %d has an unexpected layout %s; treated as a miss", index,
                        {k: (tuple(v.shape), str(v.dtype)) for k, v in data.items()})
        return ok

    def _assemble(self, chunks: list[TensorDict], n: int, device: str | torch.device) -> list[torch.Tensor]:
        layers = []
        for j in range(len(chunks[0])):
            name = _LAYER.format(j)
            ref = chunks[0][name]
            shape = list(ref.shape)
            shape[self._token_dim] = n
            out = torch.empty(shape, dtype=ref.dtype, device=device)
            pos = 0
            for c in chunks:
                part = c[name]
                take = min(part.shape[self._token_dim], n - pos)
                self._slice(out, pos, pos + take).copy_(self._slice(part, 0, take))
                pos += take
            layers.append(out)
        return layers

    # ------------------------------------------------------------------ admin
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def stats(self) -> dict[str, int]:
        """Counters: lookups, lookup/hit tokens, saved/skipped/loaded chunks, load misses, bad chunks."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        ns = self.namespace
        return (f"<KVCacheStore {ns.model}@{ns.revision or '-'} {ns.dtype} {ns.layout} "
                f"tp{ns.tp_rank}/{ns.tp_size} pp{ns.pp_rank}/{ns.pp_size} chunk={self.chunk_tokens}>")
