"""``HiCacheBackend``: SGLang's HiCache storage calls on a tierstore, without importing SGLang.

:class:`tierstore_sglang.TierstoreHiCacheStorage` is this class plus SGLang's ``HiCacheStorage`` base; the
tests in ``tests/adapters`` drive this half with host pools shaped like SGLang's.

Keys: SGLang names a page by a 64-hex SHA-256 chained over the page's tokens and every page before it,
with nothing about the model or the rank in it. Each key becomes ``H(namespace ‖ key)`` where the
namespace (:class:`~tierstore.KVNamespace`) holds the model, revision, KV dtype, host-pool layout, page
size, TP/PP rank and tenant, so ranks, models and layouts never collide and every instance with the same
namespace finds what another stored. MLA pools hold the same latents on every TP rank, so their namespace
has no TP rank: one copy serves all ranks, written by TP rank 0 (SGLang skips the backups of the others)
into a disk directory the other ranks of the node read without owning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tierstore import writer_dirs
from tierstore.engines import open_store, rank_config
from tierstore.errors import ConfigError, InvalidInputError, InvalidTypeError
from tierstore.keys import ChunkKey
from tierstore.kv import KVNamespace, count_token_hits
from tierstore.store import TieredStore
from tierstore.tensors import dtype_name

from .options import BackendOptions
from .pages import PageGeometry

log = logging.getLogger("tierstore_sglang")


class HiCacheBackend:
    """A HiCache L3 storage backend over a :class:`~tierstore.TieredStore` (one per SGLang rank).

    Constructed as SGLang's dynamic backend factory does: ``(storage_config, kwargs)`` with SGLang's
    ``HiCacheStorageConfig`` (its ``extra_config`` holds the options of :class:`BackendOptions`), then
    :meth:`register_mem_pool_host` with the rank's host KV pool. Per-page results: a miss or a failed
    page is ``False`` / ``None``, never an exception; a malformed call raises
    :class:`~tierstore.InvalidInputError` / :class:`~tierstore.InvalidTypeError` before any I/O.

    Raises :class:`~tierstore.ConfigError` for options it cannot honour (no model name, decode context
    parallel, split heads, a host pool layout it cannot read in place).
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        cfg = storage_config
        self.options = options = BackendOptions.parse(getattr(cfg, "extra_config", None))
        model = options.model_id or getattr(cfg, "model_name", None)
        if not model:
            raise ConfigError("SGLang passed no model name: set model_id in the hicache extra config")
        if getattr(cfg, "dcp_size", 1) > 1:
            raise ConfigError("TierstoreHiCacheStorage does not support decode context parallel (dcp_size > 1)")
        if getattr(cfg, "should_split_heads", False):
            raise ConfigError("TierstoreHiCacheStorage does not support tp_lcm_size head splitting")
        self.model = str(model)
        self.is_mla = bool(cfg.is_mla_model)
        self.tp_rank, self.tp_size = int(cfg.tp_rank), int(cfg.tp_size)
        self.pp_rank, self.pp_size = int(cfg.pp_rank), int(cfg.pp_size)
        self.cp_rank, self.cp_size = int(getattr(cfg, "attn_cp_rank", 0)), int(getattr(cfg, "attn_cp_size", 1))
        self.dp_rank = int(getattr(cfg, "dp_rank", 0))
        self.is_writer = not self.is_mla or self.tp_rank == 0
        self.enable_metrics = bool(getattr(cfg, "enable_storage_metrics", False))
        self.store = self._open_store(options.config)
        self.mem_pool_host: Any = None
        self.geometry: PageGeometry | None = None
        self.namespace: KVNamespace | None = None
        self._ns_bytes = b""
        self._lock = threading.Lock()
        self.counters = {"pages_read": 0, "pages_hit": 0, "pages_written": 0, "pages_not_written": 0,
                         "exists_queried": 0, "exists_hit": 0}
        # per call (pages, GB/s) since the last take_metrics(), for SGLang's storage metrics
        self._prefetch: list[tuple[int, float]] = []
        self._backup: list[tuple[int, float]] = []
        self._closed = False
        log.info("tierstore: hicache backend %s rank tp%d/%d pp%d/%d%s serving %s", self.model, self.tp_rank,
                 self.tp_size, self.pp_rank, self.pp_size, " (MLA)" if self.is_mla else "", self.store)

    def _open_store(self, config: Mapping[str, Any]) -> TieredStore:
        """MLA: the writer rank tells its reader ranks which directory it got (another engine on the host
        may hold the first one: ``instances``), and they open that one (:mod:`tierstore.writer_dirs`)."""
        if "server" in config:  # a node's `tierstore serve`: every rank uses its store, no directories of their own
            return open_store(config)
        own = rank_config(config, self._rank_dir(), read_only=not self.is_writer)
        if not self.is_mla:
            return open_store(own)
        if not self.is_writer:
            return open_store(writer_dirs.follow(own))
        store = open_store(own)
        writer_dirs.announce(own, store)
        return store

    def _rank_dir(self) -> str:
        """Disk subdirectory of this rank: its own for MHA; for MLA the one its writer rank owns."""
        cp = f"-cp{self.cp_rank}of{self.cp_size}" if self.cp_size > 1 else ""
        dp = f"-dp{self.dp_rank}" if self.dp_rank else ""
        if self.is_mla:
            return f"mla-pp{self.pp_rank}of{self.pp_size}{cp}{dp}"
        return f"tp{self.tp_rank}of{self.tp_size}-pp{self.pp_rank}of{self.pp_size}{cp}{dp}"

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host KV pool whose pages the v1 calls read and write in place; fixes the namespace."""
        geometry = PageGeometry.of_pool(mem_pool_host, is_mla=self.is_mla)
        cp = f":cp{self.cp_rank}of{self.cp_size}" if self.cp_size > 1 else ""
        namespace = KVNamespace(
            model=self.model, revision=self.options.revision, dtype=dtype_name(geometry.dtype),
            layout=f"{'mla' if self.is_mla else 'mha'}:sglang-{geometry.layout}{cp}",
            tp_rank=0 if self.is_mla else self.tp_rank, tp_size=1 if self.is_mla else self.tp_size,
            pp_rank=self.pp_rank, pp_size=self.pp_size, chunk_tokens=geometry.page_size,
            tenant=self.options.tenant)
        with self._lock:
            self.mem_pool_host, self.geometry, self.namespace = mem_pool_host, geometry, namespace
            self._ns_bytes = namespace.to_bytes()

    def _bound(self) -> tuple[Any, PageGeometry]:
        pool, geometry = self.mem_pool_host, self.geometry
        if geometry is None:
            raise InvalidInputError("no host KV pool registered: call register_mem_pool_host(pool) first")
        return pool, geometry

    def chunk_keys(self, keys: Sequence[str]) -> list[ChunkKey]:
        """The store key of each SGLang page key (``H(namespace ‖ key)``)."""
        self._bound()
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise InvalidTypeError(f"keys must be a list of str, got {type(keys).__name__}")
        out = []
        for key in keys:
            if not isinstance(key, str) or not key:
                raise InvalidTypeError(f"a page key must be a non-empty str, got {key!r}")
            out.append(ChunkKey.chain(None, self._ns_bytes, key.encode("utf-8")))
        return out

    # ------------------------------------------------------------------ zero-copy v1 path
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read each key's page straight into the host pool at ``host_indices`` (``page_size`` token
        slots per key); per key whether its page arrived (a miss or a damaged chunk is ``False``)."""
        pool, geometry = self._bound()
        chunk_keys = self.chunk_keys(keys)
        outs = [geometry.pool_page(pool, start) for start in geometry.page_starts(len(keys), host_indices)]
        t0 = time.perf_counter()
        got = self.store.get_many(chunk_keys, out=outs)
        ok = [r is not None for r in got]
        self._account("pages_read", "pages_hit", len(ok), sum(ok), self._prefetch, t0, geometry)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store each key's page straight from the host pool at ``host_indices``; per key whether it is
        stored (the pool's page may be reused as soon as this returns)."""
        pool, geometry = self._bound()
        chunk_keys = self.chunk_keys(keys)
        pages = [geometry.pool_page(pool, start) for start in geometry.page_starts(len(keys), host_indices)]
        t0 = time.perf_counter()
        ok = self.store.put_many(list(zip(chunk_keys, pages, strict=True)))
        self._account("pages_written", None, len(ok), sum(ok), self._backup, t0, geometry)
        return ok

    # ------------------------------------------------------------------ lookups
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys some tier holds (indexes first; shared tiers probed in windows). Counted
        in the store's token hit rate per tier (``kv_lookup_tokens``, ``kv_hit_tokens``)."""
        tiers = self.store.locate(self.chunk_keys(keys))
        n = len(tiers)
        page = self._bound()[1].page_size
        count_token_hits(self.store.counters, len(keys) * page, tiers, page)
        with self._lock:
            self.counters["exists_queried"] += len(keys)
            self.counters["exists_hit"] += n
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ legacy path: flat page tensors
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The flat page of ``key`` (into ``target_location`` when given), or ``None``."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each key's flat page (SGLang's ``get_dummy_flat_data_page`` form), filled into
        ``target_locations[i]`` when given; ``None`` for a miss."""
        _, geometry = self._bound()
        chunk_keys = self.chunk_keys(keys)
        if target_locations is None:
            flats = [torch.empty(geometry.numel, dtype=geometry.dtype) for _ in keys]
        elif isinstance(target_locations, Sequence) and len(target_locations) == len(keys):
            flats = list(target_locations)
        else:
            raise InvalidInputError("target_locations must hold one flat page tensor per key")
        if any(isinstance(f, torch.Tensor) and not f.is_contiguous() for f in flats):
            raise InvalidInputError("target_locations must be contiguous flat tensors (they are filled in place)")
        outs = [geometry.flat_page(f, f"target_locations[{i}]") for i, f in enumerate(flats)]
        t0 = time.perf_counter()
        got = self.store.get_many(chunk_keys, out=outs)
        self._account("pages_read", "pages_hit", len(got), sum(r is not None for r in got), self._prefetch, t0,
                      geometry)
        return [f if r is not None else None for f, r in zip(flats, got, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each key's flat page ``values[i]``; ``True`` when every one is stored."""
        _, geometry = self._bound()
        chunk_keys = self.chunk_keys(keys)
        if not isinstance(values, Sequence) or len(values) != len(keys):
            raise InvalidInputError("values must hold one flat page tensor per key")
        pages = [geometry.flat_page(v, f"values[{i}]") for i, v in enumerate(values)]
        t0 = time.perf_counter()
        ok = self.store.put_many(list(zip(chunk_keys, pages, strict=True)))
        self._account("pages_written", None, len(ok), sum(ok), self._backup, t0, geometry)
        return all(ok)

    # ------------------------------------------------------------------ housekeeping
    def _account(self, total: str, hits: str | None, n: int, n_ok: int, calls: list[tuple[int, float]],
                 t0: float, geometry: PageGeometry) -> None:
        seconds = max(time.perf_counter() - t0, 1e-9)
        with self._lock:
            self.counters[total] += n
            if hits is not None:
                self.counters[hits] += n_ok
            else:
                self.counters["pages_not_written"] += n - n_ok
            if self.enable_metrics and n_ok:
                nbytes = n_ok * geometry.numel * geometry.dtype.itemsize
                calls.append((n_ok, nbytes / seconds / 1e9))

    def take_metrics(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """``(prefetch, backup)`` calls since the last call, each ``(pages, GB/s)`` (with
        ``enable_storage_metrics``)."""
        with self._lock:
            prefetch, backup = self._prefetch, self._backup
            self._prefetch, self._backup = [], []
        return prefetch, backup

    def stats(self) -> dict[str, Any]:
        """The backend's page counters and the store's :meth:`~tierstore.TieredStore.stats`."""
        with self._lock:
            counters = dict(self.counters)
        return {"backend": counters, "store": self.store.stats()}

    def clear(self) -> None:
        """SGLang's ``/flush_cache``: the stored pages are kept (a shared tier is never emptied by one
        engine; ``tierstore gc`` removes them)."""
        log.info("tierstore: clear() keeps the stored pages (shared tiers are never emptied by an engine)")

    def close(self) -> None:
        """Flush write-back and close the store (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            counters = dict(self.counters)
        log.info("tierstore: hicache backend counters %s", counters)
        self.store.close()
