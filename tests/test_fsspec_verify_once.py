"""``verify_reads: once`` on a mount (a ``remote`` tier on ``file://``): a read skips the checksum of an object
this process wrote or verified only while its file is the one it stamped. Any change through the file system
(another writer's object linked or renamed into place, damage written in place, a ``utime``) is read and
checked again: exact bytes or a miss."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_fsspec_local_io import SIZE, aligned_rows, object_file, put
from test_sealing import write_keys

import tierstore
from tierstore.backends import file_reads
from tierstore.backends.fsspec import FsspecBackend
from tierstore.errors import ConfigError, CorruptObjectError
from tierstore.keyring import new_secret
from tierstore.testing.data import key_of


def mount(tmp_path, fine: bool = True, **options) -> FsspecBackend:
    b = FsspecBackend(url=f"file://{tmp_path}/kv", verify_reads="once", **options)
    assert b._stamps is not None
    b._stamps.fine_ctime = fine  # as on Linux 6.13+ (the coarse case has its own test)
    return b


def read(b: FsspecBackend, keys, rows: torch.Tensor) -> list:
    """Each key's object into a row of ``rows`` (page-aligned: read with O_DIRECT)."""
    return b.read_into_many(keys, [{"kv": rows[i]} for i in range(len(keys))])


def flip_last_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


def test_reads_skip_the_checksum_only_while_the_file_is_as_stamped(tmp_path, hashes):
    data = aligned_rows(3, SIZE)
    keys = [key_of(i) for i in range(3)]
    rows = aligned_rows(3, SIZE)
    with mount(tmp_path) as b:
        for k, d in zip(keys, data, strict=True):
            put(b, k, {"kv": d})
        hashes.clear()  # the writes' own
        assert [torch.equal(g.value["kv"], d) for g, d in zip(read(b, keys, rows), data, strict=True)] == [True] * 3
        assert hashes == [], "an object this process wrote is read without its checksum"
        os.utime(object_file(b, keys[1]))  # any change through the file system moves the ctime
        assert all(torch.equal(g.value["kv"], d) for g, d in zip(read(b, keys, rows), data, strict=True))
        assert len(hashes) == 1, "the touched one is checked again"
        hashes.clear()
        read(b, keys, rows)
        assert hashes == [], "verified, so stamped again"
        flip_last_byte(object_file(b, keys[1]))  # damage written in place, after the stamp
        got = read(b, keys, rows)
        assert isinstance(got[1], CorruptObjectError)
        assert torch.equal(got[0].value["kv"], data[0]) and torch.equal(got[2].value["kv"], data[2])
        assert isinstance(read(b, keys[1:2], rows)[0], CorruptObjectError), "never trusted again while damaged"
    with mount(tmp_path) as b:  # another process checks before it trusts
        hashes.clear()
        assert torch.equal(read(b, keys[:1], rows)[0].value["kv"], data[0])
        assert len(hashes) == 1
        hashes.clear()
        read(b, keys[:1], rows)
        assert hashes == []


def test_another_writers_object_renamed_into_place_is_checked(tmp_path, hashes):
    """Replaced with the same header and a damaged payload (the header digest still matches): a new inode, so
    the read checks it and it is a miss; replaced with another valid value: that value, checked."""
    data, rows = aligned_rows(2, SIZE), aligned_rows(1, SIZE)
    key = key_of(7)
    with mount(tmp_path) as b, FsspecBackend(url=f"file://{tmp_path}/other") as other:
        put(b, key, {"kv": data[0]})
        path = object_file(b, key)
        damaged = f"{path}.damaged"
        shutil.copyfile(path, damaged)
        flip_last_byte(damaged)
        os.replace(damaged, path)
        assert isinstance(read(b, [key], rows)[0], CorruptObjectError)
        put(other, key, {"kv": data[1]})  # another writer's valid object of the same key
        os.replace(object_file(other, key), path)
        hashes.clear()
        assert torch.equal(read(b, [key], rows)[0].value["kv"], data[1])
        assert len(hashes) == 1


def test_a_write_is_stamped_from_its_own_file_not_from_the_path(tmp_path, hashes, monkeypatch):
    """Another writer's object may land on the path between our link and our stamp: the stamp is our file's
    (its inode), so theirs is still checked, and theirs here is damaged."""
    data, rows = aligned_rows(1, SIZE), aligned_rows(1, SIZE)
    key = key_of(3)
    with mount(tmp_path) as b:
        real = FsspecBackend._put_in_place

        def racing(tmp: str, path: str, replace: bool) -> None:
            real(tmp, path, replace)
            damaged = f"{path}.theirs"
            shutil.copyfile(path, damaged)
            flip_last_byte(damaged)
            os.replace(damaged, path)  # lands after ours, before our stamp

        monkeypatch.setattr(FsspecBackend, "_put_in_place", staticmethod(racing))
        put(b, key, {"kv": data[0]})
        assert isinstance(read(b, [key], rows)[0], CorruptObjectError)


def test_a_coarse_ctime_is_trusted_only_once_it_has_settled(tmp_path, hashes, monkeypatch):
    """Where a change in the same clock tick keeps the ctime, a fresh file is checked on every read."""
    data, rows = aligned_rows(1, SIZE), aligned_rows(1, SIZE)
    key = key_of(1)
    with mount(tmp_path, fine=False) as b:
        put(b, key, {"kv": data[0]})
        hashes.clear()
        for _ in range(3):
            read(b, [key], rows)
        assert len(hashes) == 3, "a ctime of now is not trusted"
        monkeypatch.setattr(file_reads, "SETTLED_NS", 0)
        hashes.clear()
        for _ in range(3):
            assert torch.equal(read(b, [key], rows)[0].value["kv"], data[0])
        assert len(hashes) == 1


def test_through_the_store_a_flipped_byte_is_a_miss_and_the_next_put_replaces_it(tmp_path):
    data, rows = aligned_rows(1, SIZE), aligned_rows(1, SIZE)
    key = key_of(5)
    config = {"tiers": [{"kind": "remote", "url": f"file://{tmp_path}/kv", "verify_reads": "once"}]}
    with tierstore.open(config) as store:
        assert store.put_many([(key, {"kv": data[0]})]) == [True]
        assert torch.equal(store.get_many([key], out=[{"kv": rows[0]}])[0]["kv"], data[0])
        remote = store.tiers[0].backend
        flip_last_byte(object_file(remote, key))
        assert store.get_many([key], out=[{"kv": rows[0]}]) == [None]
        assert store.put_many([(key, {"kv": data[0]})]) == [True]
        assert torch.equal(store.get_many([key], out=[{"kv": rows[0]}])[0]["kv"], data[0])


@pytest.mark.parametrize("tier, message", [
    ({"url": "memory://kv", "verify_reads": "once"}, "needs a local or mounted path"),
    ({"url": "file://{tmp}/kv", "verify_reads": "once", "auth": "keys"}, "a sealed object's MAC"),
    ({"url": "file://{tmp}/kv", "verify_reads": "sometimes"}, "verify_reads"),
])
def test_a_verify_reads_that_cannot_hold_is_refused_at_open(tmp_path, tier, message):
    tier = {k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in tier.items()}
    if tier.get("auth") == "keys":
        tier["auth"] = {"keys_file": write_keys(tmp_path / "keys", {"k1": new_secret()})}
    with pytest.raises(ConfigError, match=message) as err:
        tierstore.open({"tiers": [{"kind": "remote", **tier}]})
    assert "verify_reads" in str(err.value)
