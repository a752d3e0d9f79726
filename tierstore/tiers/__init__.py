"""Tier implementations, registered by kind (the ``kind:`` of a config entry)."""

from __future__ import annotations

import importlib

from .base import Tier

_KINDS = {
    "device": "tierstore.tiers.device:DeviceTier",
    "host": "tierstore.tiers.host:HostTier",
    "disk": "tierstore.tiers.disk:DiskTier",
    "remote": "tierstore.tiers.remote:RemoteTier",
}


def tier_class(kind: str) -> type[Tier]:
    """The class registered for ``kind`` (imported lazily so s3fs is only needed for remote)."""
    module, _, attr = _KINDS[kind].partition(":")
    cls: type[Tier] = getattr(importlib.import_module(module), attr)
    return cls


__all__ = ["Tier", "tier_class"]
