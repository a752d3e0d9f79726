"""vLLM plugins for tierstore.

* ``tierstore_vllm.TierstoreConnector``: a KV connector (``--kv-transfer-config``).
* ``--load-format tierstore``: a model loader, registered by the ``vllm.general_plugins`` entry point.

Only :mod:`.connector` and :mod:`.loader` import vLLM; the rest runs without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierstoreConnector", "TierstoreModelLoader"]


def __getattr__(name: str) -> Any:
    if name == "TierstoreConnector":
        from .connector import TierstoreConnector

        return TierstoreConnector
    if name == "TierstoreModelLoader":
        from .loader import TierstoreModelLoader

        return TierstoreModelLoader
    raise AttributeError(f"module 'tierstore_vllm' has no attribute {name!r}")
