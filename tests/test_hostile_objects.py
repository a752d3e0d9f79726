"""Reads of hostile or damaged objects: a counted miss in bounded time and memory, never an exception, and
never a delete on a shared tier (review C2, C7; probe rows 3.6-3.10).

Each backend is checked twice: on its own (every read path gives the item's failure as its result, in bounded
time) and as the one tier of a store (which counts the miss, and removes only from storage it owns)."""

import contextlib
import functools
import json
import os
import socket
import threading
from pathlib import Path

import pytest
import torch
import zstandard

import tierstore
from tierstore import objformat
from tierstore.backends.file import FileBackend
from tierstore.backends.fsspec import FsspecBackend
from tierstore.backends.layout import object_relpath
from tierstore.cli import main
from tierstore.errors import CorruptObjectError, InvalidInputError
from tierstore.store import TieredStore
from tierstore.testing.data import (
    assert_same,
    chunk,
    key_of,
    reencode,
    unsupported_object,
)

TIERS = ["disk", "disk-zstd", "file-remote"]


def open_store(kind: str, tmp_path) -> tuple[TieredStore, Path]:
    """A store whose one tier is a ``kind`` backend, and the directory that backend keeps its objects in."""
    if kind.startswith("disk"):
        b = FileBackend(path=tmp_path / "disk", codec="zstd" if kind.endswith("zstd") else "none")
        return TieredStore.from_backends([b]), tmp_path / "disk"
    return TieredStore.from_backends([FsspecBackend(url=(tmp_path / "remote").as_uri())]), tmp_path / "remote"


def tier_stats(store: TieredStore) -> dict:
    (stats,) = store.stats()["tiers"].values()
    return stats


def check_counts(*checks: tuple[bool, int, int]) -> None:
    """Each ``(shared, counted, expected)`` must match exactly (call it last in a test): one read of a damaged
    object counts once, on a shared tier too."""
    for _, counted, expected in checks:
        assert counted == expected


def in_thread(fn, timeout: float = 10.0):
    """``fn()`` on a daemon thread; fails the test if it has not returned within ``timeout`` seconds."""
    result: list = []
    th = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), "the read blocked"
    assert result, "the read raised"
    return result[0]


@pytest.fixture
def allocations(monkeypatch):
    """Sizes of every payload buffer a reader allocates."""
    sizes: list[int] = []
    original = getattr(objformat, "alloc_bytes", None)
    if original is None:  # a build without the helper (the regression check against old code)
        return sizes

    def recording(n):
        sizes.append(n)
        return original(n)

    monkeypatch.setattr(objformat, "alloc_bytes", recording, raising=False)
    return sizes


# --------------------------------------------------------------------------- item 7: not a regular file
@pytest.mark.parametrize("kind", TIERS)
@pytest.mark.parametrize("what", ["fifo", "socket", "directory", "symlink"])
def test_non_regular_file_is_a_miss_without_blocking(kind, what, tmp_path, monkeypatch):
    store, root = open_store(kind, tmp_path)
    backend = store.tiers[0].backend
    with store:
        assert store.put(key_of(0), chunk(0))
        path = root / object_relpath(key_of(0))
        outside = tmp_path / "outside.tso"
        outside.write_bytes(path.read_bytes())  # a valid object: following the link would "work"
        path.unlink()
        sock = None
        if what == "fifo":
            os.mkfifo(path)
        elif what == "socket":
            monkeypatch.chdir(path.parent)  # AF_UNIX paths are short; bind relative to the folder
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(path.name)
        elif what == "directory":
            path.mkdir()
        else:
            path.symlink_to(outside)
        try:
            out = {"k": torch.empty(512), "v": torch.empty(512)}
            for read in (lambda: backend.read_many([key_of(0)]), lambda: backend.read_objects([key_of(0)]),
                         lambda: backend.read_into_many([key_of(0)], [out])):
                (got,) = in_thread(read)
                assert isinstance(got, CorruptObjectError), got
            assert in_thread(lambda: store.get(key_of(0))) is None
            assert in_thread(lambda: store.get(key_of(0), out=out)) is None
        finally:
            if what == "fifo":  # release a reader blocked in open() on the old code
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            if sock is not None:
                sock.close()
        assert tier_stats(store)["corrupt"] >= 1
        assert outside.read_bytes()[:8] == objformat.MAGIC  # the target is untouched
        if backend.capabilities.shared:
            assert os.path.lexists(path)  # a reader never removes anything from shared storage
        else:
            assert not store.contains(key_of(0))  # forgotten by the store that owns the directory


