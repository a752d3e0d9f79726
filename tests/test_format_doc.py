"""docs/format.md stays true: its example header parses and decodes, and the limits it quotes are the code's."""

import json
import re
from pathlib import Path

import torch

from tierstore import objformat
from tierstore.keys import ChunkKey
from tierstore.testing.data import reencode

DOC = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()


def test_the_documented_example_header_is_a_valid_object():
    example = json.loads(re.search(r"```json\n(.*?)```", DOC, re.S).group(1))
    key = ChunkKey.from_hex(example["key"])
    template = objformat.encode(key, {"t": torch.zeros(1)}).tobytes()
    data = reencode(template, lambda h: (h.clear(), h.update(example)), payload=bytes(example["raw_size"]))
    tensors = objformat.decode(data, key)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()} == {
        s["name"]: (getattr(torch, s["dtype"]), tuple(s["shape"])) for s in example["tensors"]}
    # the encoder writes the same header for those tensors
    real = objformat.encode(key, {n: torch.zeros_like(t) for n, t in tensors.items()})
    assert objformat.parse_header(real.tobytes()) == objformat.parse_header(data)


def test_the_documented_limits_are_the_code_limits():
    assert f"| header length H | 8 MiB ({objformat.MAX_HEADER} bytes) |" in DOC
    assert f"| dims of one tensor | {objformat.MAX_DIMS} |" in DOC
    assert objformat.MAX_RAW == 2**40 and "| one dimension, and a chunk's raw payload | 2^40 bytes |" in DOC
    assert f"| raw_size / stored_size of a zstd payload | {objformat.MAX_ZSTD_RATIO} " in DOC
    assert "format version, u32 little-endian (1)" in DOC and objformat.VERSION == 1
    assert f"newer format version (2-{objformat.MAX_FUTURE_VERSION})" in DOC
