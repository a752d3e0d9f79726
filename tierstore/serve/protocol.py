"""The node server's wire protocol: length-prefixed JSON frames over a Unix stream socket (no pickle).

A frame is a 4-byte little-endian length and that many bytes of UTF-8 JSON: an object whose ``op`` names
the message. Every request gets exactly one reply — ``{"ok": true, ...}`` or ``{"ok": false, "error":
NAME, "message": TEXT}`` — except ``release``, which has none (a client sends it and goes on). The first
request of a connection is ``hello`` with :data:`VERSION`; its reply carries two descriptors by
SCM_RIGHTS: the server's host pool (read-only) and this connection's staging area (see :mod:`.shm`).
Tensor bytes never cross the socket: a reply names where they lie, as :func:`spec` lists.

Requests added after protocol 2's first form are named in the hello reply's ``features`` (:data:`FEATURES`): a
client asks a server for one only if it lists it, and does without it otherwise (a server from before it has
no list), so clients and servers of either age work together. ``lend``: the pool's chunks alone, leased, with
their stamps and tensor lists — nothing read from a lower tier (a KV load scatters straight from the pool).
``reserve`` (with ``commit`` and ``abort``), only from a server with ``trusted_writers``: pool runs reserved for
a put that the client fills itself (:mod:`.reserving`); such a server hands out its pool read-write.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import TierstoreError
from ..keys import DIGEST_SIZE, ChunkKey
from ..tensors import DTYPES, dtype_name, shape_is_valid

VERSION = 2
#: requests beyond protocol 2's first form that this side speaks (see the module docstring)
FEATURES = ("lend",)
#: largest frame either side accepts (a request of MAX_KEYS keys with their tensor specs fits)
MAX_FRAME = 4 << 20
#: most keys one request may name (clients split larger batches)
MAX_KEYS = 4096
#: most tensors per chunk, most dims per tensor, longest tensor name
MAX_TENSORS, MAX_DIMS, MAX_NAME = 256, 16, 256
#: alignment of every tensor placed in a shared region
ALIGN = 64
_HEADER = struct.Struct("<I")


class ProtocolError(TierstoreError, ValueError):
    """A frame or message that breaks the protocol (too large, not JSON, a field of the wrong type)."""


def encode(msg: Mapping[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), default=str).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes is over the {MAX_FRAME}-byte frame limit")
    return _HEADER.pack(len(body)) + body


class FrameTooLarge(ProtocolError):
    """The length prefix is over :data:`MAX_FRAME`: the connection is closed after the error reply."""


def decode(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("frame nests too deep") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message is a JSON object")
    return msg


class Reader:
    """The frames of one stream socket, taken in with as few ``recv`` calls as they arrive in (a frame that
    came whole costs one)."""

    def __init__(self, sock: socket.socket, first: bytes = b""):
        self.sock = sock
        self._buf = bytearray(first)

    def frame(self) -> dict[str, Any]:
        """The next message. Raises ``ConnectionError`` at end of stream, :class:`FrameTooLarge` for a frame
        over :data:`MAX_FRAME` (the stream cannot be trusted after it), :class:`ProtocolError` for one that is
        not a JSON object."""
        buf = self._buf
        while True:
            if len(buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(buf)
                if n > MAX_FRAME:
                    raise FrameTooLarge(f"frame of {n} bytes is over the {MAX_FRAME}-byte limit")
                end = _HEADER.size + n
                if len(buf) >= end:
                    body = bytes(buf[_HEADER.size:end])
                    del buf[:end]
                    return decode(body)
                want = end - len(buf)
            else:
                want = _HEADER.size
            got = self.sock.recv(max(want, 1 << 16))
            if not got:
                raise ConnectionError("connection closed")
            buf += got

    def request(self) -> dict[str, Any]:
        """The next request: a frame whose object names its ``op``."""
        msg = self.frame()
        if not isinstance(msg.get("op"), str):
            raise ProtocolError("a request is a JSON object with a string 'op'")
        return msg


def set_timeouts(sock: socket.socket, send: float | None, receive: float | None = None) -> None:
    """Kernel-side timeouts (``SO_SNDTIMEO``/``SO_RCVTIMEO``) on a blocking socket: no ``poll`` per call, as
    Python's own socket timeouts need; a call past its timeout raises ``OSError`` (``EAGAIN``)."""
    sock.settimeout(None)
    for opt, seconds in ((socket.SO_SNDTIMEO, send), (socket.SO_RCVTIMEO, receive)):
        if seconds is not None:
            sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:1000]}


