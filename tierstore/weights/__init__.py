"""Fast safetensors loading from local disk or any fsspec URL, optionally cached in a tierstore store.

>>> import tierstore.weights as tw
>>> state = tw.load("s3://bucket/llama/", storage_options={...}, store=store)   # dict of tensors
>>> for name, t in tw.iter_tensors("/models/llama", device="cuda"): ...         # streamed
>>> tw.load_into(model.state_dict(), "/models/llama")                           # fill in place

Headers and indexes are fully validated before any data is read; reads are large, parallel and ranged;
tensors are views over the landed buffers or are read straight into the caller's parameters. With a
``store``, fetched ranges are cached as content-addressed chunks, so the second load of a remote
checkpoint comes from the store's local tiers. See ``docs/weights.md``.
"""

from __future__ import annotations

from .header import CheckpointError, CheckpointNotFoundError
from .loader import iter_tensors, load, load_into
from .publish import publish

__all__ = ["load", "iter_tensors", "load_into", "publish", "CheckpointError", "CheckpointNotFoundError"]
