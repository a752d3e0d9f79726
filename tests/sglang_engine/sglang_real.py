"""SGLang's own host KV pools, storage factory and cache-controller methods, built on CPU (no engine:
SGLang's CPU engine needs a CPU build of sgl_kernel that PyPI does not have)."""

from __future__ import annotations

import types
from queue import Queue

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE, LAYERS, TOKENS = 16, 2, 256


def host_pool(mla: bool, layout: str, seed: int | None = None):
    """A real device pool on CPU and the real host pool mirroring it, filled from ``seed``."""
    if mla:
        device = MLATokenToKVPool(TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=8,
                                  layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        host = MLATokenToKVPoolHost(device._mla_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False,
                                    device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
                                    target_layer_num=LAYERS)
    else:
        device = MHATokenToKVPool(TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                  layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        host = MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False,
                                    device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
    return host


def storage_config(extra: dict, *, mla: bool, layout: str, tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=True, is_page_first_layout=layout == "page_first", model_name="tiny/llama",
        extra_config={"backend_name": "tierstore", "module_path": "tierstore_sglang",
                      "class_name": "TierstoreHiCacheStorage", "interface_v1": 1, **extra})


def create_backend(config: HiCacheStorageConfig, host):
    """What ``HiCacheController.attach_storage_backend`` does: the factory's dynamic path, then register."""
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


class Controller:
    """A ``HiCacheController`` reduced to the attributes its storage methods read; the methods are SGLang's
    own (``_page_backup``, ``_storage_hit_query``, ``_page_transfer`` and the zero-copy/generic page I/O)."""

    METHODS = ("_page_backup", "_page_set_zero_copy", "_page_get_zero_copy", "_generic_page_set",
               "_generic_page_get", "_storage_hit_query", "_page_transfer", "_page_transfer_kv_batch")

    def __init__(self, backend, host, *, zero_copy: bool = True):
        self.storage_backend, self.mem_pool_host, self.storage_host_pool = backend, host, host
        self.page_size = host.page_size
        self.prefetch_sync_queue: Queue = Queue()
        for name in self.METHODS:
            setattr(self, name, types.MethodType(getattr(HiCacheController, name), self))
        self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set
        self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get

    def backup(self, host_indices: torch.Tensor, tokens: list[int]) -> int:
        """``write_storage`` + the backup thread: tokens written."""
        tokens = tokens[:len(host_indices)]  # the radix cache hands over whole pages only
        hashes = get_storage_hash_str(tokens, None, page_size=self.page_size)
        op = StorageOperation(host_indices, tokens, hash_value=hashes)
        self._page_backup(op)
        return op.completed_tokens

    def prefetch(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """The prefetch thread's hit query, a host allocation, then the I/O thread: (pages, host slots)."""
        op = PrefetchOperation("req", tokens[:len(tokens) - len(tokens) % self.page_size])
        hashes, _ = self._storage_hit_query(op)
        op.hash_value = hashes
        op.host_indices = self.mem_pool_host.alloc(len(hashes) * self.page_size)
        pages = self._page_transfer(op)
        return pages, op.host_indices[:pages * self.page_size]


def page_bytes(host, slots: torch.Tensor) -> torch.Tensor:
    """The pool pages at ``slots`` (whole pages) as bytes, in the pool's own flat-page form."""
    pages = [host.get_data_page(int(s), flat=True) for s in slots[::host.page_size]]
    return torch.cat(pages).view(torch.uint8)
