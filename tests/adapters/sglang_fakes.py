"""SGLang-shaped stand-ins (no SGLang import): the storage config, the host KV pools and the cache
controller's storage calls, copied from sglang 0.5.23 (``mem_cache/hicache_storage.py``,
``mem_cache/pool_host/{mha,mla}.py``, ``managers/cache_controller.py``), and :class:`Instance`, one rank
as the tests build it. ``make test-sglang`` checks these copies against the installed SGLang and runs the
backend against the real classes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from tierstore_sglang.backend import HiCacheBackend

STORAGE_BATCH_SIZE = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE


@dataclass
class HiCacheStorageConfig:
    """sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig (0.5.23 fields)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: str | None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None

    @property
    def is_storage_writer(self) -> bool:
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


def storage_config(extra: dict, *, tp_rank=0, tp_size=1, mla=False, layout="page_first", model="tiny/llama",
                   metrics=False, **more) -> HiCacheStorageConfig:
    """What ``HiCacheController._generate_storage_config`` builds for one rank."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config={"backend_name": "tierstore", "module_path": "tierstore_sglang",
                                              "class_name": "TierstoreHiCacheStorage", "interface_v1": 1,
                                              **extra}, **more)


class HostPool:
    """The token-slot allocator SGLang's ``HostKVCache`` keeps (whole pages, handed out in any order)."""

    page_size: int
    size: int
    dtype: torch.dtype
    layout: str
    kv_buffer: torch.Tensor

    def __init__(self, size: int, page_size: int, layout: str, dtype: torch.dtype):
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        self.page_num = size // page_size
        self.size = self.page_num * page_size
        order = torch.randperm(self.page_num, generator=torch.Generator().manual_seed(7))
        self.free_pages = order.tolist()
        self.kv_buffer = self.init_kv_buffer()

    def init_kv_buffer(self) -> torch.Tensor:
        raise NotImplementedError

    def alloc(self, need_size: int) -> torch.Tensor:
        assert need_size % self.page_size == 0
        n = need_size // self.page_size
        assert n <= len(self.free_pages), "host pool exhausted"
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        slots = [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        return torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> None:
        self.free_pages.extend(int(i) // self.page_size for i in indices[::self.page_size])

    def randomize(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))

    def tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """The KV of ``indices`` in one layout-independent form (for comparisons across pools)."""
        if indices.numel() == 0:
            return torch.empty((0, *self.token(0).shape), dtype=self.dtype)
        return torch.stack([self.token(int(i)) for i in indices])


class MHATokenToKVPoolHost(HostPool):
    """``MHATokenToKVPoolHost``'s buffer and page accessors (layouts as in sglang 0.5.23)."""

    def __init__(self, size: int, page_size: int, layout: str, *, layers: int = 2, heads: int = 2, dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16):
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim
        super().__init__(size, page_size, layout, dtype)

    def init_kv_buffer(self) -> torch.Tensor:
        dims = {"layer_first": (2, self.layer_num, self.size, self.head_num, self.head_dim),
                "page_first": (2, self.size, self.layer_num, self.head_num, self.head_dim),
                "page_first_direct": (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim),
                "page_head": (2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim)}
        if self.layout not in dims:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return torch.zeros(dims[self.layout], dtype=self.dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        elif self.layout in ["page_first_direct", "page_head"]:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")

    def token(self, i: int) -> torch.Tensor:
        """``(2, layers, heads, dim)`` of token slot ``i``."""
        p, o = divmod(i, self.page_size)
        b = self.kv_buffer
        return {"layer_first": lambda: b[:, :, i], "page_first": lambda: b[:, i],
                "page_first_direct": lambda: b[:, p, :, o],
                "page_head": lambda: b[:, p, :, o].transpose(1, 2)}[self.layout]()


class MLATokenToKVPoolHost(HostPool):
    """``MLATokenToKVPoolHost``'s buffer and page accessors (one latent row per token and layer)."""

    def __init__(self, size: int, page_size: int, layout: str, *, layers: int = 2, kv_cache_dim: int = 24,
                 dtype: torch.dtype = torch.bfloat16):
        self.layer_num, self.kv_cache_dim = layers, kv_cache_dim
        super().__init__(size, page_size, layout, dtype)

    def init_kv_buffer(self) -> torch.Tensor:
        dims = {"layer_first": (self.layer_num, self.size, 1, self.kv_cache_dim),
                "page_first": (self.size, self.layer_num, 1, self.kv_cache_dim),
                "page_first_direct": (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)}
        if self.layout not in dims:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return torch.zeros(dims[self.layout], dtype=self.dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + self.page_size, :, :, :]
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))  # what each layout's branch does in SGLang

    def token(self, i: int) -> torch.Tensor:
        p, o = divmod(i, self.page_size)
        b = self.kv_buffer
        return {"layer_first": lambda: b[:, i], "page_first": lambda: b[i],
                "page_first_direct": lambda: b[p, :, o]}[self.layout]()


