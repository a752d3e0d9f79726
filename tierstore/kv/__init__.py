"""KV caches in the store: namespaces, prefix-chained chunk keys, paged-layout gather/scatter.

>>> ns = tierstore.KVNamespace(model="Qwen/Qwen3-8B", dtype="bfloat16")
>>> kv = tierstore.KVCacheStore(store, ns, chunk_tokens=256)
>>> kv.save(tokens, layers)                  # one (2, n_tokens, kv_heads, head_dim) tensor per layer
>>> kv.load(tokens)                          # in another process: the leading cached tokens' KV
>>> kv.load_into(tokens, kv_caches, "vllm", block_ids)   # straight into a paged cache (layerwise=True)
"""

from .namespace import KV_FORMAT_VERSION, KVNamespace, prefix_keys, token_tensor
from .paged import PagedLayout, gather, gather_layers, scatter, scatter_layers
from .store import KVCacheStore, count_token_hits
from .transfer import LayerwiseLoad

__all__ = ["KVNamespace", "KVCacheStore", "LayerwiseLoad", "KV_FORMAT_VERSION", "PagedLayout", "gather", "scatter",
           "gather_layers", "scatter_layers", "prefix_keys", "token_tensor", "count_token_hits"]
