"""The disk backend's batched read path (``read_into_many``, :mod:`tierstore.backends.file_reads`): exact bytes
straight into out buffers, the remembered-header fast path never serving a replaced or damaged object, errors
isolated per key — and, in a store over it, a damaged object a counted miss that is removed, a caller's
mismatched ``out`` never."""

import os
import sys

import pytest
import torch

from tierstore import objformat
from tierstore.backends import Hit, file_reads, objfile
from tierstore.backends.file import FileBackend
from tierstore.errors import CorruptObjectError, InvalidInputError
from tierstore.store import TieredStore
from tierstore.testing.data import assert_same, chunk, key_of, run_threads

SIZE = 64 << 10


@pytest.fixture(params=["always", "once"])
def backend(tmp_path, request):
    with FileBackend(path=tmp_path / "disk", io_threads=3, verify_reads=request.param) as b:
        yield b


@pytest.fixture
def store(backend):
    """A store whose one tier is ``backend``."""
    with TieredStore.from_backends([backend]) as s:
        yield s


def outs_for(*chunks):
    return [{n: torch.empty_like(v) for n, v in c.items()} for c in chunks]


def write_all(b, items) -> None:
    assert b.write_many([(k, b.prepare(k, v)) for k, v in items]) == [None] * len(items)


def values(results):
    """The chunks of a batch of read results (``None`` for a miss); an exception result is raised."""
    out = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        out.append(None if r is None else r.value)
    return out


def tier_stats(s):
    (stats,) = s.stats()["tiers"].values()
    return stats


def test_batch_is_exact_and_reuses_remembered_headers(backend):
    data = [chunk(i, SIZE) for i in range(10)]
    write_all(backend, [(key_of(i), d) for i, d in enumerate(data)])
    keys = [key_of(i) for i in range(10)] + [key_of(99), key_of(3)]
    for _ in range(2):  # the second pass plans every read from the remembered headers
        outs = outs_for(*data, data[0], data[3])
        results = backend.read_into_many(keys, outs)
        got = values(results)
        assert got[10] is None
        for i in (*range(10), 11):
            assert_same(got[i], data[3] if i == 11 else data[i])
            assert got[i]["k"].data_ptr() == outs[i]["k"].data_ptr()
            assert results[i].size == os.path.getsize(backend.object_path(keys[i]))
    assert len(backend._reads._plans) == 10


def test_a_store_batch_into_out_releases_what_it_pins(store):
    data = [chunk(i, SIZE) for i in range(10)]
    store.put_many([(key_of(i), d) for i, d in enumerate(data)])
    keys = [key_of(i) for i in range(10)] + [key_of(99), key_of(3)]
    for _ in range(2):
        outs = outs_for(*data, data[0], data[3])
        got = store.get_many(keys, out=outs)
        assert got[10] is None
        for i in (*range(10), 11):
            assert_same(got[i], data[3] if i == 11 else data[i])
            assert got[i]["k"].data_ptr() == outs[i]["k"].data_ptr()
    st = tier_stats(store)
    assert st["pinned"] == 0 and st["reserved_bytes"] == 0
    assert st["hits"] == 22 and st["corrupt"] == 0


def test_reads_are_planned_from_the_write_and_after_a_restart_from_the_first_verified_read(tmp_path, monkeypatch):
    parsed = []
    real = objfile.read_header
    monkeypatch.setattr(objfile, "read_header", lambda *a, **kw: parsed.append(a[2]) or real(*a, **kw))
    headers_parsed = []
    real_parse = objformat.parse_header
    monkeypatch.setattr(objformat, "parse_header", lambda *a, **kw: headers_parsed.append(1) or real_parse(*a, **kw))
    data = [chunk(i, SIZE) for i in range(4)]
    keys = [key_of(i) for i in range(4)]
    with FileBackend(path=tmp_path / "d", io_threads=2) as b:
        write_all(b, list(zip(keys, data, strict=True)))
        for got, d in zip(values(b.read_into_many(keys, outs_for(*data))), data, strict=True):
            assert_same(got, d)
        assert parsed == [] and headers_parsed == []  # planned from the encoding: not even the writer parses
    with FileBackend(path=tmp_path / "d", io_threads=2) as b:
        for _ in range(2):
            for got, d in zip(values(b.read_into_many(keys, outs_for(*data))), data, strict=True):
                assert_same(got, d)
        assert sorted(parsed, key=lambda k: k.hex()) == sorted(keys, key=lambda k: k.hex())  # once each


