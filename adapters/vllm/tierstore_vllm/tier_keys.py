"""What names a chunk of vLLM's CPU tier in tierstore: a :class:`tierstore.KVNamespace` built from vLLM's
offloading config, and one key per vLLM offload key.

vLLM's offload key is a block hash (chained over the whole prefix, ``cache_salt`` included) plus the KV cache
group index; it says nothing of the model or the layout. The namespace adds everything that makes the bytes of
a chunk differ — model, revision, KV dtype, tokens per block and blocks per chunk, the parallel layout (TP,
PP, PCP, DCP sizes), each KV group's layers, the bytes per block, vLLM's KV layout options — and a tenant
salt, so engines that must not share never do and engines that may share always derive the same keys.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tierstore.errors import ConfigError
from tierstore.keys import ChunkKey
from tierstore.kv import KVNamespace
from tierstore.tensors import DTYPES

from .tier_options import TierOptions

#: vLLM's ``--kv-cache-dtype`` names that are not torch dtype names
_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                 "fp8_inc": "float8_e4m3fn"}


class TierKeys:
    """Keys of one engine's chunks, ``key(offload_key) = H(namespace ‖ offload_key)``, and how many bytes of
    each CPU-tier chunk hold KV (``payload_bytes``: the rest of a row is alignment padding)."""

    def __init__(self, namespace: KVNamespace, payload_bytes: int) -> None:
        self.namespace = namespace
        self.payload_bytes = payload_bytes
        self._ns = namespace.to_bytes()

    def key(self, offload_key: bytes) -> ChunkKey:
        return ChunkKey.chain(None, self._ns, offload_key)


def tier_keys(spec: Any, options: TierOptions, row_bytes: int) -> TierKeys:
    """The keys of the engine whose offloading spec is ``spec`` (vLLM's ``TieringOffloadingSpec``), its CPU
    tier's chunks ``row_bytes`` apart. Raises :class:`tierstore.ConfigError` naming what cannot be keyed."""
    config = spec.config
    dtype = _CACHE_DTYPES.get(config.model.dtype, config.model.dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"TierstoreTier cannot key KV cache dtype {config.model.dtype!r} (offloading "
                          f"config model.dtype); known: {sorted(DTYPES)}")
    if not config.groups:
        raise ConfigError("TierstoreTier cannot key an engine with no KV cache groups (offloading config groups)")
    par = config.parallel
    layout = {
        "groups": [{"id": g.group_id, "tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
                   for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "world_size": par.world_size, "pcp": par.pcp_size, "dcp": par.dcp_size,
        "replicated": bool(config.replicated_layout), "canonical": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
    }
    digest = hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).hexdigest()
    chunk_tokens = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
    revision = options.revision if options.revision is not None else _vllm_revision()
    namespace = KVNamespace(model=options.model_id or config.model.name, revision=revision, dtype=dtype,
                            layout=f"mha:vllm-tier:{digest}", tp_rank=0, tp_size=par.tp_size, pp_rank=0,
                            pp_size=par.pp_size, chunk_tokens=chunk_tokens, tenant=options.tenant)
    return TierKeys(namespace, payload_bytes(spec, row_bytes))


def payload_bytes(spec: Any, row_bytes: int) -> int:
    """Bytes of a CPU-tier chunk that hold KV: every worker's page, without the row's alignment padding."""
    copies = 1 if getattr(spec, "replicated_layout", False) else spec.config.parallel.world_size
    page = int(getattr(spec, "cpu_page_size_per_worker", 0)) * copies
    return page if 0 < page <= row_bytes else row_bytes


def _vllm_revision() -> str:
    """The served model's revision from vLLM's current config ("" when there is none)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()  # None outside an engine (component tests)
    model = vllm_config.model_config if vllm_config is not None else None
    return str(getattr(model, "revision", None) or "")
