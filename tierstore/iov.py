"""Vectored I/O bookkeeping shared by the disk tier and the weight loader."""

from __future__ import annotations

import os

try:  # buffers per readv/writev call; Linux allows 1024
    IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (ValueError, OSError, AttributeError):
    IOV_MAX = 16


def advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Account for ``n`` bytes transferred starting at ``bufs[i]``: skip the buffers they filled, trim a
    partly filled one in place, and return the index of the first buffer still to transfer."""
    while n and i < len(bufs):
        if n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    return i