def test_an_object_replaced_behind_the_backends_back_is_read_again_not_misjudged(backend):
    backend.write(key_of(1), chunk(1, SIZE))  # planned from the write
    path = backend.object_path(key_of(1))
    with open(path + ".new", "wb") as f:  # same names and shapes and size: only the bytes differ
        f.write(objformat.encode(key_of(1), chunk(2, SIZE)).tobytes())
    os.replace(path + ".new", path)
    (got,) = backend.read_into_many([key_of(1)], outs_for(chunk(2, SIZE)))
    assert isinstance(got, Hit)  # not judged corrupt
    assert_same(got.value, chunk(2, SIZE))


def test_a_replaced_object_is_read_again_not_misjudged(backend):
    backend.write(key_of(1), chunk(1, SIZE))
    backend._reads._plans.clear()
    values(backend.read_into_many([key_of(1)], outs_for(chunk(1, SIZE))))  # header remembered by the read
    backend.write(key_of(1), chunk(2, SIZE))  # same names and shapes: only the checksum differs
    (got,) = backend.read_into_many([key_of(1)], outs_for(chunk(2, SIZE)))
    assert isinstance(got, Hit)  # not judged corrupt
    assert_same(got.value, chunk(2, SIZE))


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "symlink", "fifo", "directory"])
def test_a_damaged_object_is_a_counted_miss_and_the_rest_of_the_batch_is_served(store, backend, tmp_path, damage):
    data = [chunk(i, SIZE) for i in range(3)]
    store.put_many([(key_of(i), d) for i, d in enumerate(data)])
    store.get_many([key_of(i) for i in range(3)], out=outs_for(*data))  # headers remembered
    path = backend.object_path(key_of(1))
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 64)
    elif damage == "append":  # the planned bytes are all intact: only the size betrays it
        with open(path, "ab") as f:
            f.write(b"x")
    elif damage == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif damage == "directory":
        os.unlink(path)
        os.mkdir(path)
    else:
        target = tmp_path / "elsewhere"
        os.replace(path, target)
        os.symlink(target, path)
    # the backend says why, per key
    got = backend.read_into_many([key_of(i) for i in range(3)], outs_for(*data))
    assert isinstance(got[1], CorruptObjectError)
    assert_same(got[0].value, data[0])
    assert_same(got[2].value, data[2])
    # the store counts a miss, serves the rest of the batch and removes what is damaged in its own directory
    got = store.get_many([key_of(i) for i in range(3)], out=outs_for(*data))
    assert got[1] is None
    assert_same(got[0], data[0])
    assert_same(got[2], data[2])
    assert tier_stats(store)["corrupt"] == 1
    assert not store.contains(key_of(1))
    assert os.path.isdir(path) if damage == "directory" else not os.path.lexists(path)  # a folder is not ours
    if damage == "symlink":  # never followed: the link goes, what it points to stays
        assert (tmp_path / "elsewhere").exists()


def test_a_mismatched_out_is_an_error_for_that_key_only(store, backend):
    store.put_many([(key_of(1), chunk(1, SIZE)), (key_of(2), chunk(2, SIZE))])
    backend._reads._plans.clear()
    for _ in range(2):  # without and with a remembered header
        outs = outs_for(chunk(1, SIZE), chunk(2, SIZE))
        outs[0]["k"] = torch.empty(7)
        got = backend.read_into_many([key_of(1), key_of(2)], outs)
        assert isinstance(got[0], InvalidInputError)
        assert_same(got[1].value, chunk(2, SIZE))
        outs = outs_for(chunk(1, SIZE), chunk(2, SIZE))
        outs[0]["k"] = torch.empty(7)
        got = store.get_many([key_of(1), key_of(2)], out=outs)
        assert got[0] is None
        assert_same(got[1], chunk(2, SIZE))
        with pytest.raises(InvalidInputError):
            store.get(key_of(1), out=outs[0])
        assert store.contains(key_of(1))  # a caller's mistake never removes the object
        assert backend.stat_many([key_of(1)])[0] is not None
    st = tier_stats(store)
    assert st["corrupt"] == 0 and st["errors"] == 0
    assert_same(store.get(key_of(1)), chunk(1, SIZE))