# ---------------------------------------------------------------------- fields
def field(msg: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in msg or msg[name] is None:
        if default is ...:
            raise ProtocolError(f"{msg.get('op')}: missing field {name!r}")
        return default
    value = msg[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise ProtocolError(f"{msg.get('op')}: field {name!r} has the wrong type")
    return value


def keys_field(msg: Mapping[str, Any], name: str = "keys") -> list[ChunkKey]:
    """Keys on the wire: one hex string of their digests back to back (one parse for a whole batch)."""
    value = field(msg, name, str)
    width = 2 * DIGEST_SIZE
    if len(value) % width or len(value) > MAX_KEYS * width:
        raise ProtocolError(f"{msg.get('op')}: {name} must be up to {MAX_KEYS} digests of {width} hex digits")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{msg.get('op')}: {name} is not hex") from None
    return [ChunkKey(raw[i:i + DIGEST_SIZE]) for i in range(0, len(raw), DIGEST_SIZE)]


def hexes(keys: Sequence[ChunkKey]) -> str:
    return "".join([k.hex() for k in keys])


# ---------------------------------------------------------------------- tensors in shared regions
Spec = tuple[str, torch.dtype, tuple[int, ...], int]  # name, dtype, shape, byte offset in a region


def spec(tensors: Mapping[str, torch.Tensor], offsets: Sequence[int]) -> list[list[Any]]:
    """The wire form of ``tensors`` placed at ``offsets`` of a shared region."""
    return [[name, dtype_name(t.dtype), list(t.shape), off]
            for (name, t), off in zip(tensors.items(), offsets, strict=True)]


def parse_spec(value: Any, region_size: int) -> list[Spec]:
    """Validate one chunk's tensor list against a region of ``region_size`` bytes: every tensor a known dtype,
    a valid shape, aligned and wholly inside the region."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TENSORS:
        raise ProtocolError(f"a chunk is a list of 1..{MAX_TENSORS} tensors")
    out: list[Spec] = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError("a tensor is [name, dtype, shape, offset]")
        name, dt, shape, off = item
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ProtocolError("a tensor name is a non-empty string")
        if dt not in DTYPES:
            raise ProtocolError(f"unknown dtype {dt!r}")
        dtype = DTYPES[dt]
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and d >= 0 for d in shape) or not shape_is_valid(shape, dtype)):
            raise ProtocolError(f"bad shape for tensor {name!r}")
        n = nbytes_of(dtype, shape)
        if type(off) is not int or off < 0 or off % ALIGN or off + n > region_size:
            raise ProtocolError(f"tensor {name!r} does not lie inside the shared region")
        out.append((name, dtype, tuple(shape), off))
    if len({s[0] for s in out}) != len(out):
        raise ProtocolError("tensor names repeat")
    return out


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def views(region: torch.Tensor, specs: Sequence[Spec]) -> dict[str, torch.Tensor]:
    """Tensors over ``region`` (a flat uint8 tensor) as ``specs`` place them (no copy)."""
    out = {}
    for name, dtype, shape, off in specs:
        raw = region[off:off + nbytes_of(dtype, shape)]
        out[name] = (raw.view(dtype) if dtype != torch.uint8 else raw).reshape(shape)
    return out


def place(sizes: Sequence[int], start: int = 0) -> tuple[list[int], int]:
    """Aligned offsets for blocks of ``sizes`` bytes laid out one after another from ``start``; and the end."""
    offsets, pos = [], start
    for n in sizes:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += n
    return offsets, pos
