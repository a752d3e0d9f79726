import os
import struct
import subprocess
import sys

import pytest
import torch

from tierstore import ChunkKey
from tierstore.errors import InvalidInputError, InvalidTypeError


def sample():
    return {"k": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": torch.ones(3, dtype=torch.bfloat16)}


def test_hex_roundtrip_equality_and_hash():
    k = ChunkKey.from_tensors(sample())
    assert len(k.digest) == 32 and len(k.hex()) == 64
    assert ChunkKey.from_hex(k.hex()) == k
    assert hash(ChunkKey.from_hex(k.hex())) == hash(k)
    assert {k: 1}[ChunkKey(k.digest)] == 1
    assert k != k.hex()
    with pytest.raises(AttributeError):
        k._digest = b"x" * 32


def test_a_key_is_never_equal_to_plain_bytes():
    k = ChunkKey.from_tensors(sample())
    d = k.digest
    assert type(d) is bytes and d == bytes(k)
    assert k != d and d != k  # __ne__ and __eq__ each (both ways)
    assert (k == d) is False and (d == k) is False
    assert {k: 1}.get(d) is None and {d: 1}.get(k) is None and d not in {k} and k not in {d}
    assert str(k) == repr(k) == f"{k}" and repr(k).startswith("ChunkKey(")
    assert ChunkKey(bytearray(d)) == k and ChunkKey(memoryview(d)) == k and ChunkKey(k) == k


@pytest.mark.parametrize("bad,exc", [("zz" * 32, InvalidInputError), ("ab", InvalidInputError),
                                     (b"x" * 32, InvalidTypeError)])
def test_from_hex_rejects(bad, exc):
    with pytest.raises(exc):
        ChunkKey.from_hex(bad)


def test_constructor_rejects_wrong_length():
    with pytest.raises(InvalidInputError):
        ChunkKey(b"short")
    with pytest.raises(InvalidTypeError):
        ChunkKey("a" * 32)


def test_from_tensors_covers_names_dtypes_shapes_bytes():
    base = ChunkKey.from_tensors(sample())
    s = sample()
    assert ChunkKey.from_tensors({"v": s["v"], "k": s["k"]}) == base  # order-independent
    variants = [
        {"k2": s["k"], "v": s["v"]},
        {"k": s["k"].to(torch.int32), "v": s["v"]},
        {"k": s["k"].reshape(4, 3), "v": s["v"]},
        {"k": s["k"] + 1, "v": s["v"]},
        {"k": s["k"]},
    ]
    assert len({ChunkKey.from_tensors(v) for v in variants} | {base}) == len(variants) + 1
    assert ChunkKey.from_tensors({"k": s["k"].t().contiguous().t()}) == ChunkKey.from_tensors({"k": s["k"]})


def test_chain_is_order_and_domain_sensitive():
    a = ChunkKey.chain(None, b"ns", b"payload")
    assert a == ChunkKey.chain(None, b"ns", b"payload")
    assert a != ChunkKey.chain(None, b"nsp", b"ayload")  # framing: no ambiguous concatenation
    assert ChunkKey.chain(a, b"ns", b"x") != ChunkKey.chain(None, b"ns", b"x")
    with pytest.raises(InvalidTypeError):
        ChunkKey.chain("parent", b"ns", b"x")


def test_from_bytes_cannot_mint_a_chain_key():
    # the bytes chain() hashes, fed to from_bytes, must give another key (separate hash domains; review C10)
    def frame(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    parent = ChunkKey.chain(None, b"ns", b"tokens")
    for p, ns, payload in [(None, b"", b""), (None, b"ns", b"\x01\x00\x00\x00"), (parent, b"ns", b"more")]:
        chained = frame(p.digest if p else b"") + frame(ns) + frame(payload)
        assert ChunkKey.from_bytes(chained) != ChunkKey.chain(p, ns, payload)


def test_keys_identical_across_processes_and_hash_seeds():
    code = ("import torch; from tierstore import ChunkKey;"
            "print(ChunkKey.from_tensors({'k': torch.arange(12, dtype=torch.float32).reshape(3, 4),"
            " 'v': torch.ones(3, dtype=torch.bfloat16)}).hex(), ChunkKey.chain(None, b'ns', b'p').hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("0", "12345")}
    assert outs == {f"{ChunkKey.from_tensors(sample()).hex()} {ChunkKey.chain(None, b'ns', b'p').hex()}"}


def test_from_bytes_refuses_a_str_with_a_clear_error():
    import pytest

    from tierstore import ChunkKey, InvalidTypeError

    with pytest.raises(InvalidTypeError, match="takes bytes, got str"):
        ChunkKey.from_bytes("abc")  # type: ignore[arg-type]
    assert ChunkKey.from_bytes(bytearray(b"abc")) == ChunkKey.from_bytes(b"abc")
