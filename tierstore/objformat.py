"""The chunk object format: one self-describing, checksummed object per chunk.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"TIERSTOR"
    8       4     format version (1)
    12      4     header length H (JSON, space-padded so the payload starts 64-byte aligned, or block
                  aligned in objects written for direct I/O: readers take any padding)
    16      16    xxh3-128 checksum of header bytes followed by the stored payload bytes
    32      H     header: UTF-8 JSON object
    32+H    S     payload: the tensors' raw bytes (codec "none") or one zstd frame of them

A **sealed** object (format version 2, written to shared tiers that have keys: :mod:`tierstore.sealing`)
has the same layout; its header region ends with a 32-byte MAC tag (after the JSON's padding, so the
payload stays aligned) and its JSON has ``"seal": {"alg": "blake3", "kid": <key id>}``; an encrypted one
adds ``"enc": {"alg": "aes-256-gcm", "iv": <64 hex>, "tag": <32 hex>}`` to the seal, its payload being
the ciphertext (same length). Version-1 readers skip it as unsupported, without deleting it.

Header fields: ``key`` (64 hex chars, must equal the key asked for), ``codec`` (``none``|``zstd``),
``raw_size`` (payload bytes before compression), ``stored_size`` (S), ``tensors``: a list of
``{"name", "dtype", "shape", "offset", "nbytes"}`` with offsets into the raw payload, 64-byte aligned,
ascending and non-overlapping, and ``nbytes == prod(shape) * itemsize``.

The format's limits, checked on both sides: :func:`validate_chunk` refuses to store a chunk a reader
would reject, and the parser trusts nothing it reads. The header is capped at :data:`MAX_HEADER`, every
field is type-checked, offsets and sizes are bounded (:data:`MAX_RAW`, :data:`MAX_DIMS`) and checked
against the object's real size before any allocation, a zstd payload must declare its size in the frame
(:data:`MAX_ZSTD_RATIO` bounds it) and decompresses into exactly that many bytes, and the checksum covers
header and payload. A damaged object raises :class:`CorruptObjectError`; an intact one this reader cannot
represent (a newer format version, a dtype this torch lacks) raises :class:`UnsupportedObjectError`,
and only after its checksum passed. No pickle.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import xxhash
import zstandard

from .errors import CorruptObjectError, InvalidInputError, UnsupportedObjectError
from .keys import ChunkKey
from .tensors import DTYPES, TensorDict, byte_view, dtype_name, shape_is_valid, validate_tensors

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"TIERSTOR"
VERSION = 1
#: the version of sealed objects (a MAC tag ends the header region)
SEALED_VERSION = 2
TAG_SIZE = 32
SEAL_ALGS = ("blake3",)
ENCRYPTION_ALGS = ("aes-256-gcm",)
#: versions above ours that a reader reports as unsupported (a newer writer); others are damage
MAX_FUTURE_VERSION = 255
PREFIX = struct.Struct("<8sII16s")
PREFIX_SIZE = PREFIX.size  # 32
SEALED_PREFIX = struct.pack("<I", SEALED_VERSION)  # bytes 8-12 of a sealed object
ALIGN = 64
#: bytes of header JSON (with padding); a chunk whose header would be larger is refused by put
MAX_HEADER = 8 << 20
#: raw payload bytes of one chunk, and the largest single dimension
MAX_RAW = 1 << 40
MAX_DIMS = 64
#: raw_size / stored_size above this is a lie: zstd itself stays under 32768 (a 4-byte RLE block
#: stands for at most 128 KiB), so a frame claiming more is not one our encoder wrote
MAX_ZSTD_RATIO = 1 << 16
CODECS = ("none", "zstd")
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")  # well-formed, possibly from a newer torch


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype | None  # None: a well-formed dtype name this torch does not have
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    dtype_name: str = ""


@dataclass(frozen=True)
class Encryption:
    """How a sealed object's payload is encrypted: the algorithm, its synthetic IV (from which the
    object's key is derived) and the AEAD's tag."""

    alg: str
    iv: bytes
    tag: bytes

    def fields(self) -> dict[str, str]:
        return {"alg": self.alg, "iv": self.iv.hex(), "tag": self.tag.hex()}


@dataclass(frozen=True)
class Seal:
    """A sealed object's MAC: the algorithm, the id of the key it was made with, the tag itself; and
    whether (how) its payload is encrypted."""

    alg: str
    kid: str
    tag: bytes
    enc: Encryption | None = None

    def fields(self) -> dict[str, Any]:
        """The header JSON's ``seal`` field (the tag is not in it: it ends the header region)."""
        out: dict[str, Any] = {"alg": self.alg, "kid": self.kid}
        if self.enc is not None:
            out["enc"] = self.enc.fields()
        return out