# --------------------------------------------------------------------------- item 6: sizes before allocation
@pytest.mark.parametrize("kind", TIERS)
def test_sparse_huge_file_is_a_miss_read_in_header_time(kind, tmp_path, allocations):
    store, root = open_store(kind, tmp_path)
    backend = store.tiers[0].backend
    with store:
        store.put(key_of(0), chunk(0))
        path = root / object_relpath(key_of(0))
        os.truncate(path, 64 << 30)  # a valid object extended to a sparse 64 GiB file
        (got,) = in_thread(lambda: backend.read_objects([key_of(0)]))
        assert isinstance(got, CorruptObjectError)
        assert in_thread(lambda: store.get(key_of(0))) is None
        store.put(key_of(1), chunk(1))
        os.truncate(root / object_relpath(key_of(1)), 64 << 30)
        out = {"k": torch.empty(512), "v": torch.empty(512)}
        assert in_thread(lambda: store.get(key_of(1), out=out)) is None
        assert max(allocations, default=0) < 1 << 20
        check_counts((backend.capabilities.shared, tier_stats(store)["corrupt"], 2))


def zstd_object(raw_size: int, content_size: bool) -> bytes:
    """A zstd object with a valid checksum whose header claims ``raw_size`` payload bytes."""
    base = objformat.encode(key_of(0), {"x": torch.zeros(1024)}, codec="zstd").tobytes()
    frame = zstandard.ZstdCompressor(write_content_size=content_size).compress(bytes(4096))
    return reencode(base, lambda h: h.update(raw_size=raw_size, stored_size=len(frame),
                                             tensors=[{"name": "x", "dtype": "uint8", "shape": [raw_size],
                                                       "offset": 0, "nbytes": raw_size}]), payload=frame)


ZSTD_LIES = {
    "64 GiB claimed, no content size": zstd_object(64 << 30, content_size=False),
    "the real size, no content size": zstd_object(4096, content_size=False),
    "frame content size differs": zstd_object(8192, content_size=True),
}


@pytest.mark.parametrize("lie", sorted(ZSTD_LIES))
def test_zstd_size_lies_are_a_counted_miss(lie, tmp_path, allocations, s3_server):
    data = ZSTD_LIES[lie]
    with pytest.raises(tierstore.CorruptObjectError):
        objformat.decode(data, key_of(0))
    bucket = s3_server.new_bucket()
    backends = [FileBackend(path=tmp_path / "disk", codec="zstd"), FsspecBackend(url=(tmp_path / "remote").as_uri()),
                FsspecBackend(url=f"s3://{bucket}/kv", storage_options=s3_server.storage_options,
                              compression="zstd")]
    counts = []
    for backend in backends:
        with TieredStore.from_backends([backend]) as store:
            assert store.put(key_of(0), {"x": torch.zeros(1024)})
            if isinstance(backend, FsspecBackend):
                backend.fs.pipe_file(f"{backend.root}/{object_relpath(key_of(0))}", data)
            else:
                (tmp_path / "disk" / object_relpath(key_of(0))).write_bytes(data)
            (got,) = in_thread(functools.partial(backend.read_many, [key_of(0)]))
            assert isinstance(got, tierstore.CorruptObjectError), (backend, got)
            assert in_thread(functools.partial(store.get, key_of(0))) is None
            counts.append((backend.capabilities.shared, tier_stats(store)["corrupt"], 1))
    assert max(allocations, default=0) <= 8192
    check_counts(*counts)


