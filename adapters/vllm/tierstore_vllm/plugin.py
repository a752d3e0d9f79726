"""vLLM general plugin: vLLM calls :func:`register` in every process (scheduler and workers)."""

from __future__ import annotations


def register() -> None:
    """Register the ``tierstore`` load format with vLLM's model loader registry."""
    from . import loader  # noqa: F401  (its decorator registers the format)
