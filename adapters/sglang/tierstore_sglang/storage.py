"""``TierstoreHiCacheStorage``: SGLang's ``HiCacheStorage`` on top of :class:`.backend.HiCacheBackend`.

Enable it with ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name":"tierstore","module_path":"tierstore_sglang",
"class_name":"TierstoreHiCacheStorage","interface_v1":1, ...}'`` (see ``adapters/sglang/README.md``).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .backend import HiCacheBackend


class TierstoreHiCacheStorage(HiCacheBackend, HiCacheStorage):
    """SGLang HiCache L3 storage backend over tierstore (every method is :class:`HiCacheBackend`'s).

    With ``"interface_v1": 1`` SGLang's cache controller calls ``batch_exists`` then ``batch_get_v1``
    (prefetch) and ``batch_set_v1`` (backup), which read and write the host pool's pages in place;
    without it, the flat-page ``batch_get`` / ``batch_set``. The multi-pool v2 calls (Mamba, SWA, DSA
    sidecar pools) are not implemented: SGLang's base class raises ``NotImplementedError`` for them.
    """

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the calls since the last report (``enable_storage_metrics``)."""
        if not self.enable_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        prefetch, backup = self.take_metrics()
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(p for p, _ in prefetch)
        metrics.prefetch_bandwidth.extend(b for _, b in prefetch)
        metrics.backup_pgs.extend(p for p, _ in backup)
        metrics.backup_bandwidth.extend(b for _, b in backup)
        return metrics
