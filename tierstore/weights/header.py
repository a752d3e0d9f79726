"""safetensors headers: parse and fully validate before a single data byte is read.

A safetensors file is ``u64 N`` (little-endian) + ``N`` bytes of UTF-8 JSON + the data region. The JSON
maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data
region) plus an optional ``"__metadata__": {str: str}``.

:func:`parse_header` trusts nothing: the header length is capped, the JSON must be an object without
duplicate keys, every dtype must be known, shapes must be lists of non-negative ints, each tensor's span
must equal ``prod(shape) * itemsize``, and the spans must tile the data region exactly (start at 0, no
gap, no overlap, end at the file's end). Any violation raises :class:`CheckpointError` naming the file
and, where there is one, the tensor — so a loader never reads out of bounds or returns a partial dict.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TierstoreError
from ..tensors import shape_is_valid

MAX_HEADER_SIZE = 100 * 1000 * 1000  # the reference implementation's anti-DoS cap
PREFIX_SIZE = 8


class CheckpointError(TierstoreError, ValueError):
    """A checkpoint is malformed: truncated, lying header, bad offsets, unknown dtype, missing shard.

    Attributes:
        file: the file (path or URL) at fault.
        tensor: the tensor at fault, or ``None`` when the fault is not about one tensor.
    """

    def __init__(self, file: str, message: str, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = f"{file}: tensor {tensor!r}: " if tensor is not None else f"{file}: "
        super().__init__(where + message)


def _dtype_table() -> dict[str, tuple[torch.dtype, int]]:
    table = {
        "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
        "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
        "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
        "C64": (torch.complex64, 8),
    }
    optional = {
        "F8_E4M3": ("float8_e4m3fn", 1), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
        "F8_E5M2": ("float8_e5m2", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
        "F8_E8M0": ("float8_e8m0fnu", 1),
        "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2),
    }
    for code, (attr, size) in optional.items():
        if hasattr(torch, attr):
            table[code] = (getattr(torch, attr), size)
    return table


DTYPES: dict[str, tuple[torch.dtype, int]] = _dtype_table()
"""safetensors dtype code -> (torch dtype, item size in bytes)."""
DTYPE_CODES: dict[torch.dtype, str] = {dt: code for code, (dt, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a shard; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    """A validated shard header: tensors in file order, covering ``[data_start, file_size)`` exactly."""

    file: str
    file_size: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] = field(default_factory=dict)

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def header_length(file: str, prefix: bytes, file_size: int, max_header_size: int = MAX_HEADER_SIZE) -> int:
    """Validate the 8-byte prefix and return the JSON header length ``N``.

    Raises:
        CheckpointError: the file is shorter than its prefix, or ``N`` exceeds the cap or the file.
    """
    if file_size < PREFIX_SIZE or len(prefix) < PREFIX_SIZE:
        raise CheckpointError(file, f"truncated: {file_size} bytes is shorter than the 8-byte header prefix")
    (n,) = struct.unpack("<Q", bytes(prefix[:PREFIX_SIZE]))
    if n > max_header_size or PREFIX_SIZE + n > file_size:
        head = bytes(prefix[:4])
        if head == b"PK\x03\x04" or (head[:1] == b"\x80" and 2 <= head[1] <= 5):
            raise CheckpointError(file, "not a safetensors file: it starts like a zip or pickle archive "
                                        "(torch.save's .pt/.bin); convert it with safetensors.torch.save_file")
    if n > max_header_size:
        raise CheckpointError(file, f"header length {n} exceeds the cap of {max_header_size} bytes")
    if n < 2:
        raise CheckpointError(file, f"header length {n} is too small for a JSON object")
    if PREFIX_SIZE + n > file_size:
        raise CheckpointError(file, f"truncated: header length {n} runs past the end of the "
                                    f"{file_size}-byte file")
    return int(n)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(file: str, header_bytes: bytes, file_size: int) -> ShardHeader:
    """Parse ``header_bytes`` (the ``N`` JSON bytes after the prefix) of a ``file_size``-byte file.

    Raises:
        CheckpointError: on any malformed field, naming ``file`` and the tensor concerned.
    """
    data_start = PREFIX_SIZE + len(header_bytes)
    try:
        text = bytes(header_bytes).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(file, f"header is not UTF-8: {exc}") from None
    if not text.startswith("{"):
        raise CheckpointError(file, "header does not start with '{' (not a safetensors file?)")
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # also over-long integers and deep nesting
        raise CheckpointError(file, f"header is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(file, "header is not a JSON object")
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise CheckpointError(file, "__metadata__ must map str to str")
    infos = [_tensor_info(file, name, entry, data_start) for name, entry in raw.items()]
    infos.sort(key=lambda t: (t.start, t.end))
    expected = data_start
    for t in infos:
        if t.start != expected:
            what = "overlaps the previous tensor" if t.start < expected else "leaves a gap before it"
            raise CheckpointError(file, f"data_offsets [{t.start - data_start}, {t.end - data_start}] "
                                        f"{what} (expected begin {expected - data_start})", t.name)
        expected = t.end
    if expected > file_size:
        last = infos[-1].name if infos else None
        raise CheckpointError(file, f"truncated: data ends at byte {expected} but the file has "
                                    f"{file_size} bytes", last)
    if expected != file_size:
        raise CheckpointError(file, f"{file_size - expected} trailing bytes after the last tensor")
    return ShardHeader(file, file_size, data_start, tuple(infos), dict(metadata))


def _tensor_info(file: str, name: object, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(name, str) or not name:
        raise CheckpointError(file, f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(entry, dict):
        raise CheckpointError(file, "entry is not a JSON object", name)
    extra = set(entry) - {"dtype", "shape", "data_offsets"}
    if extra:
        raise CheckpointError(file, f"unexpected fields {sorted(extra)}", name)
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(file, f"unknown dtype {code!r} (known: {', '.join(sorted(DTYPES))})", name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(file, f"shape must be a list of non-negative ints, got {shape!r}", name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(file, f"data_offsets must be [begin, end] with 0 <= begin <= end, "
                                    f"got {offsets!r}", name)
    dtype, itemsize = DTYPES[code]
    if not shape_is_valid(shape, dtype):
        raise CheckpointError(file, f"shape {shape} overflows torch's 64-bit sizes", name)
    need = math.prod(shape) * itemsize
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(file, f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                                    f"shape {shape} x {code} needs {need}", name)
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint path, or a shard its index names, does not exist."""


def build_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]],
                 metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte prefix + JSON header for ``(name, dtype, shape, nbytes)`` laid out in the given order.

    The JSON is space-padded so the data region starts 8-byte aligned, as the reference writer does.
    Deterministic: the same tensors in the same order give the same bytes.
    """
    entries: dict[str, Any] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        entries[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(PREFIX_SIZE + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text
