"""The disk tier's batched read path (get_many_into): exact bytes straight into out buffers, the
remembered-header fast path never serving a replaced or damaged object, errors isolated per key."""

import os
import sys

import pytest
import torch

from tierstore import objformat
from tierstore.errors import InvalidInputError
from tierstore.testing.data import assert_same, chunk, key_of, run_threads
from tierstore.tiers import objfile
from tierstore.tiers.disk import DiskTier

SIZE = 64 << 10


@pytest.fixture
def tier(tmp_path):
    with DiskTier(path=tmp_path / "disk", io_threads=3) as t:
        yield t


def outs_for(*chunks):
    return [{n: torch.empty_like(v) for n, v in c.items()} for c in chunks]


def test_batch_is_exact_and_reuses_remembered_headers(tier):
    data = [chunk(i, SIZE) for i in range(10)]
    assert all(tier.put_many([(key_of(i), d) for i, d in enumerate(data)]))
    keys = [key_of(i) for i in range(10)] + [key_of(99), key_of(3)]
    for _ in range(2):  # the second pass plans every read from the remembered headers
        outs = outs_for(*data, data[0], data[3])
        got = tier.get_many_into(keys, outs)
        assert got[10] is None
        for i in (*range(10), 11):
            assert_same(got[i], data[3] if i == 11 else data[i])
            assert got[i]["k"].data_ptr() == outs[i]["k"].data_ptr()
    assert len(tier._batched._plans) == 10
    assert tier.stats()["pinned"] == 0


def test_reads_are_planned_from_the_write_and_after_a_restart_from_the_first_verified_read(tmp_path, monkeypatch):
    parsed = []
    real = objfile.read_header
    monkeypatch.setattr(objfile, "read_header", lambda *a, **kw: parsed.append(a[2]) or real(*a, **kw))
    headers_parsed = []
    real_parse = objformat.parse_header
    monkeypatch.setattr(objformat, "parse_header", lambda *a, **kw: headers_parsed.append(1) or real_parse(*a, **kw))
    data = [chunk(i, SIZE) for i in range(4)]
    keys = [key_of(i) for i in range(4)]
    with DiskTier(path=tmp_path / "d", io_threads=2) as t:
        t.put_many(list(zip(keys, data, strict=True)))
        for got, d in zip(t.get_many_into(keys, outs_for(*data)), data, strict=True):
            assert_same(got, d)
        assert parsed == [] and headers_parsed == []  # planned from the encoding: not even the writer parses
    with DiskTier(path=tmp_path / "d", io_threads=2) as t:
        for _ in range(2):
            for got, d in zip(t.get_many_into(keys, outs_for(*data)), data, strict=True):
                assert_same(got, d)
        assert sorted(parsed, key=lambda k: k.hex()) == sorted(keys, key=lambda k: k.hex())  # once each


def test_an_object_replaced_behind_the_tiers_back_is_read_again_not_misjudged(tier):
    tier.put(key_of(1), chunk(1, SIZE))  # planned from the write
    path = tier.object_path(key_of(1))
    with open(path + ".new", "wb") as f:  # same names and shapes and size: only the bytes differ
        f.write(objformat.encode(key_of(1), chunk(2, SIZE)).tobytes())
    os.replace(path + ".new", path)
    got = tier.get_many_into([key_of(1)], outs_for(chunk(2, SIZE)))[0]
    assert_same(got, chunk(2, SIZE))
    assert tier.stats()["corrupt"] == 0


def test_a_replaced_object_is_read_again_not_misjudged(tier):
    tier.put(key_of(1), chunk(1, SIZE))
    tier.get_many_into([key_of(1)], outs_for(chunk(1, SIZE)))  # header remembered
    tier.put(key_of(1), chunk(2, SIZE))  # same names and shapes: only the checksum differs
    got = tier.get_many_into([key_of(1)], outs_for(chunk(2, SIZE)))[0]
    assert_same(got, chunk(2, SIZE))
    assert tier.stats()["corrupt"] == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "symlink", "fifo", "directory"])
