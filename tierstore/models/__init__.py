"""Small reference models used by the KV-cache tests, ``tierstore demo`` and ``tierstore bench kv``."""

from .engine import CachedPrefill, TinyEngine
from .tiny import RECOMPUTE_TOLERANCE, PrefillOutput, TinyConfig, TinyDecoder

__all__ = ["TinyConfig", "TinyDecoder", "PrefillOutput", "RECOMPUTE_TOLERANCE", "TinyEngine", "CachedPrefill"]
