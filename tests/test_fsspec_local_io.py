"""The remote tier on a mount (``file://``) reads straight into the caller's tensors and writes without a joined
copy, with direct I/O where the object and the memory are block-aligned: exact bytes or a miss, whatever the
``out`` (aligned, unaligned, non-contiguous), the object (damaged, truncated) or the file system (tmpfs refuses
``O_DIRECT``)."""

from __future__ import annotations

import mmap
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import objformat
from tierstore.backends import direct_io
from tierstore.backends.base import Hit
from tierstore.backends.fsspec import DIRECT_MIN, FsspecBackend
from tierstore.backends.layout import object_relpath
from tierstore.errors import CorruptObjectError
from tierstore.testing.data import key_of

SIZE = 1 << 20  # past DIRECT_MIN: written with its payload on a block


def aligned_rows(n: int, size: int) -> torch.Tensor:
    """``n`` page-aligned rows of ``size`` random bytes (as vLLM's CPU tier: a shared mmap region)."""
    rows = torch.frombuffer(mmap.mmap(-1, n * size), dtype=torch.uint8).view(n, size)
    return rows.random_()


def unaligned(size: int) -> torch.Tensor:
    """A contiguous uint8 tensor of ``size`` bytes that starts 64 bytes past a block boundary."""
    base = torch.frombuffer(mmap.mmap(-1, size + direct_io.BLOCK), dtype=torch.uint8)
    return base[64:64 + size]