def test_an_out_that_gained_a_tensor_since_the_last_read_is_refused_not_half_filled(backend):
    """The read path keeps the segments it made for an ``out`` mapping; a tensor added to that same mapping
    afterwards would not be filled by them."""
    backend.write(key_of(1), chunk(1, SIZE))
    (out,) = outs_for(chunk(1, SIZE))
    for _ in range(2):
        assert_same(values(backend.read_into_many([key_of(1)], [out]))[0], chunk(1, SIZE))
    out["extra"] = torch.full((4,), 7.0)
    (got,) = backend.read_into_many([key_of(1)], [out])
    assert isinstance(got, InvalidInputError), got
    assert torch.equal(out["extra"], torch.full((4,), 7.0))


def test_bfloat16_and_compressed_objects(tmp_path):
    data = {"k": torch.randn(3, 1000).to(torch.bfloat16), "idx": torch.arange(77, dtype=torch.int64)}
    for codec in ("none", "zstd"):
        with FileBackend(path=tmp_path / codec, codec=codec, io_threads=2) as b:
            b.write(key_of(1), data)
            for _ in range(2):
                got = values(b.read_into_many([key_of(1), key_of(1)], outs_for(data, data)))
                assert_same(got[0], data)
                assert_same(got[1], data)


def test_reads_racing_overwrites_see_one_version_whole(backend):
    versions = [chunk(10, SIZE), chunk(20, SIZE)]
    backend.write(key_of(1), versions[0])
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def worker(w):
            for r in range(30):
                if w == 0:
                    backend.write(key_of(1), versions[r % 2])
                else:
                    got = backend.read_into_many([key_of(1)] * 3, outs_for(*versions, versions[0]))
                    for g in got:
                        assert isinstance(g, Hit), g  # replaced atomically: always some whole version
                        assert any(torch.equal(g.value["k"], v["k"]) and torch.equal(g.value["v"], v["v"])
                                   for v in versions)
        run_threads(worker, 4)
    finally:
        sys.setswitchinterval(previous)


def test_buffer_views_follow_the_tensor_at_each_address(backend):
    """Views of caller buffers are cached by (address, length): buffers freed and allocated again at the same
    addresses, and other tensors over the same bytes, are still read into exactly."""
    data = [chunk(i, SIZE) for i in range(4)]
    write_all(backend, [(key_of(i), d) for i, d in enumerate(data)])
    keys = [key_of(i) for i in range(4)]
    for _ in range(6):  # fresh out tensors each round: the allocator reuses addresses
        outs = outs_for(*data)
        for got, d in zip(values(backend.read_into_many(keys, outs)), data, strict=True):
            assert_same(got, d)
        del outs, got
    big = torch.empty(SIZE, dtype=torch.uint8)  # views into one buffer, then the same bytes the other way round
    half = SIZE // 2
    for k_at, v_at in ((0, half), (half, 0)):
        out = {"k": big[k_at:k_at + half].view(torch.float32), "v": big[v_at:v_at + half].view(torch.float32)}
        assert_same(values(backend.read_into_many([keys[1]], [out]))[0], data[1])