@pytest.mark.parametrize("kind", TIERS)
@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
def test_allocation_failure_is_a_counted_miss_and_keeps_the_object(kind, error, tmp_path, monkeypatch):
    store, root = open_store(kind, tmp_path)
    with store:
        store.put(key_of(0), chunk(0, 64 << 10))
        real_empty = torch.empty

        def failing_empty(*shape, **kw):
            if kw.get("dtype") == torch.uint8:
                raise error("DefaultCPUAllocator: can't allocate memory")
            return real_empty(*shape, **kw)

        monkeypatch.setattr(torch, "empty", failing_empty)
        assert store.get(key_of(0)) is None
        monkeypatch.setattr(torch, "empty", real_empty)
        assert tier_stats(store)["errors"] == 1 and tier_stats(store)["corrupt"] == 0
        assert (root / object_relpath(key_of(0))).exists()
        assert store.contains(key_of(0))
        assert_same(store.get(key_of(0)), chunk(0, 64 << 10))  # not deleted: it was never damaged


# --------------------------------------------------------------------------- 3.6: out= checked after the checksum
def flip_name(path, old: bytes = b'"name":"k"', new: bytes = b'"name":"j"') -> None:
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))


def test_damaged_name_falls_through_to_an_intact_lower_copy(tmp_path):
    cfg = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")},
                     {"kind": "remote", "url": (tmp_path / "remote").as_uri()}],
           "write_policy": "write_through"}
    with tierstore.open(cfg) as store:
        store.put(key_of(0), chunk(0))
        flip_name(tmp_path / "disk" / object_relpath(key_of(0)))
        out = {"k": torch.empty(512), "v": torch.empty(512)}
        got = store.get(key_of(0), out=out)
        assert got is not None and got["k"].data_ptr() == out["k"].data_ptr()
        assert_same(got, chunk(0))
        assert store.stats()["tiers"]["disk"]["corrupt"] == 1
        # an intact chunk that differs from `out` is still the caller's error
        store.put(key_of(1), chunk(1))
        with pytest.raises(InvalidInputError):
            store.get(key_of(1), out={"k": torch.empty(512), "j": torch.empty(512)})
        with pytest.raises(InvalidInputError):
            store.get(key_of(1), out={"k": torch.empty(512), "v": torch.empty(511)})


# --------------------------------------------------------------------------- item 8: readers never damage a shared tier
def test_readers_never_delete_from_a_shared_prefix_only_repair_does(tmp_path, capsys):
    root = tmp_path / "shared"
    cfg_path = tmp_path / "store.json"
    cfg_path.write_text(json.dumps({"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                                              {"kind": "remote", "url": root.as_uri()}]}))
    with tierstore.open(str(cfg_path)) as store:
        for i in range(3):
            store.put(key_of(i), chunk(i))
    damaged, newer = root / object_relpath(key_of(0)), root / object_relpath(key_of(1))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x40
    damaged.write_bytes(bytes(data))
    newer.write_bytes(unsupported_object(key_of(1), "version"))
    with tierstore.open(str(cfg_path)) as store:  # another process, reading
        assert store.get(key_of(0)) is None and store.get(key_of(1)) is None
        assert_same(store.get(key_of(2)), chunk(2))
        remote = store.stats()["tiers"]["remote"]
    assert damaged.exists() and newer.exists()
    assert main(["verify", "--config", str(cfg_path)]) == 1  # reports, keeps
    assert "1 corrupt (kept; --repair removes them), 1 unsupported (kept)" in capsys.readouterr().out
    assert damaged.exists()
    assert main(["verify", "--repair", "--config", str(cfg_path)]) == 1
    assert "1 corrupt (1 removed), 1 unsupported (kept)" in capsys.readouterr().out
    assert not damaged.exists() and newer.exists()
    assert main(["gc", "--config", str(cfg_path)]) == 0
    assert newer.exists()  # a newer reader may need it
    check_counts((True, remote["corrupt"], 1), (True, remote["unsupported"], 1))
