"""Shared memory between the node server and its clients: sealed ``memfd`` regions.

The server makes each region (its host pool, one staging area per connection) and seals it against
shrinking and growing before any client sees it, so no client can truncate memory the server reads or
writes (a truncated mapping would kill the server with SIGBUS). The pool is also sealed against writes
(``F_SEAL_FUTURE_WRITE``, Linux 5.1+) once the server has mapped it: the server writes through that one
mapping, and no descriptor of the pool — the read-only one clients get, one reopened through
``/proc/self/fd`` with ``O_RDWR`` (its inode is also mode 0400), root's — can be written, mapped writable
(``mprotect`` included), punched or truncated. A client can read chunks out of it but never write into anyone's
data. Clients check these seals (:func:`check_sealed`) before they map a region.

A server with ``trusted_writers`` (docs/serve.md) makes its pool *writable*: sealed against shrinking and growing
only, mode 0600, handed to its clients read-write, so that a client can gather a save straight into pool runs the
server reserved for it (:mod:`.lending`). Any client of such a server can then write any chunk in the pool.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import warnings

import torch

from ..errors import InvalidInputError

#: refuses ``write``/``mmap(PROT_WRITE)``/hole punching on every descriptor; mappings made before it stay writable
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
#: a staging area's seals (its connection writes puts into it)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: the pool's seals
POOL_SEALS = SEALS | F_SEAL_FUTURE_WRITE


def create(name: str, size: int) -> int:
    """A new sealed memfd of ``size`` bytes (zero-filled, close-on-exec), writable by whoever holds it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_pool(name: str, size: int, writable: bool = False) -> tuple[int, torch.Tensor]:
    """A new memfd of ``size`` bytes and the one writable mapping of it there will ever be (the caller's);
    sealed with :data:`POOL_SEALS` after that mapping is made. ``writable`` (a server with trusted writers):
    sealed with :data:`SEALS` only, mode 0600 — other processes given its descriptor may map it writable."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        buffer = map_bytes(fd, size)
        os.fchmod(fd, 0o600 if writable else 0o400)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS if writable else POOL_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, buffer


def check_sealed(fd: int, size: int, seals: int = SEALS) -> None:
    """Refuse a region that lacks ``seals`` (one that could shrink under us, or a pool another process could
    write) or is smaller than ``size``."""
    try:
        have = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidInputError("shared region is not a sealable memfd") from None
    if have & seals != seals:
        raise InvalidInputError(f"shared region is sealed {have:#x}, not {seals:#x}")
    if os.fstat(fd).st_size < size:
        raise InvalidInputError(f"shared region holds {os.fstat(fd).st_size} bytes, expected {size}")


def read_only(fd: int) -> int:
    """A second, read-only descriptor of the memfd ``fd`` (mapping it writable is refused by the kernel)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def map_bytes(fd: int, size: int, writable: bool = True) -> torch.Tensor:
    """``size`` bytes of ``fd`` mapped shared, as a flat uint8 tensor (the mapping lives as long as it)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that writes would fault; we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=torch.uint8)


#: cudaHostRegisterReadOnly: the mapping is read-only (the client's view of the pool)
_REGISTER_READ_ONLY = 8


#: addresses registered by :func:`register_for_dma` and not yet unregistered
_registered: set[int] = set()
_registered_lock = threading.Lock()


def register_for_dma(t: torch.Tensor, read_only: bool) -> bool:
    """Page-lock ``t``'s memory for CUDA (copies between it and a GPU are then DMA); whether it was done.
    Undo it with :func:`unregister_for_dma` before the mapping may go."""
    if t.numel() == 0 or not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), _REGISTER_READ_ONLY if read_only else 0)
    if int(rc) != 0:
        _forget_cuda_error()
        return False
    with _registered_lock:
        _registered.add(t.data_ptr())
    return True


def unregister_for_dma(t: torch.Tensor) -> None:
    """Undo :func:`register_for_dma` (a no-op for memory it did not register). The driver keeps a registration
    past ``munmap``: a later mapping at the same address could then not be registered, and copies from it could
    read the old pages. Views of ``t`` stay valid (copies from them are then staged)."""
    with _registered_lock:
        if t.data_ptr() not in _registered:
            return
        _registered.discard(t.data_ptr())
    torch.cuda.synchronize()  # no copy out of these pages is still queued
    if int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) != 0:
        _forget_cuda_error()


def _forget_cuda_error() -> None:
    """A failed CUDA runtime call leaves the thread's "last error" set, and torch raises it at the next kernel
    launch, in whatever code happens to launch one; torch exposes no ``cudaGetLastError``, so a throwaway launch
    takes it."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")
