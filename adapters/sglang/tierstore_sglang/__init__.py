"""SGLang plugins for tierstore.

* ``tierstore_sglang.TierstoreHiCacheStorage``: a HiCache storage backend (``--hicache-storage-backend
  dynamic``, see ``adapters/sglang/README.md``).
* ``tierstore_sglang.TierstoreModelLoader``: a model loader class for ``load_format`` (Python API).

Only :mod:`.storage` and :mod:`.loader` import SGLang; the rest runs without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierstoreHiCacheStorage", "TierstoreModelLoader"]


def __getattr__(name: str) -> Any:
    if name == "TierstoreHiCacheStorage":
        from .storage import TierstoreHiCacheStorage

        return TierstoreHiCacheStorage
    if name == "TierstoreModelLoader":
        from .loader import TierstoreModelLoader

        return TierstoreModelLoader
    raise AttributeError(f"module 'tierstore_sglang' has no attribute {name!r}")
