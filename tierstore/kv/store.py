"""``KVCacheStore``: an engine's KV cache as prefix-chained chunks in a tiered store.

**Granularity on the store.** A chunk (``chunk_tokens`` tokens) is keyed by its prefix; by default one
object holds every layer of it, under the chunk key itself. With ``layers_per_object=g`` each chunk is
stored as ``ceil(num_layers / g)`` objects, one per group of ``g`` consecutive layers, keyed
``H(chunk key ‖ "tierstore.kv.layers" ‖ first, end layer)``. That is what layer-wise loading needs: the
first layers' objects are read, checksummed and scattered into the engine's cache while later layers
are still being read, instead of every layer's bytes (each object is verified as a whole) arriving
before layer 0 is usable. Objects stay large enough for efficient I/O (a Qwen3-8B chunk of 256 tokens is
1 MiB per layer in bf16). Both forms share :meth:`KVCacheStore.keys` (the golden prefix keys); a store
written with one grouping is a miss for the other.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidInputError, InvalidTypeError, MissingKeyError
from ..keys import ChunkKey
from ..reservation import reservable
from .namespace import KVNamespace, prefix_keys, token_tensor
from .paged import PagedLayout
from .rows import PagedTransfer, Piece
from .transfer import LayerwiseLoad, Task, per_store, run_load, run_save, task_bytes, windows

if TYPE_CHECKING:
    from ..api import Store
    from ..telemetry import Counters
    from ..tensors import TensorDict
    from .namespace import TokenIds

log = logging.getLogger("tierstore.kv")

DEFAULT_CHUNK_TOKENS = 256
_LAYER = "layer.{}"
_GROUP_DOMAIN = b"tierstore.kv.layers"

#: per-chunk object keys remembered by a KVCacheStore (a few hundred bytes each)
_GROUP_KEYS_KEPT = 16384

def count_token_hits(counters: Counters, asked: int, tiers: Sequence[str], chunk_tokens: int,
                     hit: int | None = None) -> None:
    """Count one lookup in a store's ``counters``: ``asked`` tokens (``kv_lookup_tokens``) and, per tier, the
    tokens found (``kv_hit_tokens``) — ``chunk_tokens`` per leading chunk held by ``tiers[i]``, the first
    ``hit`` tokens in all (default: every chunk in full). The token hit rate per tier."""
    hit = len(tiers) * chunk_tokens if hit is None else hit
    counters.add("kv_lookup_tokens", asked)
    for i, tier in enumerate(tiers):
        n = min(chunk_tokens, hit - i * chunk_tokens)
        if n > 0:
            counters.add("kv_hit_tokens", n, tier)


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
    layers_per_object:
        ``None`` (default): one object per chunk holding every layer. An int ``g``: one object per
        chunk and group of ``g`` layers, so :meth:`load_into` with ``layerwise=True`` hands out layer 0
        while later layers are still loading (see the module docstring). Needs ``num_layers``.
    num_layers:
        The model's layer count (required with ``layers_per_object``; checked against what is saved).
    """

    def __init__(self, store: Store, namespace: KVNamespace, chunk_tokens: int | None = None, *,
                 partial_chunks: bool = False, layers_per_object: int | None = None,
                 num_layers: int | None = None) -> None:
        if not isinstance(namespace, KVNamespace):
            raise InvalidTypeError(f"namespace must be a tierstore.KVNamespace, got {type(namespace).__name__}")
        for method in ("put", "get", "lookup", "where", "prefetch", "get_many", "put_many", "get_many_async"):
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
        for name, v in (("layers_per_object", layers_per_object), ("num_layers", num_layers)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidInputError(f"{name} must be a positive int or None, got {v!r}")
        if layers_per_object is not None and num_layers is None:
            raise InvalidInputError("layers_per_object needs num_layers (the model's layer count)")
        self.layers_per_object = layers_per_object
        self.num_layers = num_layers
        self._shared = per_store(store)
        self._group_keys: dict[tuple[ChunkKey, tuple[tuple[int, int], ...]], list[ChunkKey]] = {}  # bounded memo
        self.store = store
        self.namespace = namespace
        assert namespace.chunk_tokens is not None  # set just above
        self.chunk_tokens: int = namespace.chunk_tokens
        self.partial_chunks = bool(partial_chunks)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("lookups", "lookup_tokens", "hit_tokens", "saved_chunks",
                                      "skipped_chunks", "unsaved_chunks", "loaded_chunks", "load_misses",
                                      "bad_chunks"), 0)

    def for_tenant(self, tenant: str | None) -> KVCacheStore:
        """This cache under ``tenant``'s keys (same store and layout options). Staging buffers and layer-wise
        loader threads belong to the store: an engine serving many tenants keeps one set, not one per tenant."""
        return KVCacheStore(self.store, self.namespace.replace(tenant=tenant), partial_chunks=self.partial_chunks,
                            layers_per_object=self.layers_per_object, num_layers=self.num_layers)

    # ------------------------------------------------------------------ keys
    def keys(self, token_ids: TokenIds) -> list[ChunkKey]:
        """One chained key per full chunk of ``token_ids`` (plus the trailing partial chunk when
        ``partial_chunks``). ``token_ids``: list/tuple of ints or a 1-D integer tensor/array of any
        integer dtype — the same ids always give the same keys."""
        return prefix_keys(self.namespace, token_tensor(token_ids), partial=self.partial_chunks)

    def _covered(self, n_chunks: int, n_tokens: int) -> int:
        """Tokens covered by the first ``n_chunks`` chunks of an ``n_tokens``-long sequence."""
        return min(n_chunks * self.chunk_tokens, n_tokens)

    def lookup(self, token_ids: TokenIds, *, probe: bool = True, local: bool = False) -> int:
        """Number of leading tokens whose KV the store holds (nothing is read; ``probe``/``local`` as for
        :meth:`TieredStore.locate <tierstore.TieredStore.locate>`).

        Counted in the store's ``counters``: ``kv_lookup_tokens`` (tokens asked about) and, per tier,
        ``kv_hit_tokens`` (tokens found, under the tier that holds them) — the token hit rate per tier.
        """
        tokens = token_tensor(token_ids)
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        tiers = self._located(keys, probe=probe, local=local)
        hit = self._covered(len(tiers), len(tokens))
        self._count(lookups=1, lookup_tokens=len(tokens), hit_tokens=hit)
        self.count_tokens(len(tokens), tiers, hit)
        return hit

    def count_tokens(self, asked: int, tiers: Sequence[str], hit: int) -> None:
        """Count one lookup of ``asked`` tokens whose first ``hit`` tokens are in the chunks held by ``tiers``
        (one tier name per leading chunk) in the store's counters."""
        count_token_hits(self.store.counters, asked, tiers, self.chunk_tokens, hit)

    # ------------------------------------------------------------------ objects on the store
    def _groups(self, n_layers: int | None) -> list[tuple[int, int]] | None:
        """Layer ranges stored as one object each; ``None`` = one object per chunk with every layer."""
        if self.layers_per_object is None:
            return None
        if n_layers is not None and n_layers != self.num_layers:
            raise InvalidInputError(f"{n_layers} layers given, the store was set up with num_layers={self.num_layers}")
        g, n = self.layers_per_object, self.num_layers
        assert n is not None  # required with layers_per_object (checked in __init__)
        return [(lo, min(lo + g, n)) for lo in range(0, n, g)]

    def _object_keys(self, key: ChunkKey, groups: list[tuple[int, int]] | None) -> list[ChunkKey]:
        """The object keys of one chunk: itself, or one per layer group (remembered: a load and the lookup
        before it derive the same keys, a few µs of hashing each)."""
        if groups is None:
            return [key]
        memo = (key, tuple(groups))
        got = self._group_keys.get(memo)
        if got is None:
            if len(self._group_keys) >= _GROUP_KEYS_KEPT:
                self._group_keys.clear()
            got = self._group_keys[memo] = [ChunkKey.chain(key, _GROUP_DOMAIN, struct.pack("<II", lo, hi))
                                            for lo, hi in groups]
        return got

    def _held(self, keys: list[ChunkKey], probe: bool = True) -> int:
        """Leading chunks of ``keys`` whose every object some tier holds; ``probe=False`` asks the
        in-memory indexes only (no I/O: shared tiers are not probed for keys they do not list)."""
        return len(self._located(keys, probe=probe))

    def _located(self, keys: list[ChunkKey], probe: bool = True, local: bool = False) -> list[str]:
        """Per leading chunk of ``keys`` whose every object some tier holds, the slowest tier among them."""
        if not keys:
            return []
        groups = self._groups(None)
        per = 1 if groups is None else len(groups)
        flat = [k for key in keys for k in self._object_keys(key, groups)]
        names = self.store.locate(flat, probe=probe, local=local)
        if per == 1:
            return names
        order = {t.name: i for i, t in enumerate(self.store.tiers)}
        return [max(names[i:i + per], key=order.__getitem__) for i in range(0, len(names) - per + 1, per)]

    def where(self, token_ids: TokenIds) -> list[str | None]:
        """Per chunk key of ``token_ids``: name of the highest tier holding it, or ``None``."""
        groups = self._groups(None)
        return [self.store.where(self._object_keys(k, groups)[-1]) for k in self.keys(token_ids)]

    def prefetch(self, token_ids: TokenIds) -> Future[int]:
        """Start promoting the chunks of ``token_ids`` toward the top tier (``store.prefetch``); call it
        when a request arrives so a later :meth:`load` reads from memory."""
        groups = self._groups(None)
        return self.store.prefetch([k for key in self.keys(token_ids) for k in self._object_keys(key, groups)])

    # ------------------------------------------------------------------ save
    def save(self, token_ids: TokenIds, layers: Sequence[torch.Tensor], *, start: int = 0) -> int:
        """Store the KV of ``token_ids``; return how many tokens' chunks were newly written.

        ``layers`` holds one tensor per layer, ``(2, n_tokens, kv_heads, head_dim)`` (MLA namespaces:
        ``(n_tokens, latent_dim)``), all of the namespace's dtype, with ``n_tokens == len(token_ids) - start``:
        the KV of tokens ``[start, len(token_ids))``. ``start`` (a multiple of the chunk size) extends a prefix
        saved before — a conversation's decoded tokens — without copying it again. Chunks already held (the
        leading run found by ``lookup``) are skipped. Returns once the top tier holds every new chunk; lower
        tiers are written in the background (``store.flush()`` waits).
        """
        tokens = token_tensor(token_ids)
        if type(start) is not int or not 0 <= start <= len(tokens) or start % self.chunk_tokens:
            raise InvalidInputError(f"start must be a multiple of {self.chunk_tokens} tokens within the "
                                    f"{len(tokens)} token ids, got {start!r}")
        self._check_layers(layers, len(tokens) - start)
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        groups = self._groups(len(layers)) or [(0, len(layers))]
        first = start // self.chunk_tokens
        have = first + self._held(keys[first:])  # chunks held from ``start`` on
        items = []
        for i in range(have, len(keys)):
            lo_token = i * self.chunk_tokens
            hi_token = min(lo_token + self.chunk_tokens, len(tokens))
            objects = self._object_keys(keys[i], self._groups(len(layers)))
            for k, (lo, hi) in zip(objects, groups, strict=True):
                items.append((k, {_LAYER.format(j): self._slice(layers[j], lo_token - start, hi_token - start)
                                  for j in range(lo, hi)}))
        ok = self.store.put_many(items) if items else []
        per = len(groups)
        written = sum(min(self.chunk_tokens, len(tokens) - i * self.chunk_tokens)
                      for n, i in enumerate(range(have, len(keys))) if all(ok[n * per:(n + 1) * per]))
        self._count(saved_chunks=len(keys) - have, skipped_chunks=have - first)
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
        want, strict = self._wanted(keys, total, n_tokens)
        if want == 0:
            return None
        n_chunks = math.ceil(want / self.chunk_tokens)
        groups = self._groups(None)
        per = 1 if groups is None else len(groups)
        got = self.store.get_many([k for key in keys[:n_chunks] for k in self._object_keys(key, groups)],
                                  device=device)
        chunks: list[TensorDict] = []
        for i in range(n_chunks):
            parts = got[i * per:(i + 1) * per]
            found = [p for p in parts if p is not None]
            data = {n: t for p in found for n, t in p.items()} if len(found) == per else None
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

    def _wanted(self, keys: list[ChunkKey], total: int, n_tokens: int | None,
                probe: bool = True) -> tuple[int, bool]:
        """Tokens to load — every leading hit, or exactly ``n_tokens`` (checked) — and whether exact.
        ``probe=False``: hits by the in-memory indexes only (see :meth:`_held`)."""
        if n_tokens is None:
            return self._covered(self._held(keys, probe), total), False
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool):
            raise InvalidTypeError(f"n_tokens must be an int or None, got {type(n_tokens).__name__}")
        if not 0 <= n_tokens <= total:
            raise InvalidInputError(f"n_tokens={n_tokens} is outside [0, {total}] (the number of token ids)")
        storable = self._covered(len(keys), total)
        if n_tokens > storable:
            raise InvalidInputError(f"n_tokens={n_tokens} exceeds the {storable} tokens held in full chunks "
                                    f"of {self.chunk_tokens} (partial_chunks is off)")
        have = self._covered(self._held(keys[:math.ceil(n_tokens / self.chunk_tokens)], probe), total)
        if have < n_tokens:
            raise MissingKeyError(f"only {have} of the requested {n_tokens} tokens are cached")
        return n_tokens, True

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

    # ------------------------------------------------------------------ paged caches
    def load_into(self, token_ids: TokenIds, caches: Sequence[torch.Tensor] | torch.Tensor, layout: str | PagedLayout,
                  block_ids: Sequence[int] | torch.Tensor, *, n_tokens: int | None = None, start: int = 0,
                  block_size: int | None = None, layerwise: bool = False) -> int | LayerwiseLoad:
        """Load cached KV of ``token_ids`` straight into the blocks of a paged KV cache.

        Tokens ``[start, n)`` are written, where ``n`` is every leading hit (or exactly ``n_tokens``,
        else :class:`~tierstore.MissingKeyError` before anything is read); tokens before ``start`` are
        the engine's already and chunks entirely before it are not read. ``caches`` is one tensor per
        layer (``vllm``, ``vllm_cpu``, ``flashinfer``, ``mla``) or the one pool tensor (SGLang layouts),
        of the namespace's dtype; ``block_ids`` is the request's block table (token ``t`` lives in
        ``block_ids[t // block_size]``). Chunks are read in batches into reusable staging and scattered
        window by window: nothing of the size of the whole transfer is allocated.

        Returns ``n`` — fewer if a chunk vanished after the lookup (blocks past it are not written and
        must be recomputed). With ``layerwise=True`` returns at once a :class:`LayerwiseLoad` whose
        ``wait_for_layer(i)`` blocks until layer ``i`` is in the cache (layers complete in order; with
        ``layers_per_object`` that happens before later layers' bytes are read) and ``result()`` gives
        ``n``. The caches must not be resized or freed until the load is done.

        ``layerwise=True`` does no I/O on the caller's thread (an engine's forward thread): bad arguments
        raise there, but the hits are what the in-memory indexes know — a chunk only a shared tier holds
        counts once a probing :meth:`lookup` (or a read) found it — and the reads run on a background
        thread of this store's (a few loads at once; more wait their turn).
        """
        tokens = token_tensor(token_ids)
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        transfer = PagedTransfer(caches, layout, block_ids, block_size, self.namespace.torch_dtype,
                                 self.namespace.is_mla)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(tokens):
            raise InvalidInputError(f"start must be an int in [0, {len(tokens)}], got {start!r}")
        want, _ = self._wanted(keys, len(tokens), n_tokens, probe=not layerwise)
        pieces = self._pieces(start // self.chunk_tokens, math.ceil(want / self.chunk_tokens), len(tokens),
                              start, want, transfer)
        tasks = self._tasks(keys, pieces, transfer)
        handle = LayerwiseLoad(transfer.num_layers) if layerwise else None

        def run() -> int:
            valid, read, missed = run_load(self.store, transfer, tasks, self._shared.staging, _LAYER.format, want,
                                           handle) if tasks else (want, 0, 0)
            self._count(loaded_chunks=read // max(1, len(self._groups(transfer.num_layers) or [0])),
                        load_misses=missed)
            return valid

        if handle is None:
            return run()

        def background() -> None:
            try:
                valid = run()
                for f in handle._layers:  # layers no task touched (nothing to load)
                    if not f.done():
                        f.set_result(valid)
                handle._done.set_result(valid)
            except BaseException as exc:
                handle._fail(exc)

        self._shared.loader().submit(background)
        return handle

    def save_from(self, token_ids: TokenIds, caches: Sequence[torch.Tensor] | torch.Tensor, layout: str | PagedLayout,
                  block_ids: Sequence[int] | torch.Tensor, *, block_size: int | None = None, start: int = 0,
                  probe: bool = True, wait: bool = True) -> int:
        """Store the KV of ``token_ids`` straight out of a paged KV cache; returns the tokens newly stored.

        The cache (as for :meth:`load_into`) must hold the KV of every token of ``token_ids`` from ``start`` on
        in the blocks of ``block_ids`` (token ``t`` in ``block_ids[t // block_size]``). ``start`` (a multiple of
        the chunk size) extends a prefix saved before, as for :meth:`save`: its chunks are neither checked nor
        copied. Chunks already held (the leading run from ``start``; with ``probe=False`` as the in-memory
        indexes know it: no I/O before the copy, what an engine's forward thread wants) are skipped. Where the
        top tier is a host pool (``write_back``) the others are gathered straight into pool memory reserved
        for them and committed; otherwise window by window into reusable staging and stored with one
        ``put_many`` per window. Returns once the top tier holds them; lower tiers are written in the
        background. ``wait=False`` (saving in place): never wait on storage — only chunks that fit now, in free
        pool memory or in place of clean copies (held by a tier below), are saved; the rest are not (counted
        ``unsaved_chunks``), rather than writing dirty chunks down or waiting for room.
        """
        tokens = token_tensor(token_ids)
        if type(start) is not int or not 0 <= start <= len(tokens) or start % self.chunk_tokens:
            raise InvalidInputError(f"start must be a multiple of {self.chunk_tokens} tokens within the "
                                    f"{len(tokens)} token ids, got {start!r}")
        keys = prefix_keys(self.namespace, tokens, partial=self.partial_chunks)
        transfer = PagedTransfer(caches, layout, block_ids, block_size, self.namespace.torch_dtype,
                                 self.namespace.is_mla)
        self._groups(transfer.num_layers)  # checks the layer count
        first = start // self.chunk_tokens
        have = first + self._held(keys[first:], probe)
        pieces = self._pieces(have, len(keys), len(tokens), 0, len(tokens), transfer)
        tasks = self._tasks(keys, pieces, transfer)
        ok = run_save(self.store, transfer, tasks, self._shared.staging, _LAYER.format,
                      wait or not self.saves_in_place) if tasks else []
        stored_pieces = [p for t in tasks for p in t.pieces]
        failed = {p.index for p, stored in zip(stored_pieces, ok, strict=True) if not stored}
        self._count(saved_chunks=len(pieces), skipped_chunks=have - first, unsaved_chunks=len(failed))
        return sum(p.stored for p in pieces if p.index not in failed)

    @property
    def saves_in_place(self) -> bool:
        """Whether :meth:`save_from` gathers straight into the store's memory (its top tier is a host pool
        under ``write_back``: one copy, nothing held outside the store), rather than through staging."""
        return reservable(self.store) is not None

    def _pieces(self, first: int, end: int, total: int, a: int, b: int, transfer: PagedTransfer) -> list[Piece]:
        """Chunks ``[first, end)`` moving tokens ``[a, b)``; validates the block table for all of them."""
        pieces = []
        for c in range(first, end):
            lo = c * self.chunk_tokens
            stored = min(self.chunk_tokens, total - lo)
            p = Piece(c, lo, stored, max(a, lo), min(b, lo + stored))
            if p.a < p.b:
                pieces.append(p)
        if pieces:  # consecutive: one plan raises on a short, out-of-range or repeating block table
            transfer.plan(0, pieces[0].a, pieces[-1].b)
        return pieces

    def _tasks(self, keys: list[ChunkKey], pieces: list[Piece], transfer: PagedTransfer) -> list[Task]:
        """Per layer group (in layer order), windows of pieces with the object key of each."""
        groups = self._groups(transfer.num_layers)
        spans = groups or [(0, transfer.num_layers)]
        object_keys = {p.index: self._object_keys(keys[p.index], groups) for p in pieces}  # once per chunk
        tasks = []
        for gi, span in enumerate(spans):
            one = Task(span, pieces[:1], [])
            per_chunk = task_bytes(one, transfer) if pieces else 0
            for window in windows(pieces, per_chunk):
                tasks.append(Task(span, window, [object_keys[p.index][gi] for p in window]))
        return tasks

    # ------------------------------------------------------------------ admin
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def stats(self) -> dict[str, int]:
        """Counters: lookups, lookup/hit tokens, saved/skipped/unsaved/loaded chunks, load misses, bad chunks
        (``unsaved_chunks``: chunks a :meth:`save_from` tried to store and did not: no room, an error)."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        ns = self.namespace
        return (f"<KVCacheStore {ns.model}@{ns.revision or '-'} {ns.dtype} {ns.layout} "
                f"tp{ns.tp_rank}/{ns.tp_size} pp{ns.pp_rank}/{ns.pp_size} chunk={self.chunk_tokens}>")