def test_a_damaged_object_is_a_counted_miss_and_the_rest_of_the_batch_is_served(tier, tmp_path, damage):
    data = [chunk(i, SIZE) for i in range(3)]
    tier.put_many([(key_of(i), d) for i, d in enumerate(data)])
    tier.get_many_into([key_of(i) for i in range(3)], outs_for(*data))  # headers remembered
    path = tier.object_path(key_of(1))
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
    got = tier.get_many_into([key_of(i) for i in range(3)], outs_for(*data))
    assert got[1] is None
    assert_same(got[0], data[0])
    assert_same(got[2], data[2])
    assert tier.stats()["corrupt"] == 1
    assert not tier.contains(key_of(1))
    if damage == "symlink":  # never followed: the link goes, what it points to stays
        assert (tmp_path / "elsewhere").exists()


def test_a_mismatched_out_is_an_error_for_that_key_only(tier):
    tier.put_many([(key_of(1), chunk(1, SIZE)), (key_of(2), chunk(2, SIZE))])
    for _ in range(2):  # with and without a remembered header
        outs = outs_for(chunk(1, SIZE), chunk(2, SIZE))
        outs[0]["k"] = torch.empty(7)
        got = tier.get_many_into([key_of(1), key_of(2)], outs)
        assert isinstance(got[0], InvalidInputError)
        assert_same(got[1], chunk(2, SIZE))
        assert tier.contains(key_of(1))  # a caller's mistake never removes the object


def test_bfloat16_and_compressed_objects(tmp_path):
    data = {"k": torch.randn(3, 1000).to(torch.bfloat16), "idx": torch.arange(77, dtype=torch.int64)}
    for codec in ("none", "zstd"):
        with DiskTier(path=tmp_path / codec, codec=codec, io_threads=2) as t:
            t.put(key_of(1), data)
            for _ in range(2):
                got = t.get_many_into([key_of(1), key_of(1)], outs_for(data, data))
                assert_same(got[0], data)
                assert_same(got[1], data)


def test_reads_racing_overwrites_see_one_version_whole(tier):
    versions = [chunk(10, SIZE), chunk(20, SIZE)]
    tier.put(key_of(1), versions[0])
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def worker(w):
            for r in range(30):
                if w == 0:
                    tier.put(key_of(1), versions[r % 2])
                else:
                    got = tier.get_many_into([key_of(1)] * 3, outs_for(*versions, versions[0]))
                    for g in got:
                        assert g is not None  # replaced atomically: always some whole version
                        assert any(torch.equal(g["k"], v["k"]) and torch.equal(g["v"], v["v"]) for v in versions)
        run_threads(worker, 4)
    finally:
        sys.setswitchinterval(previous)
    assert tier.stats()["corrupt"] == 0


def test_buffer_views_follow_the_tensor_at_each_address(tier):
    """Views of caller buffers are cached by (address, length): buffers freed and allocated again at the same
    addresses, and other tensors over the same bytes, are still read into exactly."""
    data = [chunk(i, SIZE) for i in range(4)]
    assert all(tier.put_many([(key_of(i), d) for i, d in enumerate(data)]))
    keys = [key_of(i) for i in range(4)]
    for _ in range(6):  # fresh out tensors each round: the allocator reuses addresses
        outs = outs_for(*data)
        for got, d in zip(tier.get_many_into(keys, outs), data, strict=True):
            assert_same(got, d)
        del outs, got
    big = torch.empty(SIZE, dtype=torch.uint8)  # views into one buffer, then the same bytes the other way round
    half = SIZE // 2
    for k_at, v_at in ((0, half), (half, 0)):
        out = {"k": big[k_at:k_at + half].view(torch.float32), "v": big[v_at:v_at + half].view(torch.float32)}
        assert_same(tier.get_many_into([keys[1]], [out])[0], data[1])