@dataclass(frozen=True)
class Header:
    key: ChunkKey
    codec: str
    raw_size: int
    stored_size: int
    tensors: tuple[TensorSpec, ...]
    payload_offset: int  # where the payload starts in the object
    seal: Seal | None = None  # set on sealed (version 2) objects

    @property
    def object_size(self) -> int:
        return self.payload_offset + self.stored_size

    def require_supported(self) -> None:
        """Raise :class:`UnsupportedObjectError` if a tensor has a dtype this torch lacks (call it
        after the checksum passed: only then is the object known to be intact)."""
        for s in self.tensors:
            if s.dtype is None:
                raise UnsupportedObjectError(f"object {self.key.hex()}: tensor {s.name!r} has dtype "
                                             f"{s.dtype_name!r}, which this torch ({torch.__version__}) lacks")


@dataclass
class Encoded:
    """An encoded object as a list of buffers to write in order (no concatenation needed)."""

    parts: list[Any]
    header: Header  # what parse_header would return for parts[0] (writers plan reads from it, unparsed)

    @property
    def size(self) -> int:
        return self.header.object_size

    @classmethod
    def of_object(cls, buf: torch.Tensor, hdr: Header) -> Encoded:
        """A whole, verified object in one flat uint8 CPU tensor, as parts (prefix and header, then payload)
        that keep ``buf`` alive."""
        mv = buf.numpy().data if buf.numel() else memoryview(b"")
        return cls([mv[:hdr.payload_offset], mv[hdr.payload_offset:]], hdr)

    @property
    def checksum(self) -> bytes:
        """The object's xxh3-128 checksum field (bytes 16-32 of the object)."""
        return bytes(memoryview(self.parts[0]).cast("B")[16:32])

    def intact(self) -> bool:
        """Whether the checksum field matches the header region and payload."""
        first = memoryview(self.parts[0]).cast("B")
        return checksum(first[PREFIX_SIZE:], self.parts[1:]) == self.checksum

    def tobytes(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts)


def _spec_bound(name: str, ndim: int) -> int:
    """An upper bound of one tensor entry's JSON bytes: escaped name (<= 12 bytes a character), dims of
    up to 13 digits, fixed fields."""
    return 12 * len(name) + 14 * ndim + 160


