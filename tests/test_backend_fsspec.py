"""The ``remote`` backend (:class:`FsspecBackend`) over a real local S3 server (moto), a shared-mount directory
(file://) and memory://: the conformance suite, then what only a shared prefix does, at the backend and as the
shared tier of a store."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import tierstore
import tierstore.config
from tierstore.backends.base import Hit
from tierstore.backends.fsspec import FsspecBackend
from tierstore.backends.layout import object_relpath
from tierstore.errors import ConfigError, InvalidInputError
from tierstore.store import TieredStore
from tierstore.testing.backends import BackendTests
from tierstore.testing.data import assert_same, chunk, key_of
from tierstore.testing.s3 import free_port, local_s3

REPO = Path(__file__).resolve().parents[1]


def damage_object(fs, path: str, how: str) -> None:
    data = bytearray(fs.cat_file(path))
    if how == "flip":
        data[-1] ^= 0x10  # the last byte is payload for any non-empty chunk
    else:
        del data[-9:]
    fs.pipe_file(path, bytes(data))  # a plain overwrite, behind the backend's back


@pytest.fixture(scope="module")
def s3_prefix(s3_server):
    """A factory of fresh ``s3://`` prefixes in one bucket, and storage options that reuse one client."""
    bucket = s3_server.new_bucket()
    options = {k: v for k, v in s3_server.storage_options.items() if k != "skip_instance_cache"}
    return lambda: (f"s3://{bucket}/{uuid.uuid4().hex[:12]}", options)


def memory_url() -> str:
    return f"memory://tierstore-test-{uuid.uuid4().hex}"  # memory:// is process-global


def remove_memory(url: str) -> None:
    fs = fsspec.filesystem("memory")
    root = fsspec.core.url_to_fs(url)[1]
    if fs.exists(root):
        fs.rm(root, recursive=True)


def tier_stats(store: TieredStore, name: str = "remote") -> dict:
    return store.stats()["tiers"][name]


# --------------------------------------------------------------------------- conformance, three filesystems
class _FsspecBackendTests(BackendTests):
    persistent = True
    checksummed = True
    bounded = False  # a shared prefix has no per-process capacity (see test_remote_capacity_is_refused...)
    url: str
    storage_options: dict | None = None

    def make_backend(self, capacity):
        assert capacity is None
        return FsspecBackend(url=self.url, storage_options=self.storage_options)

    def reopen(self, backend):
        backend.close()
        return self.make_backend(None)

    def damage(self, backend, key, how):
        damage_object(backend.fs, backend._path(key), how)

    def overwrite(self, backend, key, data):
        backend.fs.pipe_file(backend._path(key), data)


class TestFsspecS3(_FsspecBackendTests):
    race_iterations = 20  # every operation is an HTTP round trip to moto

    @pytest.fixture(autouse=True)
    def _url(self, s3_prefix):
        self.url, self.storage_options = s3_prefix()


class TestFsspecSharedMount(_FsspecBackendTests):
    @pytest.fixture(autouse=True)
    def _url(self, tmp_path):
        self.url = (tmp_path / "mnt" / "kv").as_uri()


class TestFsspecMemory(_FsspecBackendTests):
    @pytest.fixture(autouse=True)
    def _url(self):
        self.url = memory_url()
        yield
        remove_memory(self.url)


