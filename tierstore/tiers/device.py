"""The ``device`` tier: chunks resident on an accelerator (``cuda:N``); ``cpu`` works for tests."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .memory import MemoryTier


class DeviceTier(MemoryTier):
    kind = "device"

    def __init__(self, name: str | None = None, capacity: int | None = None, device: str = "cuda:0"):
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {device!r} requested but CUDA is not available (use device: cpu)")
        super().__init__(name, capacity, device=device)
