"""tierstore: a content-addressed tensor store over device, host, disk and remote tiers.

>>> import tierstore
>>> with tierstore.open() as store:          # host + disk under ~/.cache/tierstore
...     store.put(key, {"k": k, "v": v})
...     store.get(key)
"""

from __future__ import annotations

import importlib

from .errors import (CapacityError, ClosedError, ConfigError, CorruptObjectError, InvalidInputError,
                     InvalidTypeError, LockedError, MissingKeyError, TierstoreError, TierTimeoutError,
                     WriteBackError)
from .keys import ChunkKey

__version__ = "0.1.0"

# Heavier parts load on first use so `import tierstore` stays cheap.
_LAZY = {
    "open": "tierstore.store:open",
    "TieredStore": "tierstore.store:TieredStore",
    "KVNamespace": "tierstore.kv:KVNamespace",
    "KVCacheStore": "tierstore.kv:KVCacheStore",
    "weights": "tierstore.weights",
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'tierstore' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


__all__ = [
    "ChunkKey", "TierstoreError", "ConfigError", "InvalidInputError", "InvalidTypeError",
    "CorruptObjectError", "MissingKeyError", "CapacityError", "LockedError", "TierTimeoutError",
    "ClosedError", "WriteBackError", *_LAZY,
]