# --------------------------------------------------------------------------- remote-specific behaviour
class Prefix:
    """One storage prefix; ``backend()`` opens another instance on it (as a second engine would), ``store()``
    a store whose only tier is such a backend."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url, self.storage_options = url, storage_options
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.opened: list = []

    def backend(self, **kw) -> FsspecBackend:
        b = FsspecBackend(url=self.url, storage_options=self.storage_options, **kw)
        self.opened.append(b)
        return b

    def store(self, **kw) -> TieredStore:
        s = TieredStore.from_backends([FsspecBackend(url=self.url, storage_options=self.storage_options, **kw)])
        self.opened.append(s)
        return s

    def path(self, key) -> str:
        return f"{self.root}/{object_relpath(key)}"

    def size(self, key) -> int:
        self.fs.invalidate_cache()
        return self.fs.info(self.path(key))["size"]


@pytest.fixture(params=["s3", "file", "memory"])
def prefix(request, tmp_path):
    if request.param == "s3":
        p = Prefix(*request.getfixturevalue("s3_prefix")())
    elif request.param == "file":
        p = Prefix((tmp_path / "mnt" / "kv").as_uri())
    else:
        p = Prefix(memory_url())
    yield p
    for opened in p.opened:
        opened.close()
    if request.param == "memory":
        remove_memory(p.url)


def count_uploads(monkeypatch, backend: FsspecBackend) -> list[str]:
    """Every upload ``backend`` makes from now on (create-only publishes and replacements), by kind."""
    uploads: list[str] = []
    for name in ("_publish", "_publish_local", "_replace"):
        real = getattr(backend, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            uploads.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(backend, name, counted)
    return uploads


def test_second_instance_sees_new_objects_without_reopen(prefix):
    a = prefix.store()  # listed the prefix while it was empty
    b = prefix.backend()
    assert not a.contains(key_of(1)) and a.get(key_of(1)) is None  # a miss is not remembered ...
    b.write(key_of(1), chunk(1))
    assert a.contains(key_of(1))  # ... so a later lookup finds b's object
    assert_same(a.get(key_of(1)), chunk(1))
    st = tier_stats(a)
    assert st["objects"] == 1 and st["used_bytes"] == prefix.size(key_of(1))
    got = a.get_many([key_of(2), key_of(1)])  # batched reads ask the prefix too
    assert got[0] is None
    assert_same(got[1], chunk(1))
    # the backend alone: a miss is never remembered either
    assert b.stat_many([key_of(2)]) == [None] and b.read(key_of(2)) is None
    prefix.backend().write(key_of(2), chunk(2))
    assert b.stat_many([key_of(2)]) == [prefix.size(key_of(2))]
    assert_same(b.read(key_of(2)), chunk(2))


def test_a_write_replaces_another_value_and_uploads_nothing_for_the_same_one(prefix, monkeypatch):
    """Review #7: the remote kept a key's first value, so an overwritten key read back its older value."""
    a, b = prefix.backend(), prefix.backend()
    uploads = count_uploads(monkeypatch, b)
    k = key_of(5)
    a.write(k, chunk(1))
    b.write(k, chunk(1))  # the same value: its checksum matches, nothing is uploaded
    assert uploads == []
    b.write(k, chunk(2, 8192))  # another value: replaced in one atomic step
    assert_same(a.read(k), chunk(2, 8192))
    assert len(uploads) >= 1
    # a write racing another writer's publish of another value: its create-only publish finds the key taken
    # after its check found it free; ours is the newer write, it replaces theirs
    real_checksum = b._stored_checksum
    first = []

    def raced(path):
        if not first:
            first.append(path)
            if b._async:  # on the event loop: the other writer's blocking write runs on a thread
                async def publish_then_none():
                    await asyncio.to_thread(a.write, k, chunk(4))

                return publish_then_none()
            a.write(k, chunk(4))  # the other writer publishes right after our check
            return None
        return real_checksum(path)

    monkeypatch.setattr(b, "_stored_checksum", raced)
    uploads.clear()
    b.write(k, chunk(3))
    assert first and "_replace" in uploads
    assert_same(a.read(k), chunk(3))
    monkeypatch.setattr(b, "_stored_checksum", real_checksum)
    assert a.failures.counts() == b.failures.counts() == {}
    # the same new key many times in one batch: every write succeeds ...
    k2 = key_of(6)
    prepared = b.prepare(k2, chunk(6))
    assert b.write_many([(k2, prepared)] * 6) == [None] * 6
    assert_same(a.read(k2), chunk(6))
    # ... and through a store, accounted once
    s = prefix.store()
    assert s.put_many([(key_of(7), chunk(7))] * 6) == [True] * 6
    st = tier_stats(s)
    assert st["objects"] == 3 and st["reserved_bytes"] == 0 and st["errors"] == 0
    assert st["used_bytes"] == sum(prefix.size(key_of(i)) for i in (5, 6, 7))


