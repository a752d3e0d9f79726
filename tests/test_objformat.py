"""The chunk object format: bit-exact round trips and a parser that rejects every hostile input."""

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import objformat
from tierstore.errors import CorruptObjectError, InvalidInputError, InvalidTypeError, UnsupportedObjectError
from tierstore.keys import ChunkKey
from tierstore.tensors import DTYPES
from tierstore.testing.data import assert_same, sample_tensor

KEY = ChunkKey.from_bytes(b"fmt")
DTYPE_LIST = sorted(DTYPES.values(), key=str)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(DTYPE_LIST), st.lists(st.integers(0, 5), max_size=3)),
                      min_size=1, max_size=5),
       codec=st.sampled_from(objformat.CODECS), seed=st.integers(0, 1000))
def test_roundtrip_property(specs, codec, seed):
    tensors = {f"t{i}": sample_tensor(dt, tuple(shape), seed + i) for i, (dt, shape) in enumerate(specs)}
    enc = objformat.encode(KEY, tensors, codec)
    data = enc.tobytes()
    assert_same(objformat.decode(data, KEY), tensors)
    assert enc.header == objformat.parse_header(data, KEY, object_size=len(data))  # writers plan reads from it
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert_same(objformat.decode(buf, KEY), tensors)


def test_views_over_buffer_without_copy():
    t = {"a": torch.randn(100), "b": torch.arange(7, dtype=torch.int64)}
    buf = torch.frombuffer(bytearray(objformat.encode(KEY, t).tobytes()), dtype=torch.uint8)
    out = objformat.decode(buf, KEY)
    base = buf.data_ptr()
    assert base <= out["a"].data_ptr() < base + buf.numel()
    assert out["a"].data_ptr() % 64 == 0 or (out["a"].data_ptr() - base) % 64 == 0


def valid():
    return bytearray(objformat.encode(KEY, {"a": torch.randn(16), "b": torch.ones(3, dtype=torch.int8)}).tobytes())


def rebuild(header: dict, payload: bytes = b"\x00" * 4096) -> bytes:
    """A self-consistent object (right checksum) around a hostile header."""
    import xxhash
    h = json.dumps(header).encode()
    h += b" " * ((-(32 + len(h))) % 64)
    digest = xxhash.xxh3_128(h + payload).digest()
    return objformat.PREFIX.pack(objformat.MAGIC, 1, len(h), digest) + h + payload


def header(**changes):
    base = {"key": KEY.hex(), "codec": "none", "raw_size": 4096, "stored_size": 4096,
            "tensors": [{"name": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}]}
    base.update(changes)
    return base


def tensor(**changes):
    t = {"name": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}
    t.update(changes)
    return t


@pytest.mark.parametrize("hdr", [
    header(key="00" * 32),                                             # another key
    header(key="nothex"),
    header(codec="lz4"),
    header(tensors=[]),
    header(tensors=[tensor(dtype="Float 32")]),                        # not a dtype name at all
    header(tensors=[tensor(dtype=7)]),
    header(tensors=[tensor(nbytes=17)]),                               # numel x itemsize mismatch
    header(tensors=[tensor(offset=4096)]),                             # out of range
    header(tensors=[tensor(offset=8)]),                                # misaligned
    header(tensors=[tensor(), tensor(name="b", offset=0)]),            # overlapping
    header(tensors=[tensor(), tensor(name="a", offset=64)]),           # duplicate name
    header(tensors=[tensor(shape=[-4])]),
    header(tensors=[tensor(shape=[2**62, 2**62], nbytes=0)]),
    header(tensors=[tensor(shape="4")]),
    header(tensors=[tensor(offset=True)]),
    header(raw_size=2**50, stored_size=2**50),                         # lies about size
    header(stored_size=10),                                            # none codec with stored != raw
    ["not", "an", "object"],
])
def test_hostile_headers_rejected(hdr):
    with pytest.raises(CorruptObjectError):
        objformat.decode(rebuild(hdr), KEY)


def test_structural_damage_rejected():
    ok = valid()
    cases = {
        "truncated": ok[:-1], "extended": ok + b"\x00", "empty": b"", "prefix only": ok[:32],
        "bad magic": b"X" + ok[1:],
        "version 0": ok[:8] + struct.pack("<I", 0) + ok[12:],
        "version garbage": ok[:8] + struct.pack("<I", 0x7FFF0001) + ok[12:],
        "huge header": ok[:12] + struct.pack("<I", 2**31) + ok[16:],
    }
    for data in cases.values():
        with pytest.raises(CorruptObjectError):
            objformat.decode(bytes(data), KEY)
    not_json = rebuild(header())[:32] + b"{" * 32 + rebuild(header())[64:]
    with pytest.raises(CorruptObjectError):
        objformat.decode(not_json, KEY)


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(pos, bit):
    data = valid()
    pos %= len(data)
    data[pos] ^= 1 << bit
    # a flip in the version's low byte may read as a newer version: a miss as well, but never deleted
    expected = (CorruptObjectError, UnsupportedObjectError) if pos == 8 else CorruptObjectError
    with pytest.raises(expected):
        objformat.decode(bytes(data), KEY)


def test_zstd_bomb_is_capped():
    import zstandard
    payload = zstandard.ZstdCompressor().compress(b"\x00" * (64 << 20))
    hdr = header(codec="zstd", raw_size=4096, stored_size=len(payload))
    with pytest.raises(CorruptObjectError):
        objformat.decode(rebuild(hdr, payload), KEY)


def test_encode_rejects_bad_input():
    with pytest.raises(InvalidInputError):
        objformat.encode(KEY, {"a": torch.zeros(2)}, codec="lz4")
    with pytest.raises(InvalidTypeError):
        objformat.encode(KEY, {"a": 3})
    with pytest.raises(InvalidInputError):
        objformat.encode(KEY, {"a": torch.zeros(2, dtype=torch.complex32)})  # no stable storage name
