"""Tiers that keep tensors in memory on a torch device (shared by the device and host tiers)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..keys import ChunkKey
from ..tensors import TensorDict, copy_tensors
from .base import Tier


class MemoryTier(Tier):
    """Chunks as tensors on ``device``; a put copies in, a get copies out (callers own results)."""

    def __init__(self, name: str | None = None, capacity: int | None = None, device: str = "cpu",
                 pinned: bool = False):
        super().__init__(name, capacity)
        self.device = torch.device(device)
        self.pinned = pinned and self.device.type == "cpu" and torch.cuda.is_available()
        self._data: dict[ChunkKey, TensorDict] = {}

    def _store(self, key: ChunkKey, payload: Mapping[str, torch.Tensor], size: int) -> None:
        self._data[key] = copy_tensors(payload, self.device, pin_memory=self.pinned)

    def _load(self, key: ChunkKey, size: int, device: str | torch.device, borrow: bool = False) -> TensorDict | None:
        data = self._data.get(key)
        if data is None or borrow:
            return data
        return copy_tensors(data, device)

    def _drop(self, key: ChunkKey) -> None:
        self._data.pop(key, None)

    def _close(self) -> None:
        self._data.clear()
