"""The chunk object format: one self-describing, checksummed object per chunk.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"TIERSTOR"
    8       4     format version (1)
    12      4     header length H (JSON, space-padded so the payload starts 64-byte aligned)
    16      16    xxh3-128 checksum of header bytes followed by the stored payload bytes
    32      H     header: UTF-8 JSON object
    32+H    S     payload: the tensors' raw bytes (codec "none") or one zstd frame of them

Header fields: ``key`` (64 hex chars, must equal the key asked for), ``codec`` (``none``|``zstd``),
``raw_size`` (payload bytes before compression), ``stored_size`` (S), ``tensors``: a list of
``{"name", "dtype", "shape", "offset", "nbytes"}`` with offsets into the raw payload, 64-byte aligned,
ascending and non-overlapping, and ``nbytes == prod(shape) * itemsize``.

The parser trusts nothing: the header is capped at 8 MiB, every field is type-checked, dtypes come from a
fixed table, offsets are bounds-checked before any allocation, zstd output is capped at ``raw_size`` and
the checksum covers header and payload. Any failure raises :class:`CorruptObjectError`. No pickle.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash
import zstandard

from .errors import CorruptObjectError, InvalidInputError
from .keys import ChunkKey
from .tensors import DTYPES, TensorDict, byte_view, dtype_name, validate_tensors

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"TIERSTOR"
VERSION = 1
PREFIX = struct.Struct("<8sII16s")
PREFIX_SIZE = PREFIX.size  # 32
ALIGN = 64
MAX_HEADER = 8 << 20
MAX_RAW = 1 << 40
CODECS = ("none", "zstd")
MAX_DIMS = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    key: ChunkKey
    codec: str
    raw_size: int
    stored_size: int
    tensors: tuple[TensorSpec, ...]
    payload_offset: int  # where the payload starts in the object

    @property
    def object_size(self) -> int:
        return self.payload_offset + self.stored_size


@dataclass
class Encoded:
    """An encoded object as a list of buffers to write in order (no concatenation needed)."""

    parts: list[bytes | memoryview]
    size: int

    def tobytes(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts)


def encode(key: ChunkKey, tensors: Mapping[str, torch.Tensor], codec: str = "none",
           level: int = 3) -> Encoded:
    """Encode ``tensors`` under ``key``. Non-contiguous and device tensors are copied to CPU first."""
    validate_tensors(tensors)
    if codec not in CODECS:
        raise InvalidInputError(f"unknown codec {codec!r}; expected one of {CODECS}")
    specs, views, offset = [], [], 0
    for name, t in tensors.items():
        v = byte_view(t)
        offset = _align(offset)
        specs.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                      "offset": offset, "nbytes": v.numel()})
        views.append((offset, v))
        offset += v.numel()
    raw_size = offset
    payload: list[bytes | memoryview] = []
    pos = 0
    for off, v in views:
        if off > pos:
            payload.append(bytes(off - pos))
        if v.numel():
            payload.append(v.numpy().data)
        pos = off + v.numel()
    if codec == "zstd":
        payload = [zstandard.ZstdCompressor(level=level).compress(b"".join(payload))]
    stored_size = sum(len(p) for p in payload)
    header = {"key": key.hex(), "codec": codec, "raw_size": raw_size, "stored_size": stored_size,
              "tensors": specs}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (_align(PREFIX_SIZE + len(hbytes)) - PREFIX_SIZE - len(hbytes))
    h = xxhash.xxh3_128(hbytes)
    for p in payload:
        h.update(p)
    prefix = PREFIX.pack(MAGIC, VERSION, len(hbytes), h.digest())
    return Encoded([prefix + hbytes, *payload], PREFIX_SIZE + len(hbytes) + stored_size)


def parse_header(buf: Buffer, expected_key: ChunkKey | None = None, object_size: int | None = None) -> Header:
    """Validate and parse the prefix and header at the start of ``buf`` (bytes-like).

    ``object_size``, when known (a file size), is checked against the header. The checksum is not
    verified here; :func:`decode` does that.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < PREFIX_SIZE:
        raise CorruptObjectError(f"object of {len(mv)} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, hlen, _ = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptObjectError("bad magic: not a tierstore object")
    if version != VERSION:
        raise CorruptObjectError(f"unsupported format version {version}")
    if hlen > MAX_HEADER or PREFIX_SIZE + hlen > len(mv):
        raise CorruptObjectError(f"header length {hlen} exceeds the cap or the object")
    try:
        raw = json.loads(bytes(mv[PREFIX_SIZE:PREFIX_SIZE + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptObjectError(f"header is not valid JSON: {exc}") from None
    hdr = _validate_header(raw, PREFIX_SIZE + hlen)
    if expected_key is not None and hdr.key != expected_key:
        raise CorruptObjectError(f"object holds key {hdr.key.hex()}, expected {expected_key.hex()}")
    if object_size is not None and object_size != hdr.object_size:
        raise CorruptObjectError(f"object is {object_size} bytes, header says {hdr.object_size}")
    return hdr


def _int(raw: dict[str, Any], field: str, hi: int = MAX_RAW) -> int:
    v = raw.get(field)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise CorruptObjectError(f"header field {field!r} is not an integer in [0, {hi}]: {v!r}")
    return v


def _validate_header(raw: object, payload_offset: int) -> Header:
    if not isinstance(raw, dict):
        raise CorruptObjectError("header is not a JSON object")
    try:
        key = ChunkKey.from_hex(raw.get("key"))  # type: ignore[arg-type]  # from_hex rejects a non-str itself
    except (ValueError, TypeError):
        raise CorruptObjectError(f"header key is invalid: {raw.get('key')!r}") from None
    codec = raw.get("codec")
    if codec not in CODECS:
        raise CorruptObjectError(f"unknown codec {codec!r}")
    raw_size, stored_size = _int(raw, "raw_size"), _int(raw, "stored_size")
    if codec == "none" and stored_size != raw_size:
        raise CorruptObjectError("stored_size differs from raw_size without compression")
    items = raw.get("tensors")
    if not isinstance(items, list) or not items:
        raise CorruptObjectError("header has no tensor list")
    specs, names, end = [], set(), 0
    for item in items:
        if not isinstance(item, dict):
            raise CorruptObjectError("tensor entry is not an object")
        name, dname, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if not isinstance(name, str) or not name or name in names:
            raise CorruptObjectError(f"tensor name missing or duplicated: {name!r}")
        if dname not in DTYPES:
            raise CorruptObjectError(f"tensor {name!r} has unknown dtype {dname!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_RAW for d in shape)):
            raise CorruptObjectError(f"tensor {name!r} has an invalid shape {shape!r}")
        dtype = DTYPES[dname]
        offset, nb = _int(item, "offset"), _int(item, "nbytes")
        if nb != math.prod(shape) * dtype.itemsize:
            raise CorruptObjectError(f"tensor {name!r}: nbytes {nb} != numel x itemsize")
        if offset % ALIGN or offset < end or offset + nb > raw_size:
            raise CorruptObjectError(f"tensor {name!r}: offset {offset} misaligned, overlapping or out of range")
        end = offset + nb
        names.add(name)
        specs.append(TensorSpec(name, dtype, tuple(shape), offset, nb))
    return Header(key, codec, raw_size, stored_size, tuple(specs), payload_offset)


def verify(buf: Buffer, hdr: Header) -> None:
    """Check the object's checksum; raise :class:`CorruptObjectError` on mismatch."""
    mv = memoryview(buf).cast("B")
    if len(mv) != hdr.object_size:
        raise CorruptObjectError(f"object is {len(mv)} bytes, header says {hdr.object_size}")
    h = xxhash.xxh3_128(mv[PREFIX_SIZE:hdr.payload_offset])
    h.update(mv[hdr.payload_offset:])
    if h.digest() != bytes(mv[16:32]):
        raise CorruptObjectError(f"checksum mismatch for {hdr.key.hex()}")


def decode(buf: torch.Tensor | bytes | bytearray | memoryview, expected_key: ChunkKey | None = None) -> TensorDict:
    """Validate a whole object and return its tensors.

    With an uncompressed object in a writable uint8 CPU tensor, the tensors are views over ``buf``
    (no copy); otherwise the payload is decompressed or copied into one fresh buffer.
    """
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
            raise InvalidInputError("decode takes a flat uint8 CPU tensor")
        mv = buf.numpy().data
    else:
        mv = memoryview(buf).cast("B")
    hdr = parse_header(mv, expected_key, object_size=len(mv))
    verify(mv, hdr)
    if hdr.codec == "zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(mv[hdr.payload_offset:], max_output_size=hdr.raw_size)
        except zstandard.ZstdError as exc:
            raise CorruptObjectError(f"zstd payload does not decompress: {exc}") from None
        if len(raw) != hdr.raw_size:
            raise CorruptObjectError("decompressed payload has the wrong size")
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    elif isinstance(buf, torch.Tensor):
        payload = buf[hdr.payload_offset:]
    else:
        payload = torch.empty(hdr.raw_size, dtype=torch.uint8)
        if hdr.raw_size:
            payload.numpy().data[:] = mv[hdr.payload_offset:]
    return tensors_from_payload(payload, hdr)


def tensors_from_payload(payload: torch.Tensor, hdr: Header) -> TensorDict:
    """Views of each tensor over the raw ``payload`` (a flat uint8 tensor)."""
    out = {}
    for s in hdr.tensors:
        flat = payload[s.offset:s.offset + s.nbytes]
        if s.dtype != torch.uint8:
            flat = flat.view(s.dtype)
        out[s.name] = flat.reshape(s.shape)
    return out