def test_compression_roundtrip_and_smaller(prefix):
    z = prefix.backend(compression="zstd")
    plain = prefix.backend(list_on_open=False)
    value = {"k": torch.zeros(16384), "v": torch.arange(16384, dtype=torch.int32).remainder(7)}
    prepared = z.prepare(key_of(1), value)
    assert z.write_many([(key_of(1), prepared)]) == [None]
    plain.write(key_of(2), value)
    assert_same(z.read(key_of(1)), value)
    assert prefix.size(key_of(1)) * 10 < prefix.size(key_of(2))
    assert prepared.size == prefix.size(key_of(1)) == z.stat_many([key_of(1)])[0]
    (hit,) = z.read_many([key_of(1)])
    assert isinstance(hit, Hit) and hit.size == prefix.size(key_of(1))
    # objects are self-describing: either backend reads both codecs
    assert_same(plain.read(key_of(1)), value)
    assert_same(z.read(key_of(2)), value)
    random = chunk(3, 1 << 16)  # incompressible data still round-trips
    z.write(key_of(3), random)
    assert_same(plain.read(key_of(3)), random)
    # a store over the zstd backend counts what it stored
    s = TieredStore.from_backends([FsspecBackend(url=prefix.url, storage_options=prefix.storage_options,
                                                 compression="zstd")])
    prefix.opened.append(s)
    assert tier_stats(s)["used_bytes"] == sum(prefix.size(key_of(i)) for i in (1, 2, 3))


def test_batched_io_is_concurrent_and_bounded():
    peak, active, lock = [0], [0], threading.Lock()

    class Slow(FsspecBackend):
        def _slow(self, fn, *args):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                time.sleep(0.05)
                return fn(*args)
            finally:
                with lock:
                    active[0] -= 1

        def _read(self, path):
            return self._slow(super()._read, path)

        def _publish(self, path, data):
            return self._slow(super()._publish, path, data)

    url = memory_url()
    try:
        with Slow(url=url, max_in_flight=4) as b:
            items = [(key_of(i), chunk(i)) for i in range(16)]
            assert b.write_many([(k, b.prepare(k, v)) for k, v in items]) == [None] * 16
            assert 1 < peak[0] <= 4  # overlapping, and bounded by max_in_flight
            peak[0] = 0
            got = b.read_many([k for k, _ in items])
            assert 1 < peak[0] <= 4
            for (_, value), result in zip(items, got, strict=True):
                assert isinstance(result, Hit)
                assert_same(result.value, value)
        with TieredStore.from_backends([Slow(url=url, max_in_flight=4)]) as s:  # a store's batches too
            more = [(key_of(i), chunk(i)) for i in range(16, 32)]
            peak[0] = 0
            assert s.put_many(more) == [True] * 16
            assert 1 < peak[0] <= 4
            peak[0] = 0
            for (_, value), result in zip(more + items, s.get_many([k for k, _ in more + items]), strict=True):
                assert_same(result, value)
            assert 1 < peak[0] <= 4
            st = tier_stats(s)
            assert st["hits"] == 32 and st["puts"] == 16 and st["errors"] == 0
    finally:
        remove_memory(url)