def supports_direct_io(folder: str) -> bool:
    """Whether ``folder``'s file system takes an ``O_DIRECT`` write of an aligned block."""
    path = os.path.join(folder, f"direct-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | direct_io.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        return os.pwrite(fd, mmap.mmap(-1, direct_io.BLOCK), 0) == direct_io.BLOCK
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture
def backend(tmp_path):
    with FsspecBackend(url=f"file://{tmp_path}/kv") as b:
        yield b


def put(b: FsspecBackend, key, chunk) -> None:
    assert b.write_many([(key, b.prepare(key, chunk))]) == [None]


def object_file(b: FsspecBackend, key) -> Path:
    return Path(f"{b.root}/{object_relpath(key)}")


def read_one(b: FsspecBackend, key, out):
    return b.read_into_many([key], [out])[0]


def test_a_large_chunk_is_written_for_direct_io_and_read_back_exactly_into_out(backend):
    rows = aligned_rows(2, SIZE)
    key = key_of(1)
    put(backend, key, {"kv": rows[0]})
    raw = object_file(backend, key).read_bytes()
    hdr = objformat.parse_header(raw, key, object_size=len(raw))
    assert hdr.payload_offset % direct_io.BLOCK == 0 and len(raw) == hdr.payload_offset + SIZE
    assert objformat.decode(raw, key)["kv"].equal(rows[0])  # any reader takes the padded header
    out = {"kv": rows[1]}
    hit = read_one(backend, key, out)
    assert isinstance(hit, Hit) and hit.value["kv"] is out["kv"] and hit.size == len(raw)
    assert rows[1].equal(rows[0])


def test_reads_use_direct_io_where_aligned_and_buffered_reads_elsewhere(backend, monkeypatch):
    """An aligned ``out`` of an aligned object is read directly (where the file system allows it); an ``out``
    off a block boundary, or an object whose payload is not on a block (a small chunk), is read buffered, into
    the same tensors, with the same bytes."""
    direct = []
    real = direct_io.read_payload
    monkeypatch.setattr(direct_io, "read_payload", lambda *a: direct.append(r := real(*a)) or r)
    rows = aligned_rows(2, SIZE)
    put(backend, key_of(1), {"kv": rows[0]})
    small = torch.arange(1000, dtype=torch.int32)
    put(backend, key_of(2), {"kv": small})
    assert read_one(backend, key_of(1), {"kv": rows[1]}) is not None and rows[1].equal(rows[0])
    if supports_direct_io(backend.root):
        assert direct[-1] == SIZE
    off = unaligned(SIZE)
    assert read_one(backend, key_of(1), {"kv": off}) is not None and off.equal(rows[0])
    assert direct[-1] is None
    got = torch.empty_like(small)
    assert read_one(backend, key_of(2), {"kv": got}) is not None and got.equal(small)


def test_no_fresh_payload_buffer_is_allocated_per_read(backend, monkeypatch):
    """The read lands in ``out`` itself: no object-sized buffer, no decode, no second copy (before, each read
    allocated the whole object, then copied it into ``out``)."""
    rows = aligned_rows(2, SIZE)
    keys = [key_of(i) for i in range(4)]
    for k in keys:
        put(backend, k, {"kv": rows[0]})
    allocated = []
    real = objformat.alloc_bytes
    monkeypatch.setattr(objformat, "alloc_bytes", lambda n: allocated.append(n) or real(n))
    outs = [{"kv": unaligned(SIZE)} for _ in keys[:2]] + [{"kv": rows[1]}, {"kv": torch.empty(SIZE, dtype=torch.uint8)}]
    got = backend.read_into_many(keys, outs)
    assert all(isinstance(g, Hit) for g in got)
    assert all(o["kv"].equal(rows[0]) for o in outs)
    assert allocated == []


def test_several_tensors_with_gaps_and_dtypes_are_exact(backend):
    chunk = {"k": torch.randn(3, 7, dtype=torch.float32), "v": torch.randint(0, 255, (1001,), dtype=torch.uint8),
             "w": torch.randn(DIRECT_MIN // 2, dtype=torch.bfloat16)}
    put(backend, key_of(3), chunk)
    out = {name: torch.empty_like(t) for name, t in chunk.items()}
    assert isinstance(read_one(backend, key_of(3), out), Hit)
    for name, t in chunk.items():
        assert torch.equal(out[name], t)


def test_a_non_contiguous_out_falls_back_and_is_exact(backend):
    rows = aligned_rows(1, SIZE)
    data = rows[0].view(1024, 1024)
    put(backend, key_of(4), {"kv": data})
    out = torch.empty(1024, 1024, dtype=torch.uint8).t()  # the right shape, not contiguous
    assert not out.is_contiguous()
    assert isinstance(read_one(backend, key_of(4), {"kv": out}), Hit)
    assert out.equal(data)


@pytest.mark.parametrize("where", ["payload", "header", "last"])
def test_a_flipped_byte_is_a_miss_and_out_is_never_reported_valid(tmp_path, where):
    url = f"file://{tmp_path}/kv"
    rows = aligned_rows(3, SIZE)
    keys = [key_of(10), key_of(11)]
    with FsspecBackend(url=url) as b:
        for k in keys:
            put(b, k, {"kv": rows[0]})
        path = object_file(b, keys[0])
        raw = bytearray(path.read_bytes())
        at = {"payload": len(raw) - SIZE + 12345, "header": objformat.PREFIX_SIZE + 2, "last": len(raw) - 1}[where]
        raw[at] ^= 0x01
        path.write_bytes(raw)
        got = b.read_into_many(keys, [{"kv": rows[1]}, {"kv": rows[2]}])
        assert isinstance(got[0], CorruptObjectError)
        assert isinstance(got[1], Hit) and rows[2].equal(rows[0])
    store = tierstore.open({"tiers": [{"kind": "remote", "url": url}]})
    try:
        outs = [{"kv": rows[1]}, {"kv": rows[2]}]
        assert [g is not None for g in store.get_many(keys, out=outs)] == [False, True]
    finally:
        store.close()


@pytest.mark.parametrize("cut", [1, direct_io.BLOCK, SIZE])
def test_a_truncated_object_is_a_miss(backend, cut):
    rows = aligned_rows(2, SIZE)
    put(backend, key_of(5), {"kv": rows[0]})
    path = object_file(backend, key_of(5))
    os.truncate(path, path.stat().st_size - cut)
    assert isinstance(read_one(backend, key_of(5), {"kv": rows[1]}), CorruptObjectError)


def test_a_missing_object_is_a_plain_miss(backend):
    assert read_one(backend, key_of(6), {"kv": torch.empty(8, dtype=torch.uint8)}) is None


@pytest.mark.parametrize("aligned_memory", [True, False])
def test_objects_are_written_byte_for_byte_as_encoded(backend, aligned_memory):
    """Direct (aligned) or buffered (not): the file holds exactly the encoded object."""
    data = aligned_rows(1, SIZE)[0] if aligned_memory else unaligned(SIZE).random_()
    key = key_of(7)
    prepared = backend.prepare(key, {"kv": data})
    assert backend.write_many([(key, prepared)]) == [None]
    assert object_file(backend, key).read_bytes() == prepared.payload.tobytes()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_file_system_that_refuses_direct_io_is_read_and_written_buffered():
    """tmpfs refuses ``O_DIRECT``: the same objects, written and read buffered."""
    root = f"/dev/shm/tierstore-test-{uuid.uuid4().hex}"
    rows = aligned_rows(2, SIZE)
    try:
        with FsspecBackend(url=f"file://{root}") as b:
            put(b, key_of(8), {"kv": rows[0]})
            assert isinstance(read_one(b, key_of(8), {"kv": rows[1]}), Hit)
            assert rows[1].equal(rows[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def held_at_a_gate(monkeypatch, owner, name: str):
    """``owner.name`` made to wait until the returned gate is set; each call releases the returned semaphore once
    as it starts waiting (a test acquires it once per pool thread it needs held)."""
    import threading

    gate, entered = threading.Event(), threading.Semaphore(0)
    real = getattr(owner, name)

    def held(*args):
        entered.release()
        assert gate.wait(30)
        return real(*args)

    monkeypatch.setattr(owner, name, held)
    return gate, entered


def test_lookups_are_answered_while_every_pool_thread_is_reading(tmp_path, monkeypatch):
    """Lookups on a mount have a pool of their own: on the backend's pool they would wait behind the multi-MiB
    reads queued there (in an engine, a request waiting for a probe waits a scheduler step per retry)."""
    import threading
    import time

    from tierstore.backends import objfile

    rows = aligned_rows(4, SIZE)
    with FsspecBackend(url=f"file://{tmp_path}/kv", max_in_flight=2) as b:
        keys = [key_of(i) for i in range(4)]
        for i, k in enumerate(keys):
            put(b, k, {"kv": rows[i]})
        gate, opened = held_at_a_gate(monkeypatch, objfile, "open_object")
        outs = [{"kv": t} for t in aligned_rows(4, SIZE)]
        reader = threading.Thread(target=b.read_into_many, args=(keys, outs))
        reader.start()
        try:
            assert opened.acquire(timeout=10) and opened.acquire(timeout=10)  # both pool threads are reading
            start = time.monotonic()
            sizes = [object_file(b, k).stat().st_size for k in keys]
            assert b.stat_many([*keys, key_of(99)]) == [*sizes, None]
            assert time.monotonic() - start < 5
        finally:
            gate.set()
            reader.join(30)


def test_reads_are_answered_while_every_pool_thread_is_writing(tmp_path, monkeypatch):
    """Reads on a mount have a pool of their own: on the writes' pool an engine's load would wait behind every
    multi-MiB write queued there (vLLM's ``fs`` tier gives its loads threads of their own too)."""
    import threading

    rows = aligned_rows(8, SIZE)
    with FsspecBackend(url=f"file://{tmp_path}/kv", max_in_flight=2) as b:
        stored = [key_of(i) for i in range(2)]
        for i, k in enumerate(stored):
            put(b, k, {"kv": rows[i]})
        gate, writing = held_at_a_gate(monkeypatch, direct_io, "write_object")
        fresh = [(key_of(10 + i), b.prepare(key_of(10 + i), {"kv": rows[2 + i]})) for i in range(4)]
        writer = threading.Thread(target=b.write_many, args=(fresh,))
        writer.start()
        outs = [{"kv": t} for t in aligned_rows(2, SIZE)]
        got: list = []
        try:
            assert writing.acquire(timeout=10) and writing.acquire(timeout=10)  # both pool threads are writing
            reader = threading.Thread(target=lambda: got.extend(b.read_into_many(stored, outs)))
            reader.start()
            reader.join(5)
            assert got, "the reads waited behind the writes queued before them"
        finally:
            gate.set()
            writer.join(30)
        assert all(isinstance(g, Hit) for g in got)
        assert outs[0]["kv"].equal(rows[0]) and outs[1]["kv"].equal(rows[1])
        assert all(read_one(b, k, {"kv": torch.empty(SIZE, dtype=torch.uint8)}) is not None for k, _ in fresh)
