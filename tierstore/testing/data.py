"""Deterministic test data and checks shared by the test suites: sample tensors and chunks, keys,
byte-exact comparison, a thread runner, and re-encoded objects another writer could have published."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from ..keys import ChunkKey


def sample_tensor(dtype: torch.dtype, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    """Deterministic tensor of any stored dtype, with random bit patterns for float8/bool too."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).reshape(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.where(torch.isnan(t), torch.zeros_like(t), t)  # NaN != NaN would hide equality bugs
    return t.clone()


def chunk(seed: int = 0, nbytes: int = 4096) -> dict[str, torch.Tensor]:
    n = nbytes // 8
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(n, generator=g), "v": torch.randn(n, generator=g)}


def key_of(i: int) -> ChunkKey:
    return ChunkKey.from_bytes(f"tier-test-{i}".encode())


def run_threads(worker, n: int) -> None:
    """Run ``worker(i)`` for ``i`` in ``range(n)`` on ``n`` threads at once; fail with every error raised."""
    errors = []

    def guarded(i):
        try:
            worker(i)
        except Exception as exc:  # collected: an assertion in a thread would otherwise only be printed
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def assert_same(a: Mapping[str, torch.Tensor] | None, b: Mapping[str, torch.Tensor] | None) -> None:
    assert a is not None and b is not None
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        if a[name].numel():
            assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def reencode(data: bytes, edit: Callable[[dict], None] | None = None, version: int | None = None,
             payload: bytes | None = None) -> bytes:
    """A copy of the encoded object ``data`` whose JSON header ``edit`` changed in place (and whose
    prefix says ``version``, whose payload is ``payload``), with a valid checksum: what another writer
    could have published."""
    import json

    import xxhash

    from .. import objformat

    hdr = objformat.parse_header(data)
    tag = hdr.seal.tag if hdr.seal is not None else b""  # a sealed object keeps its (now stale) tag
    raw = json.loads(bytes(data[objformat.PREFIX_SIZE:hdr.payload_offset - len(tag)]))
    if edit is not None:
        edit(raw)
    h = json.dumps(raw, separators=(",", ":")).encode()
    h += b" " * (-(objformat.PREFIX_SIZE + len(h) + len(tag)) % objformat.ALIGN) + tag
    payload = bytes(data[hdr.payload_offset:]) if payload is None else payload
    digest = xxhash.xxh3_128(h + payload).digest()
    if version is None:
        version = objformat.SEALED_VERSION if tag else objformat.VERSION
    return objformat.PREFIX.pack(objformat.MAGIC, version, len(h), digest) + h + payload


def unsupported_object(key: ChunkKey, what: str) -> bytes:
    """An intact object this reader cannot represent: ``what`` is ``"version"`` (a newer format) or
    ``"dtype"`` (a dtype this torch lacks)."""
    from .. import objformat

    data = objformat.encode(key, {"x": torch.arange(16, dtype=torch.int32)}).tobytes()
    if what == "version":
        return reencode(data, version=objformat.SEALED_VERSION + 1)
    return reencode(data, lambda h: h["tensors"][0].update(dtype="float99_e9m9"))