def test_shared_mount_publish_is_atomic_and_listing_ignores_junk(tmp_path):
    root = tmp_path / "kv"
    p = Prefix(root.as_uri())
    b = p.backend()
    for i in range(5):
        b.write(key_of(i), chunk(i))
    files = sorted(f.name for f in root.rglob("*") if f.is_file())
    assert len(files) == 5 and all(f.endswith(".tso") for f in files)  # no temp files left behind
    # a writer that died mid-write leaves a temp file; stray files are not objects either
    hexkey = key_of(9).hex()
    (root / hexkey[:2]).mkdir(exist_ok=True)
    (root / hexkey[:2] / f"{hexkey}.tso.deadbeef.tmp").write_bytes(b"partial")
    (root / "README").write_text("not an object")
    b.close()
    b2 = p.backend()
    assert sorted(f.key.hex() for f in b2.list()) == sorted(key_of(i).hex() for i in range(5))
    assert b2.stat_many([key_of(9)]) == [None] and b2.read(key_of(9)) is None
    s = p.store()
    assert sorted(k.hex() for k in s.residency.keys(s.tier("remote").index)) == sorted(
        key_of(i).hex() for i in range(5))
    assert not s.contains(key_of(9))


def test_bad_configuration_is_a_config_error(tmp_path):
    for url in ("nosuchscheme://bucket/kv", "", None):
        with pytest.raises(ConfigError, match=re.escape(repr(url))):
            FsspecBackend(url=url)
    with pytest.raises(ConfigError, match="compression"):
        FsspecBackend(url=memory_url(), compression="lz4")
    with pytest.raises(ConfigError, match="max_in_flight"):
        FsspecBackend(url=memory_url(), max_in_flight=0)
    with pytest.raises(ConfigError, match="storage_options"):
        FsspecBackend(url=memory_url(), storage_options=["endpoint"])
    assert not any(tmp_path.iterdir())


def tier_reports(caplog) -> list[str]:
    """What the remote tier logged (the store also warns for each put no tier took: that is per call)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("tier remote:")]


def test_unreachable_endpoint_degrades(caplog):
    caplog.set_level(logging.WARNING, logger="tierstore")
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "testing", "secret": "testing",
               "skip_instance_cache": True,
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    start = time.monotonic()
    backend = FsspecBackend(url="s3://unreachable/kv", storage_options=options)
    with TieredStore.from_backends([backend]) as s:  # the listing at open fails: an empty index
        assert tier_stats(s)["objects"] == 0
        assert s.put(key_of(0), chunk(0)) is False
        assert s.get(key_of(0)) is None
        assert s.put_many([(key_of(1), chunk(1)), (key_of(2), chunk(2))]) == [False, False]
        assert s.get_many([key_of(1), key_of(2)]) == [None, None]
        assert s.contains_many([key_of(3), key_of(4)]) == [False, False]
        reported = len(tier_reports(caplog))
        assert reported >= 4  # down, list, write, read, lookup
        assert s.put(key_of(0), chunk(0)) is False
        # the backend alone: each item's result says why, nothing raises
        (err,) = backend.write_many([(key_of(5), backend.prepare(key_of(5), chunk(5)))])
        assert isinstance(err, OSError)
        (got,) = backend.read_many([key_of(5)])
        assert isinstance(got, OSError)
        assert backend.stat_many([key_of(5)]) == [None]
        stats = tier_stats(s)
    assert len(tier_reports(caplog)) == reported  # logged once per kind of failure, not per call
    assert stats["errors"] == 7 and stats["misses"] == 3 and stats["puts"] == 0, stats  # 4 writes, 3 reads
    assert stats["failures"].get("list") == 1 and stats["failures"].get("probe", 0) >= 2, stats["failures"]
    assert stats["used_bytes"] == 0 and stats["reserved_bytes"] == 0
    assert time.monotonic() - start < 30


def test_failing_storage_fails_fast_then_recovers(monkeypatch):
    url = memory_url()
    backend = FsspecBackend(url=url)
    with TieredStore.from_backends([backend]) as s:
        backend.storage.retry_after = 0.5  # long enough that a loaded machine still calls again inside it
        assert s.put(key_of(0), chunk(0))
        calls = []
        real_cat = backend.fs.cat_file

        def broken(*args, **kwargs):
            calls.append(args)
            raise ConnectionResetError("connection reset by peer")

        monkeypatch.setattr(backend.fs, "cat_file", broken)
        assert s.get(key_of(0)) is None and len(calls) == 1
        assert s.get(key_of(0)) is None and len(calls) == 1  # backing off: no request at all
        assert s.put(key_of(1), chunk(1)) is False
        st = tier_stats(s)
        assert st["errors"] >= 3 and st["corrupt"] == 0 and st["backoff_s"] > 0
        assert s.holders(key_of(0)) == ["remote"]  # the index entry survives the outage
        monkeypatch.setattr(backend.fs, "cat_file", real_cat)
        time.sleep(0.6)
        assert_same(s.get(key_of(0)), chunk(0))
        assert s.put(key_of(1), chunk(1))
        assert tier_stats(s)["backoff_s"] == 0
    remove_memory(url)


def test_filesystem_without_create_mode(monkeypatch):
    url = memory_url()
    with FsspecBackend(url=url) as b:
        real_pipe = b.fs.pipe_file
        monkeypatch.setattr(b.fs, "pipe_file", lambda path, value: real_pipe(path, value))  # an older fs
        b.write(key_of(0), chunk(0))
        b.write(key_of(0), chunk(1))  # exists with another value: checked first, then replaced
        assert_same(b.read(key_of(0)), chunk(1))
        b.write(key_of(2), chunk(2))  # a new key after the fallback: checked, then written
        assert_same(b.read(key_of(2)), chunk(2))
        assert b.failures.counts() == {"create-mode": 1}  # a note, no failure
    remove_memory(url)


def test_cuda_device_read():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    url = memory_url()
    with FsspecBackend(url=url) as b:
        b.write(key_of(0), chunk(0))
        got = b.read(key_of(0), device="cuda")
        assert got["k"].is_cuda
        assert_same({k: v.cpu() for k, v in got.items()}, chunk(0))
        (hit,) = b.read_many([key_of(0)], device="cuda:0")
        assert isinstance(hit, Hit) and hit.value["v"].is_cuda
    remove_memory(url)


CHILD = r"""
import json, sys
from tierstore.testing.data import chunk, key_of
from tierstore.backends.fsspec import FsspecBackend