# --------------------------------------------------------------------------- verify_reads: once
@pytest.mark.parametrize("size", [SIZE, file_reads.ONE_READ * 3])
def test_verify_once_skips_the_checksum_only_while_the_file_is_as_stamped(tmp_path, hashes, size):
    data = [chunk(i, size) for i in range(3)]
    keys = [key_of(i) for i in range(3)]
    with FileBackend(path=tmp_path / "d", verify_reads="once") as b:
        b._reads._fine_ctime = True  # as on Linux 6.13+ (the coarse case: the next test)
        write_all(b, list(zip(keys, data, strict=True)))
        hashes.clear()
        for got, d in zip(values(b.read_into_many(keys, outs_for(*data))), data, strict=True):
            assert_same(got, d)
        assert hashes == [], "a file this backend wrote is read without its checksum"
        path = b.object_path(keys[1])
        os.utime(path)  # any change through the file system moves the ctime: read and checked again
        for got, d in zip(values(b.read_into_many(keys, outs_for(*data))), data, strict=True):
            assert_same(got, d)
        assert len(hashes) == 1
        hashes.clear()
        values(b.read_into_many(keys, outs_for(*data)))
        assert hashes == [], "verified again, so stamped again"
        with open(path, "r+b") as f:  # damage in place, after the stamp
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        got = b.read_into_many(keys, outs_for(*data))
        assert isinstance(got[1], CorruptObjectError)
        assert_same(got[0].value, data[0])
        assert_same(got[2].value, data[2])
    with FileBackend(path=tmp_path / "d", verify_reads="once") as b:  # a new process verifies before it trusts
        b._reads._fine_ctime = True
        hashes.clear()
        values(b.read_into_many([keys[0]], outs_for(data[0])))
        assert len(hashes) == 1


def test_verify_once_trusts_a_coarse_ctime_only_once_it_has_settled(tmp_path, hashes, monkeypatch):
    """Where a change in the same clock tick keeps the ctime, a fresh file is checked on every read; one whose
    ctime is older than SETTLED_NS is stamped by its next verified read."""
    with FileBackend(path=tmp_path / "d", verify_reads="once") as b:
        b._reads._fine_ctime = False
        b.write(key_of(1), chunk(1, SIZE))
        hashes.clear()  # the write's own
        for _ in range(3):
            values(b.read_into_many([key_of(1)], outs_for(chunk(1, SIZE))))
        assert len(hashes) == 3, "a ctime of now is not trusted"
        monkeypatch.setattr(file_reads, "SETTLED_NS", 0)
        hashes.clear()
        for _ in range(3):
            assert_same(values(b.read_into_many([key_of(1)], outs_for(chunk(1, SIZE))))[0], chunk(1, SIZE))
        assert len(hashes) == 1


def test_verify_once_checks_again_after_its_own_mtime_refresh(tmp_path, hashes):
    """A hit refreshes an old mtime (the LRU order after a restart); that moves the ctime, so the stamp goes."""
    with FileBackend(path=tmp_path / "d", verify_reads="once") as b:
        b._reads._fine_ctime = True
        b.write(key_of(1), chunk(1, SIZE))
        b._reads._plans[key_of(1)].mtime_ns = 0  # due for a refresh
        hashes.clear()  # the write's own
        for _ in range(3):
            assert_same(values(b.read_into_many([key_of(1)], outs_for(chunk(1, SIZE))))[0], chunk(1, SIZE))
        assert len(hashes) == 1, "trusted, refreshed (stamp dropped), verified and stamped again"


def test_the_ctime_probe_matches_what_the_file_system_does(tmp_path):
    fine = file_reads.fine_ctime(str(tmp_path))
    assert os.listdir(tmp_path) == [], "the probe leaves nothing behind"
    p = tmp_path / "f"
    p.write_bytes(b"a")
    changed = 0
    for _ in range(20):
        before = os.stat(p).st_ctime_ns
        with open(p, "ab") as f:
            f.write(b"b")
        changed += os.stat(p).st_ctime_ns != before
    assert changed == 20 if fine else changed < 20, (fine, changed)
    assert file_reads.fine_ctime(str(tmp_path / "missing")) is False


def test_verify_reads_is_checked(tmp_path):
    from tierstore.errors import ConfigError

    with pytest.raises(ConfigError, match="verify_reads"):
        FileBackend(path=tmp_path / "d", verify_reads="sometimes")