def validate_chunk(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse a chunk the format cannot read back.

    The one check of what a chunk may be, shared by ``put`` (store and tiers, before any tier is
    touched) and :func:`encode`: :func:`~tierstore.tensors.validate_tensors`, then at most
    :data:`MAX_DIMS` dims, no dimension and no raw payload over :data:`MAX_RAW` bytes, and a header
    under :data:`MAX_HEADER` bytes.

    Raises:
        InvalidTypeError, InvalidInputError: naming the offending tensor.
    """
    validate_tensors(tensors)
    raw_size = bound = 0
    for name, t in tensors.items():
        if t.dim() > MAX_DIMS:
            raise InvalidInputError(f"tensor {name!r} has {t.dim()} dims; the object format allows {MAX_DIMS}")
        if t.dim() and max(t.shape) > MAX_RAW:
            raise InvalidInputError(f"tensor {name!r} has a dimension over {MAX_RAW}: {tuple(t.shape)}")
        raw_size = _align(raw_size) + t.numel() * t.element_size()
        bound += _spec_bound(name, t.dim())
    if raw_size > MAX_RAW:
        raise InvalidInputError(f"chunk holds {raw_size} bytes; the object format allows {MAX_RAW}")
    if bound + 2 * ALIGN + 256 > MAX_HEADER:  # close to the cap: measure exactly
        specs, _ = _layout(tensors)
        size = len(_header_bytes(ChunkKey(bytes(32)), "none", raw_size, MAX_RAW, specs))
        if size > MAX_HEADER:
            raise InvalidInputError(f"chunk of {len(specs)} tensors needs a {size}-byte header; the object "
                                    f"format allows {MAX_HEADER} (store fewer or shorter-named tensors)")


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """Header entries of ``tensors`` (64-byte aligned offsets into the raw payload) and the raw size."""
    specs: list[dict[str, Any]] = []
    offset = 0
    for name, t in tensors.items():
        offset = _align(offset)
        nb = t.numel() * t.element_size()
        specs.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                      "offset": offset, "nbytes": nb})
        offset += nb
    return specs, offset


def _header_bytes(key: ChunkKey, codec: str, raw_size: int, stored_size: int,
                  specs: list[dict[str, Any]], seal: Mapping[str, Any] | None = None, align: int = ALIGN) -> bytes:
    """The header region: JSON padded with spaces so the payload starts ``align``-byte aligned; with ``seal`` (its
    JSON fields) it ends with :data:`TAG_SIZE` zero bytes where the tag goes."""
    header: dict[str, Any] = {"key": key.hex(), "codec": codec, "raw_size": raw_size, "stored_size": stored_size,
                              "tensors": specs}
    tail = 0
    if seal is not None:
        header["seal"] = dict(seal)
        tail = TAG_SIZE
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    pad = -(PREFIX_SIZE + len(hbytes) + tail) % align
    return hbytes + b" " * pad + bytes(tail)


def header_region(hdr: Header, seal: Mapping[str, Any] | None = None) -> bytes:
    """The header region of an object with ``hdr``'s key, codec, sizes and tensors (sealed with a zero tag
    when ``seal`` is given): what an existing object's header is rewritten to, its payload unchanged."""
    specs = [{"name": s.name, "dtype": s.dtype_name, "shape": list(s.shape), "offset": s.offset,
              "nbytes": s.nbytes} for s in hdr.tensors]
    return _header_bytes(hdr.key, hdr.codec, hdr.raw_size, hdr.stored_size, specs, seal)


def checksum(region: Buffer, payload: Sequence[Any]) -> bytes:
    """The xxh3-128 checksum of a header region followed by the stored payload's parts."""
    h = xxhash.xxh3_128(region)
    for p in payload:
        h.update(p)
    return h.digest()


def encode(key: ChunkKey, tensors: Mapping[str, torch.Tensor], codec: str = "none",
           level: int = 3, payload_align: int = ALIGN) -> Encoded:
    """Encode ``tensors`` under ``key``. Non-contiguous and device tensors are copied to CPU first.
    ``payload_align``: a multiple of :data:`ALIGN` the payload's offset in the object is padded to (a block, for
    direct I/O).

    Raises:
        InvalidInputError, InvalidTypeError: as :func:`validate_chunk`, or an unknown ``codec``.
    """
    if codec not in CODECS:
        raise InvalidInputError(f"unknown codec {codec!r}; expected one of {CODECS}")
    validate_chunk(tensors)
    specs, raw_size = _layout(tensors)
    payload: list[Any] = []
    pos = 0
    for spec, t in zip(specs, tensors.values(), strict=True):
        if spec["offset"] > pos:
            payload.append(bytes(spec["offset"] - pos))
        if spec["nbytes"]:
            payload.append(byte_view(t).numpy().data)
        pos = spec["offset"] + spec["nbytes"]
    if codec == "zstd":  # the frame records its content size, which the reader requires
        payload = [zstandard.ZstdCompressor(level=level).compress(b"".join(payload))]
    stored_size = sum(len(p) for p in payload)
    hbytes = _header_bytes(key, codec, raw_size, stored_size, specs, align=payload_align)
    prefix = PREFIX.pack(MAGIC, VERSION, len(hbytes), checksum(hbytes, payload))
    header = Header(key, codec, raw_size, stored_size,
                    tuple(TensorSpec(sp["name"], t.dtype, tuple(sp["shape"]), sp["offset"], sp["nbytes"], sp["dtype"])
                          for sp, t in zip(specs, tensors.values(), strict=True)), PREFIX_SIZE + len(hbytes))
    return Encoded([prefix + hbytes, *payload], header)