out = []
for url, options in json.loads(sys.argv[1]):
    with FsspecBackend(url=url, storage_options=options, list_on_open=False) as b:
        got = b.read(key_of(1))
        seen = got is not None and all(got[n].equal(v) for n, v in chunk(1).items())
        uploaded = set()
        for name in ("_publish", "_publish_local", "_replace"):
            def counted(path, *a, _real=getattr(b, name), **kw):
                uploaded.add(next(i for i in (1, 2, 3) if path.startswith(b._path(key_of(i)))))
                return _real(path, *a, **kw)
            setattr(b, name, counted)
        errors = b.write_many([(key_of(1), b.prepare(key_of(1), chunk(7))),  # another value: replaces it
                               (key_of(2), b.prepare(key_of(2), chunk(2)))])
        same = b.write_many([(key_of(3), b.prepare(key_of(3), chunk(3)))])  # the same value: nothing uploaded
        out.append({"seen": seen, "errors": [repr(e) for e in errors + same if e is not None],
                    "uploaded": sorted(uploaded), "failures": b.failures.counts()})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_share_a_prefix(s3_prefix, tmp_path):
    prefixes = [Prefix(*s3_prefix()), Prefix((tmp_path / "nfs" / "kv").as_uri())]
    stores = [p.store() for p in prefixes]
    for s in stores:
        assert s.put(key_of(1), chunk(1)) and s.put(key_of(3), chunk(3))
    arg = json.dumps([[p.url, p.storage_options] for p in prefixes])
    proc = subprocess.run([sys.executable, "-c", CHILD, arg], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for report in json.loads(proc.stdout):
        assert report["seen"] and report["errors"] == [] and report["failures"] == {}, report
        assert report["uploaded"] == [1, 2], report  # key 1 replaced, key 2 published, key 3 left as it was
    for p, s in zip(prefixes, stores, strict=True):
        assert s.contains(key_of(2))  # published by the other process, found without reopening
        assert_same(s.get(key_of(2)), chunk(2))
        assert_same(s.get(key_of(1)), chunk(7))  # the child's later write replaced our value
        assert_same(s.get(key_of(3)), chunk(3))
        st = tier_stats(s)
        assert st["used_bytes"] == sum(p.size(key_of(i)) for i in (1, 2, 3))
        assert st["errors"] == st["corrupt"] == 0


def test_remove_stale_temp_removes_only_our_temp_names(prefix):
    """Probe 8.9: gc deleted a foreign ``exports/nightly.tmp`` under a shared prefix (any ``*.tmp``)."""
    b = prefix.backend()
    b.write(key_of(0), chunk(0))
    hexkey = key_of(1).hex()
    ours = f"{prefix.root}/{hexkey[:2]}/{hexkey}.tso.{uuid.uuid4().hex}.tmp"  # what _publish_local writes
    foreign = [f"{prefix.root}/exports/nightly.tmp",                       # someone else's file
               f"{prefix.root}/{hexkey[:2]}/{hexkey}.tso.0123abcd.tmp",  # not our uuid form
               f"{prefix.root}/00/{hexkey}.tso.{uuid.uuid4().hex}.tmp",  # not in its key's folder
               f"{prefix.root}/{hexkey[:2]}/notes.tmp"]
    for path in [ours, *foreign]:
        prefix.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        prefix.fs.pipe_file(path, b"partial object of a writer that died")
    assert b.remove_stale_temp(older_than=3600) == 0  # young: a live writer may still own it
    assert prefix.fs.exists(ours)
    time.sleep(0.05)
    assert b.remove_stale_temp(older_than=0) == 1
    prefix.fs.invalidate_cache()
    assert not prefix.fs.exists(ours)
    assert all(prefix.fs.exists(path) for path in foreign)
    assert_same(b.read(key_of(0)), chunk(0))  # objects are never temp files
    with pytest.raises(InvalidInputError):
        b.remove_stale_temp(older_than=-1)


def test_stale_temp_gc_never_follows_a_symlink(tmp_path):
    p = Prefix((tmp_path / "kv").as_uri())
    b = p.backend()
    hexkey = key_of(1).hex()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / f"{hexkey}.tso.{uuid.uuid4().hex}.tmp"
    victim.write_bytes(b"not under the prefix")
    (tmp_path / "kv").mkdir(exist_ok=True)
    (tmp_path / "kv" / hexkey[:2]).symlink_to(outside, target_is_directory=True)
    time.sleep(0.05)
    assert b.remove_stale_temp(older_than=0) == 0
    assert victim.exists()


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_write_of_the_same_value_heals_an_object_a_read_found_damaged(prefix, how):
    """A damaged payload (or a cut-off tail) keeps the header, and with it the checksum of the value it was: a
    write that trusted it would find "this value is there already" and acknowledge, leaving the damage."""
    b = prefix.backend()
    b.write(key_of(0), chunk(0))
    damage_object(prefix.fs, prefix.path(key_of(0)), how)
    (got,) = b.read_many([key_of(0)])
    assert isinstance(got, tierstore.CorruptObjectError)
    b.write(key_of(0), chunk(0))
    assert_same(prefix.backend(list_on_open=False).read(key_of(0)), chunk(0))  # healed for every reader
    # through a store: the get that finds it damaged, then the put that heals it
    s = prefix.store()
    damage_object(prefix.fs, prefix.path(key_of(0)), how)
    assert s.get(key_of(0)) is None and tier_stats(s)["corrupt"] >= 1
    assert s.put(key_of(0), chunk(0))
    assert_same(s.get(key_of(0)), chunk(0))
    assert_same(prefix.backend(list_on_open=False).read(key_of(0)), chunk(0))


def test_a_failed_read_of_an_indexed_key_is_one_request_and_one_count(s3_server, shim):
    """A store that listed the prefix at open reads a damaged, an unsupported and a vanished object: each is
    one GET and one counted miss (not asked again as a key no index holds, within the same get), and the index
    forgets them (a reader never deletes on a shared prefix)."""
    from tierstore.testing.data import unsupported_object

    url = f"s3://{s3_server.new_bucket()}/kv"
    direct = s3_server.storage_options
    keys = [key_of(i) for i in range(4)]
    with FsspecBackend(url=url, storage_options=direct) as writer:
        assert writer.write_many([(k, writer.prepare(k, chunk(i))) for i, k in enumerate(keys)]) == [None] * 4
        damage_object(writer.fs, writer._path(keys[0]), "flip")
        writer.fs.pipe_file(writer._path(keys[1]), unsupported_object(keys[1], "version"))
        shim.set_fault("pass")
        with TieredStore.from_backends([FsspecBackend(url=url, storage_options=shim.storage_options(direct))]) as s:
            assert tier_stats(s)["objects"] == 4  # listed at open
            writer.delete(keys[2])  # gone since the listing (another instance's gc)
            shim.reset()
            got = s.get_many(keys)
            assert got[:3] == [None] * 3
            assert_same(got[3], chunk(3))
            assert shim.stats()["by_method"] == {"GET": 4}
            st = tier_stats(s)
            assert (st["corrupt"], st["unsupported"], st["misses"], st["hits"]) == (1, 1, 3, 1), st
            assert [s.holders(k) for k in keys] == [[], [], [], ["remote"]]


def test_check_objects_repairs_only_what_is_damaged(prefix):
    """``tierstore verify`` on a shared prefix (what ``Tier.verify_many`` did): it reads every object once; with
    ``repair`` it removes the damaged ones only — one this reader cannot represent stays, for readers that can."""
    from tierstore.admin import Persistent, check_objects
    from tierstore.testing.data import unsupported_object

    b = prefix.backend()
    keys = [key_of(i) for i in range(5)]
    assert b.write_many([(k, b.prepare(k, chunk(i))) for i, k in enumerate(keys)]) == [None] * 5
    damage_object(prefix.fs, prefix.path(keys[1]), "flip")
    damage_object(prefix.fs, prefix.path(keys[2]), "truncate")
    prefix.fs.pipe_file(prefix.path(keys[3]), unsupported_object(keys[3], "version"))
    tier = Persistent("remote", "remote", None, b)
    expected = {"objects": 5, "ok": 2, "corrupt": 2, "unsupported": 1, "forged": 0, "missing": 0, "unreadable": 0}
    assert check_objects(tier, repair=False) == {**expected, "removed": 0}
    assert b.stat_many(keys).count(None) == 0  # verify alone removes nothing
    assert check_objects(tier, repair=True) == {**expected, "removed": 2}
    assert [size is not None for size in b.stat_many(keys)] == [True, False, False, True, True]
    assert check_objects(tier, repair=True) == {**expected, "objects": 3, "corrupt": 0, "removed": 0}
    b.write(keys[1], chunk(1))  # a fresh write after the repair
    assert_same(b.read(keys[1]), chunk(1))


def test_a_store_over_backends_never_bounds_a_shared_prefix(prefix):
    """Review C5 again, through ``from_backends``: a capacity given for a shared tier must be refused or
    ignored, never enforced by deleting objects other writers published."""
    first = prefix.store()
    for i in range(8):
        assert first.put(key_of(i), chunk(i, 8000))
    try:
        s = TieredStore.from_backends([(FsspecBackend(url=prefix.url, storage_options=prefix.storage_options),
                                        3 * 8192)])
    except ConfigError:
        return
    prefix.opened.append(s)
    for i in range(8, 12):
        assert s.put(key_of(i), chunk(i, 8000))
    backend = first.tier("remote").backend
    assert backend.stat_many([key_of(i) for i in range(12)]).count(None) == 0
    assert tier_stats(s)["evictions"] == 0


def test_remote_capacity_is_refused_and_writers_never_delete_each_other(prefix):
    """Review C5: probes overfilled a bounded remote index, and the next put evicted (deleted) the objects
    another writer had just published. A shared prefix has no per-process capacity."""
    with pytest.raises(ConfigError, match="lifecycle"):
        prefix.backend(capacity=3 * 8192)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.capacity.*lifecycle"):
        tierstore.config.parse_config({"tiers": [{"kind": "host", "capacity": "1MiB"},
                                                 {"kind": "remote", "url": memory_url(), "capacity": "1GiB"}]})
    first, second = prefix.store(), prefix.store()
    for i in range(8):
        assert first.put(key_of(i), chunk(i, 8000))
    assert second.contains_many([key_of(i) for i in range(8)]) == [True] * 8  # lookups index them
    assert tier_stats(second)["objects"] == 8
    for i in range(8, 24):
        assert second.put(key_of(i), chunk(i, 8000))
    prefix.fs.invalidate_cache()
    assert all(prefix.fs.exists(prefix.path(key_of(i))) for i in range(24))
    for s in (first, second):
        st = tier_stats(s)
        assert st["capacity_bytes"] is None and st["evictions"] == 0


def test_remove_older_than_bounds_a_shared_prefix_by_age(prefix):
    s = prefix.store()
    for i in range(3):
        assert s.put(key_of(i), chunk(i))
    b = s.tier("remote").backend
    foreign = f"{prefix.root}/exports/model.bin"
    prefix.fs.makedirs(f"{prefix.root}/exports", exist_ok=True)
    prefix.fs.pipe_file(foreign, b"someone else's")
    assert b.remove_older_than(3600) == 0
    time.sleep(0.05)
    assert b.remove_older_than(0) == 3
    prefix.fs.invalidate_cache()
    assert prefix.fs.exists(foreign) and list(b.list()) == []
    # a store whose index still names them gets misses (never an exception) and forgets them
    assert s.get_many([key_of(i) for i in range(3)]) == [None] * 3
    st = tier_stats(s)
    assert st["objects"] == 0 and st["used_bytes"] == 0 and st["errors"] == 0
    with pytest.raises(InvalidInputError):
        b.remove_older_than(float("nan"))


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1/kv", "s3://bucket:notaport/kv", "memory://kv\0x"])
def test_malformed_url_is_a_config_error_at_open(url, tmp_path):
    """Probe 4.18: ``http://[::1`` opened, and then every listing and put failed with logged errors."""
    with pytest.raises(ConfigError, match="url"):
        FsspecBackend(url=url)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url"):
        tierstore.open({"tiers": [{"kind": "remote", "url": url}]})
    with pytest.raises(ConfigError, match="endpoint_url"):
        tierstore.config.parse_config({"tiers": [{"kind": "remote", "url": memory_url(),
                                                  "storage_options": {"endpoint_url": url}}]})


def test_config_and_backend_accept_the_same_urls():
    """Review A.7: the two URL checks diverged (``simplecache::memory://`` passed one, failed the other)."""
    for url in (f"simplecache::{memory_url()}", memory_url(), "file:///tmp/kv", "/tmp/kv"):
        tierstore.config.parse_config({"tiers": [{"kind": "remote", "url": url}]})
        FsspecBackend(url=url, list_on_open=False).close()
    for url in ("nosuch://x", "simplecache::nosuch://x"):
        with pytest.raises(ConfigError):
            tierstore.config.parse_config({"tiers": [{"kind": "remote", "url": url}]})
        with pytest.raises(ConfigError):
            FsspecBackend(url=url)


def test_local_s3_leaves_the_environment_alone(monkeypatch):
    """Review A.8: starting the test server set AWS_ACCESS_KEY_ID=testing for the rest of the process."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    with local_s3() as server:
        assert dict(os.environ) == before
        fs = server.filesystem()  # credentials travel in storage_options
        bucket = server.new_bucket()
        fs.pipe_file(f"{bucket}/x", b"x")
        assert fs.cat_file(f"{bucket}/x") == b"x"