def page_hashes(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's page keys: SHA-256 chained over each full page's tokens (4-byte little-endian)."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[start:start + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


class Controller:
    """``HiCacheController``'s storage calls for one rank, in its order (zero-copy v1 path).

    ``backup`` is ``write_storage`` + ``_page_backup``; ``prefetch`` is ``_storage_hit_query`` (batches of
    128 via ``batch_exists``, stopping at the first partial batch) followed by ``_page_transfer`` into
    freshly allocated host slots (``batch_get_v1`` per batch, counting the leading pages that arrived).
    """

    def __init__(self, backend, pool: HostPool, *, is_writer: bool = True):
        self.backend, self.pool, self.page_size, self.is_writer = backend, pool, pool.page_size, is_writer
        self.calls: list[tuple[str, int]] = []

    def backup(self, host_indices: torch.Tensor, tokens: list[int]) -> int:
        """Pages written (all pages of each batch, or the batches before the first failure)."""
        if not self.is_writer:  # HiCacheController.backup_skip
            return 0
        hashes = page_hashes(tokens, self.page_size)
        done = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
            self.calls.append(("batch_set_v1", len(batch)))
            if not all(self.backend.batch_set_v1(batch, idx, None)):
                break
            done += len(batch)
        return done

    def hit_query(self, tokens: list[int]) -> list[str]:
        hashes, hit = page_hashes(tokens, self.page_size), []
        for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[start:start + STORAGE_BATCH_SIZE]
            self.calls.append(("batch_exists", len(batch)))
            n = self.backend.batch_exists(batch, None)
            hit.extend(batch[:n])
            if n < len(batch):
                break
        return hit

    def prefetch(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """``(pages loaded, host slots holding them)``; the slots of pages that did not arrive are freed."""
        hashes = self.hit_query(tokens)
        host = self.pool.alloc(len(hashes) * self.page_size)
        loaded = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host[i * self.page_size:(i + len(batch)) * self.page_size]
            self.calls.append(("batch_get_v1", len(batch)))
            results = self.backend.batch_get_v1(batch, idx, None)
            inc = next((j for j, ok in enumerate(results) if not ok), len(batch))
            loaded += inc
            if inc < len(batch):
                break
        self.pool.free(host[loaded * self.page_size:])
        return loaded, host[:loaded * self.page_size]


# ---------------------------------------------------------------- one rank, as the tests build it
PAGE = 4
PROMPT = list(range(1000, 1000 + 10 * PAGE + 3))  # 10 full pages and a partial one (never stored)
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def disk(path, **more) -> dict:
    return {"config": {"tiers": [{"kind": "disk", "path": str(path), "capacity": "64MiB"}]}, **more}


def make_pool(mla: bool, layout: str, seed: int | None = None, page: int = PAGE, size: int = 256):
    pool = (MLATokenToKVPoolHost if mla else MHATokenToKVPoolHost)(size, page, layout)
    if seed is not None:
        pool.randomize(seed)
    return pool


class Instance:
    """One SGLang rank: its backend (built as the dynamic factory does) and its host pool."""

    def __init__(self, extra: dict, *, mla=False, layout="page_first", seed=None, page=PAGE, size=256, **cfg):
        self.pool = make_pool(mla, layout, seed, page, size)
        self.config = storage_config(extra, mla=mla, layout=layout, **cfg)
        self.backend = HiCacheBackend(self.config, {})
        self.backend.register_mem_pool_host(self.pool)
        self.ctl = Controller(self.backend, self.pool, is_writer=self.config.is_storage_writer)

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc) -> None:
        self.backend.close()


def kv_bytes(pool, slots: torch.Tensor) -> torch.Tensor:
    return pool.tokens(slots).view(torch.uint8)