def as_encoded(key: ChunkKey, chunk: Mapping[str, torch.Tensor] | Encoded, codec: str,
               payload_align: int = ALIGN) -> Encoded:
    """``chunk`` encoded under ``key`` with ``codec`` (and ``payload_align``, see :func:`encode`): an object
    already encoded with ``codec`` is used as it is (no second checksum pass), one with another codec is decoded
    and encoded again."""
    if isinstance(chunk, Encoded):
        if chunk.header.key != key:
            raise InvalidInputError(f"object holds key {chunk.header.key.hex()}, not {key.hex()}")
        if chunk.header.codec == codec:
            return chunk
        chunk = decode(b"".join(bytes(p) for p in chunk.parts), expected_key=key)
    return encode(key, chunk, codec, payload_align=payload_align)


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """Check the fixed 32-byte prefix (magic, version, header length) and return the header length.

    Raises:
        CorruptObjectError: too short, bad magic, a header over :data:`MAX_HEADER`.
        UnsupportedObjectError: a newer format version.
    """
    mv = memoryview(prefix).cast("B")
    if len(mv) < PREFIX_SIZE:
        raise CorruptObjectError(f"object of {len(mv)} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, hlen, _ = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptObjectError("bad magic: not a tierstore object")
    if version not in (VERSION, SEALED_VERSION):
        if SEALED_VERSION < version <= MAX_FUTURE_VERSION:
            raise UnsupportedObjectError(f"format version {version} is newer than this reader's ({SEALED_VERSION})")
        raise CorruptObjectError(f"invalid format version {version}")
    if hlen > MAX_HEADER:
        raise CorruptObjectError(f"header length {hlen} exceeds the {MAX_HEADER}-byte cap")
    if version == SEALED_VERSION and hlen < TAG_SIZE + 2:
        raise CorruptObjectError(f"sealed object's header length {hlen} leaves no room for its tag")
    return int(hlen)


def parse_header(buf: Any, expected_key: ChunkKey | None = None, object_size: int | None = None) -> Header:
    """Validate and parse the prefix and header at the start of ``buf`` (bytes-like).

    ``object_size``, when known (a file size), is checked against the header. The checksum is not
    verified here; :func:`verify` does that. Unknown dtypes are left for :meth:`Header.require_supported`.
    """
    mv = memoryview(buf).cast("B")
    hlen = header_length(mv)
    if PREFIX_SIZE + hlen > len(mv):
        raise CorruptObjectError(f"header length {hlen} runs past the {len(mv)} bytes read")
    sealed = mv[8:12] == SEALED_PREFIX
    json_end = PREFIX_SIZE + hlen - (TAG_SIZE if sealed else 0)
    try:
        raw = json.loads(bytes(mv[PREFIX_SIZE:json_end]))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, over-long integers, deep nesting
        raise CorruptObjectError(f"header is not valid JSON: {exc}") from None
    hdr = _validate_header(raw, PREFIX_SIZE + hlen)
    if sealed:
        hdr = replace(hdr, seal=_validate_seal(raw.get("seal"), bytes(mv[json_end:PREFIX_SIZE + hlen])))
    if expected_key is not None and hdr.key != expected_key:
        raise CorruptObjectError(f"object holds key {hdr.key.hex()}, expected {expected_key.hex()}")
    if object_size is not None and object_size != hdr.object_size:
        raise CorruptObjectError(f"object is {object_size} bytes, header says {hdr.object_size}")
    return hdr


def _validate_seal(raw: Any, tag: bytes) -> Seal:
    if not isinstance(raw, dict) or raw.get("alg") not in SEAL_ALGS or not isinstance(raw.get("kid"), str):
        raise CorruptObjectError(f"sealed object has an invalid seal field: {str(raw)[:80]!r}")
    enc = raw.get("enc")
    if enc is None:
        return Seal(raw["alg"], raw["kid"], tag)
    try:
        if not isinstance(enc, dict) or enc.get("alg") not in ENCRYPTION_ALGS:
            raise ValueError
        iv, etag = bytes.fromhex(enc["iv"]), bytes.fromhex(enc["tag"])
        if len(iv) != 32 or len(etag) != 16:
            raise ValueError
    except (ValueError, TypeError, KeyError):
        raise CorruptObjectError(f"sealed object has an invalid encryption field: {str(enc)[:120]!r}") from None
    return Seal(raw["alg"], raw["kid"], tag, Encryption(enc["alg"], iv, etag))


def _int(raw: dict[str, Any], field: str, hi: int = MAX_RAW) -> int:
    v = raw.get(field)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise CorruptObjectError(f"header field {field!r} is not an integer in [0, {hi}]: {v!r}")
    return v


def _validate_header(raw: Any, payload_offset: int) -> Header:
    if not isinstance(raw, dict):
        raise CorruptObjectError("header is not a JSON object")
    try:
        key = ChunkKey.from_hex(raw.get("key"))  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise CorruptObjectError(f"header key is invalid: {raw.get('key')!r}") from None
    codec = raw.get("codec")
    if codec not in CODECS:
        raise CorruptObjectError(f"unknown codec {codec!r}")
    raw_size, stored_size = _int(raw, "raw_size"), _int(raw, "stored_size")
    if codec == "none" and stored_size != raw_size:
        raise CorruptObjectError("stored_size differs from raw_size without compression")
    if codec == "zstd" and raw_size > max(stored_size, 1) * MAX_ZSTD_RATIO:
        raise CorruptObjectError(f"raw_size {raw_size} is over {MAX_ZSTD_RATIO} x stored_size {stored_size}")
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
        if not isinstance(dname, str) or not _DTYPE_NAME.fullmatch(dname):
            raise CorruptObjectError(f"tensor {name!r} has an invalid dtype {dname!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_RAW for d in shape)):
            raise CorruptObjectError(f"tensor {name!r} has an invalid shape {shape!r}")
        dtype = DTYPES.get(dname)
        offset, nb = _int(item, "offset"), _int(item, "nbytes")
        if dtype is not None and nb != math.prod(shape) * dtype.itemsize:
            raise CorruptObjectError(f"tensor {name!r}: nbytes {nb} != numel x itemsize")
        if dtype is not None and not shape_is_valid(shape, dtype):  # huge dims around a zero
            raise CorruptObjectError(f"tensor {name!r}: shape {shape} overflows torch's sizes")
        if offset % ALIGN or offset < end or offset + nb > raw_size:
            raise CorruptObjectError(f"tensor {name!r}: offset {offset} misaligned, overlapping or out of range")
        end = offset + nb
        names.add(name)
        specs.append(TensorSpec(name, dtype, tuple(shape), offset, nb, dname))
    return Header(key, codec, raw_size, stored_size, tuple(specs), payload_offset)


def verify(buf: Buffer, hdr: Header) -> None:
    """Check the object's checksum; raise :class:`CorruptObjectError` on mismatch."""
    mv = memoryview(buf).cast("B")
    if len(mv) != hdr.object_size:
        raise CorruptObjectError(f"object is {len(mv)} bytes, header says {hdr.object_size}")
    if checksum(mv[PREFIX_SIZE:hdr.payload_offset], [mv[hdr.payload_offset:]]) != bytes(mv[16:32]):
        raise CorruptObjectError(f"checksum mismatch for {hdr.key.hex()}")


def alloc_bytes(n: int) -> torch.Tensor:
    """A fresh flat uint8 CPU tensor of ``n`` bytes; :class:`MemoryError` (never torch's RuntimeError)
    when the host cannot provide it, so a reader counts a miss instead of crashing."""
    try:
        return torch.empty(n, dtype=torch.uint8)
    except RuntimeError as exc:  # DefaultCPUAllocator: can't allocate memory
        raise MemoryError(f"cannot allocate {n} bytes: {exc}") from None


def decompress(stored: Any, hdr: Header) -> torch.Tensor:
    """The raw payload of a verified zstd object as a fresh uint8 tensor of exactly ``hdr.raw_size`` bytes.

    The frame must declare its content size and it must equal ``raw_size`` (bounded by
    :data:`MAX_ZSTD_RATIO` at parse time), so nothing larger is ever allocated.
    """
    stored = memoryview(stored).cast("B")
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"zstd payload has no valid frame header: {exc}") from None
    if declared != hdr.raw_size:
        raise CorruptObjectError(f"zstd frame declares {declared} bytes, the header {hdr.raw_size}")
    out = alloc_bytes(hdr.raw_size)
    mv = out.numpy().data if hdr.raw_size else memoryview(bytearray(0))
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False) as reader:
            while got < len(mv):
                n = reader.readinto(mv[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"zstd payload does not decompress: {exc}") from None
    if got != hdr.raw_size or extra:
        raise CorruptObjectError(f"zstd payload decompresses to other than the {hdr.raw_size} bytes declared")
    return out


def verified(buf: torch.Tensor | bytes | bytearray, expected_key: ChunkKey, sealed_checked: bool = False) -> Encoded:
    """A whole object checked (header, size, checksum) but not decoded, as an :class:`Encoded`; raises
    :class:`CorruptObjectError` if it is damaged. ``sealed_checked``: the caller opens a sealed object's
    seal itself (its MAC covers what the checksum does), so a sealed object's checksum is not computed."""
    if not isinstance(buf, torch.Tensor):
        data = bytearray(buf)
        buf = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    mv = buf.numpy().data if buf.numel() else memoryview(b"")
    hdr = parse_header(mv, expected_key, object_size=len(mv))
    if not (sealed_checked and hdr.seal is not None):  # (parse_header checked the size already)
        verify(mv, hdr)
    return Encoded.of_object(buf, hdr)


def decode(buf: torch.Tensor | bytes | bytearray | memoryview, expected_key: ChunkKey | None = None) -> TensorDict:
    """Validate a whole object and return its tensors.

    With an uncompressed object in a writable uint8 CPU tensor, the tensors are views over ``buf``
    (no copy); otherwise the payload is decompressed or copied into one fresh buffer.

    Raises:
        CorruptObjectError: the object is damaged.
        UnsupportedObjectError: it is intact but this reader cannot represent it.
        MemoryError: the payload does not fit in memory.
    """
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
            raise InvalidInputError("decode takes a flat uint8 CPU tensor")
        mv = buf.numpy().data if buf.numel() else memoryview(b"")
    else:
        mv = memoryview(buf).cast("B")
    hdr = parse_header(mv, expected_key, object_size=len(mv))
    verify(mv, hdr)
    hdr.require_supported()
    if hdr.codec == "zstd":
        payload = decompress(mv[hdr.payload_offset:], hdr)
    elif isinstance(buf, torch.Tensor):
        payload = buf[hdr.payload_offset:]
    else:
        payload = alloc_bytes(hdr.raw_size)
        if hdr.raw_size:
            payload.numpy().data[:] = mv[hdr.payload_offset:]
    return tensors_from_payload(payload, hdr)


def decode_encoded(enc: Encoded) -> TensorDict:
    """The tensors of an object already verified (:func:`verified`, a tier's checked read): views over its
    payload buffer when it is uncompressed and in one writable part, else over one fresh buffer.

    Raises:
        UnsupportedObjectError: a dtype this torch lacks. CorruptObjectError: a zstd payload that does not
        decompress to its declared size.
    """
    hdr = enc.header
    hdr.require_supported()
    parts = enc.parts[1:]
    stored = memoryview(parts[0]).cast("B") if len(parts) == 1 else memoryview(bytearray(b"".join(map(bytes, parts))))
    if hdr.codec == "zstd":
        payload = decompress(stored, hdr)
    elif not hdr.raw_size:
        payload = torch.empty(0, dtype=torch.uint8)
    elif stored.readonly:
        payload = alloc_bytes(hdr.raw_size)
        payload.numpy().data[:] = stored
    else:
        payload = torch.frombuffer(stored, dtype=torch.uint8)
    return tensors_from_payload(payload, hdr)


def tensors_from_payload(payload: torch.Tensor, hdr: Header) -> TensorDict:
    """Views of each tensor over the raw ``payload`` (a flat uint8 tensor) of a verified object."""
    hdr.require_supported()
    out = {}
    for s in hdr.tensors:
        assert s.dtype is not None  # require_supported
        flat = payload[s.offset:s.offset + s.nbytes]
        if s.dtype != torch.uint8:
            flat = flat.view(s.dtype)
        out[s.name] = flat.reshape(s.shape)
    return out
