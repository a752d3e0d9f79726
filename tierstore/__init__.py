"""tierstore: a content-addressed tensor store over device, host, disk and remote tiers.

>>> import tierstore
>>> with tierstore.open() as store:          # host + disk under ~/.cache/tierstore
...     store.put(key, {"k": k, "v": v})
...     store.get(key)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    CorruptObjectError,
    ForgedObjectError,
    ForkedError,
    InvalidInputError,
    InvalidTypeError,
    LockedError,
    MissingKeyError,
    ServerUnavailableError,
    TierstoreError,
    TierTimeoutError,
    UnsupportedObjectError,
    WriteBackError,
)
from .keys import ChunkKey

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from . import weights
    from .api import Store
    from .kv import KVCacheStore, KVNamespace
    from .store import TieredStore, open

__version__ = "0.1.0"

# Heavier parts load on first use so `import tierstore` stays cheap.
_LAZY = {
    "open": "tierstore.store:open",
    "TieredStore": "tierstore.store:TieredStore",
    "Store": "tierstore.api:Store",
    "KVNamespace": "tierstore.kv:KVNamespace",
    "KVCacheStore": "tierstore.kv:KVCacheStore",
    "weights": "tierstore.weights",
}


def __getattr__(name: str) -> object:
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
    "CorruptObjectError", "UnsupportedObjectError", "ForgedObjectError", "MissingKeyError", "CapacityError",
    "LockedError", "ServerUnavailableError",
    "TierTimeoutError", "ClosedError", "ForkedError", "WriteBackError", "open", "Store", "TieredStore", "KVNamespace",
    "KVCacheStore", "weights",
]
