"""Fuzzing the two parsers that read untrusted bytes: the chunk object parser (objformat, and the local
file reader in front of it) and the safetensors header/index parser (weights). Whatever the input, only
a TierstoreError escapes, and nothing is allocated beyond what the format's caps allow.

Allocation is bounded two ways: every payload buffer goes through ``objformat.alloc_bytes`` (recorded
here), and Python-side allocations (JSON, bytes) are bounded by a tracemalloc peak.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import objformat
from tierstore.backends import objfile
from tierstore.errors import TierstoreError
from tierstore.keys import ChunkKey
from tierstore.testing.data import reencode
from tierstore.weights.checkpoint import _parse_index
from tierstore.weights.header import CheckpointError, header_length, parse_header

KEY = ChunkKey.from_bytes(b"fuzz")
# `bounded` is safe to share between examples: each run() starts from a clean record
FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: Python-side allocation a parse may make beyond a few copies of its input (JSON objects of a small header)
PY_SLACK = 4 << 20

json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
             | st.text(max_size=10) | st.sampled_from(["float32", "bfloat16", "zstd", "none", "F32", "U8"]))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def valid_object(codec: str) -> bytes:
    tensors = {"k": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4), "v": torch.ones(5, dtype=torch.int8),
               "e": torch.empty(0, 7, dtype=torch.bfloat16)}
    return objformat.encode(KEY, tensors, codec).tobytes()


VALID = {codec: valid_object(codec) for codec in objformat.CODECS}


class Bounded:
    """Record payload allocations and the Python-side peak of one parse."""

    def __init__(self, monkeypatch):
        self.sizes: list[int] = []
        real = objformat.alloc_bytes

        def recording(n: int) -> torch.Tensor:
            self.sizes.append(n)
            return real(n)

        monkeypatch.setattr(objformat, "alloc_bytes", recording)

    def run(self, fn, data: bytes, errors=(TierstoreError,)):
        self.sizes.clear()
        tracemalloc.start()
        try:
            fn(data)
        except errors:
            pass
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak <= 4 * len(data) + PY_SLACK, peak
        # a payload buffer is at most the object (uncompressed) or raw_size <= MAX_ZSTD_RATIO x stored
        assert all(n <= objformat.MAX_ZSTD_RATIO * max(len(data), 1) for n in self.sizes), self.sizes


@pytest.fixture
def bounded(monkeypatch):
    return Bounded(monkeypatch)


def decode(data: bytes) -> None:
    objformat.decode(data, KEY)


def mutate_json(raw: dict, draw) -> None:
    """Replace a few values at random places of a header dict with arbitrary JSON."""
    for _ in range(draw(st.integers(1, 3))):
        target = raw
        if draw(st.booleans()) and isinstance(raw.get("tensors"), list) and raw["tensors"]:
            target = raw["tensors"][draw(st.integers(0, len(raw["tensors"]) - 1))]
            if not isinstance(target, dict):
                continue
        field = draw(st.sampled_from(sorted(target) + ["extra"]))
        if draw(st.integers(0, 5)) == 0:
            target.pop(field, None)
        else:
            target[field] = draw(json_value | st.integers(0, 2**41) | st.integers(-1, 4096))


# --------------------------------------------------------------------------- the object parser
@FAST
@given(data=st.binary(max_size=2048))
def test_object_parser_on_arbitrary_bytes(bounded, data):
    bounded.run(decode, data)
    bounded.run(decode, objformat.MAGIC + data)  # past the magic check
    bounded.run(decode, objformat.PREFIX.pack(objformat.MAGIC, 1, len(data), bytes(16)) + data)


@FAST
@given(codec=st.sampled_from(objformat.CODECS), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                                 max_size=4),
       cut=st.none() | st.integers(0, 10**6))
def test_object_parser_on_mutated_objects(bounded, codec, edits, cut):
    data = bytearray(VALID[codec])
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    bounded.run(decode, bytes(data))


@FAST
@given(codec=st.sampled_from(objformat.CODECS), data=st.data())
def test_object_parser_on_lying_headers_with_valid_checksums(bounded, codec, data):
    """What a buggy or hostile writer on a shared prefix can publish: any header, a correct checksum."""
    payload = None
    if data.draw(st.booleans()):
        payload = data.draw(st.binary(max_size=512) | st.sampled_from(
            [zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4096)),
             zstandard.ZstdCompressor().compress(bytes(1 << 16))]))
    obj = reencode(VALID[codec], lambda raw: mutate_json(raw, data.draw), payload=payload)
    bounded.run(decode, obj)


@settings(max_examples=40, deadline=None)
@given(codec=st.sampled_from(objformat.CODECS), data=st.data())
def test_local_file_reader_on_mutated_objects(tmp_path_factory, codec, data):
    path = tmp_path_factory.mktemp("fuzz") / "obj.tso"
    raw = VALID[codec]
    if data.draw(st.booleans()):
        raw = reencode(raw, lambda h: mutate_json(h, data.draw))
    else:
        raw = bytearray(raw)
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(raw))
    if data.draw(st.booleans()):
        os.truncate(path, data.draw(st.integers(0, 1 << 40)))  # sparse: up to 1 TiB of nothing
    fd, st_ = objfile.open_object(str(path))
    try:
        objfile.read_object(fd, st_, KEY)
    except TierstoreError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the safetensors parser
SAFETENSORS_HEADER = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                      "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
                      "__metadata__": {"format": "pt"}}


def parse_safetensors(blob: bytes) -> None:
    n = header_length("f", blob[:8], len(blob))
    parse_header("f", blob[8:8 + n], len(blob))


@FAST
@given(data=st.binary(max_size=2048))
def test_safetensors_parser_on_arbitrary_bytes(bounded, data):
    bounded.run(parse_safetensors, data, CheckpointError)
    bounded.run(parse_safetensors, struct.pack("<Q", len(data)) + data, CheckpointError)
    bounded.run(lambda d: parse_header("f", d, len(d) + 8), data, CheckpointError)
    bounded.run(lambda d: _parse_index("i", d), data, CheckpointError)


@FAST
@given(data=st.data())
def test_safetensors_parser_on_lying_headers(bounded, data):
    raw = json.loads(json.dumps(SAFETENSORS_HEADER))
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(sorted(raw) + ["c"]))
        if name in raw and isinstance(raw[name], dict) and data.draw(st.booleans()):
            raw[name][data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "x"]))] = data.draw(
                json_value | st.lists(st.integers(-1, 2**65), max_size=4))
        else:
            raw[name] = data.draw(json_value)
    text = json.dumps(raw).encode()
    body = bytes(data.draw(st.integers(0, 64)))
    bounded.run(parse_safetensors, struct.pack("<Q", len(text)) + text + body, CheckpointError)
    index = json.dumps({"weight_map": data.draw(json_value), "metadata": data.draw(json_value)}).encode()
    bounded.run(lambda d: _parse_index("i", d), index, CheckpointError)
