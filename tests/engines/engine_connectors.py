"""Test-only subclasses of ``TierstoreConnector`` and ``TierstoreTier`` that let the engine tests look inside a
real engine.

They record to the JSONL file named by ``$TIERSTORE_TEST_RECORD`` (each engine process appends).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tierstore_vllm.connector import TierstoreConnector
from tierstore_vllm.tier import TierstoreTier

from tierstore.kv import scatter


def record(**event: Any) -> None:
    path = os.environ.get("TIERSTORE_TEST_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


class RecordingConnector(TierstoreConnector):
    """Records which process holds which role."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        record(role=role.name)


class ZeroingConnector(TierstoreConnector):
    """Overwrites every loaded token's KV with zeros right after the load: the output must change."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        worker = self._worker
        cache, layout = worker._views[layer_name]
        for spec in worker._plan.loads:
            n = spec.end - spec.start
            zeros = torch.zeros(2, n, worker.num_kv_heads, worker.head_size, dtype=cache.dtype)
            scatter(cache, layout, spec.block_ids, zeros, spec.start)
            record(zeroed=layer_name, tokens=n)


class VanishingConnector(TierstoreConnector):
    """Deletes the planned chunks from every tier between the scheduler's lookup and the load."""

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        worker = self._worker
        for spec in self._get_connector_metadata().plan.loads:
            keys = worker.kv(spec.tenant).keys(spec.token_ids)
            deleted = worker.store.delete(keys)
            record(deleted=deleted, req=spec.req_id)
        super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = super().get_block_ids_with_load_errors()
        if failed:
            record(failed_blocks=sorted(failed))
        return failed


class ZeroingTier(TierstoreTier):
    """Zeroes the CPU-tier chunks each load filled before vLLM learns the load is done (so before it copies them
    to the engine's KV cache): the output must change."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loading: dict[int, list[int]] = {}

    def submit_load(self, job_metadata) -> None:
        self._loading[job_metadata.job_id] = [int(c) for c in job_metadata.chunk_ids]
        super().submit_load(job_metadata)

    def get_finished_jobs(self):
        results = list(super().get_finished_jobs())
        for result in results:
            for chunk in self._loading.pop(result.job_id, ()):
                self._chunk(chunk).zero_()
                record(zeroed_chunk=chunk)
        return results
