"""The remote tier over a real local S3 server (moto), a shared-mount directory (file://) and memory://."""

from __future__ import annotations

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
from tierstore.errors import ConfigError, InvalidInputError
from tierstore.testing.s3 import free_port, local_s3
from tierstore.testing.data import TierTests, assert_same, chunk, key_of
from tierstore.tiers.layout import object_relpath
from tierstore.tiers.remote import RemoteTier

REPO = Path(__file__).resolve().parents[1]


def damage_object(fs, path: str, how: str) -> None:
    data = bytearray(fs.cat_file(path))
    if how == "flip":
        data[-1] ^= 0x10  # the last byte is payload for any non-empty chunk
    else:
        del data[-9:]
    fs.pipe_file(path, bytes(data))  # a plain overwrite, behind the tier's back


@pytest.fixture(scope="module")
def s3_prefix(s3_server):
    """A factory of fresh ``s3://`` prefixes in one bucket, and storage options that reuse one client."""
    bucket = s3_server.new_bucket()
    options = {k: v for k, v in s3_server.storage_options.items() if k != "skip_instance_cache"}
    return lambda: (f"s3://{bucket}/{uuid.uuid4().hex[:12]}", options)


def memory_url() -> str:
    return f"memory://tierstore-test-{uuid.uuid4().hex}"  # memory:// is process-global


# --------------------------------------------------------------------------- conformance, three backends
class _RemoteTierTests(TierTests):
    persistent = True
    checksummed = True
    bounded = False
    url: str
    storage_options: dict | None = None

    def make_tier(self, capacity):
        return RemoteTier(capacity=capacity, url=self.url, storage_options=self.storage_options)

    def reopen(self, tier):
        tier.close()
        return self.make_tier(tier.capacity)

    def damage(self, tier, key, how):
        damage_object(tier.fs, f"{tier.root}/{object_relpath(key)}", how)

    def overwrite(self, tier, key, data):
        tier.fs.pipe_file(f"{tier.root}/{object_relpath(key)}", data)


class TestRemoteS3(_RemoteTierTests):
    race_iterations = 20  # every operation is an HTTP round trip to moto

    @pytest.fixture(autouse=True)
    def _url(self, s3_prefix):
        self.url, self.storage_options = s3_prefix()


class TestRemoteSharedMount(_RemoteTierTests):
    @pytest.fixture(autouse=True)
    def _url(self, tmp_path):
        self.url = (tmp_path / "mnt" / "kv").as_uri()


class TestRemoteMemory(_RemoteTierTests):
    @pytest.fixture(autouse=True)
    def _url(self):
        self.url = memory_url()
        yield
        fsspec.filesystem("memory").rm(self.url, recursive=True) if fsspec.filesystem("memory").exists(
            self.url) else None


# --------------------------------------------------------------------------- remote-specific behaviour
class Backend:
    """One storage prefix; ``tier()`` opens another instance on it (as a second engine would)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url, self.storage_options = url, storage_options
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.opened: list[RemoteTier] = []

    def tier(self, **kw) -> RemoteTier:
        t = RemoteTier(url=self.url, storage_options=self.storage_options, **kw)
        self.opened.append(t)
        return t

    def path(self, key) -> str:
        return f"{self.root.rstrip('/')}/{object_relpath(key)}"

    def size(self, key) -> int:
        return self.fs.info(self.path(key))["size"]


@pytest.fixture(params=["s3", "file", "memory"])
def backend(request, tmp_path):
    if request.param == "s3":
        b = Backend(*request.getfixturevalue("s3_prefix")())
    elif request.param == "file":
        b = Backend((tmp_path / "mnt" / "kv").as_uri())
    else:
        b = Backend(memory_url())
    yield b
    for t in b.opened:
        t.close()
    if request.param == "memory" and b.fs.exists(b.root):
        b.fs.rm(b.root, recursive=True)


def test_second_instance_sees_new_objects_without_reopen(backend):
    a = backend.tier()
    b = backend.tier()  # opened while the prefix is empty
    assert not a.contains(key_of(1)) and a.get(key_of(1)) is None  # a miss is not remembered ...
    assert b.put(key_of(1), chunk(1))
    assert a.contains(key_of(1))  # ... so a later lookup finds b's object
    assert_same(a.get(key_of(1)), chunk(1))
    assert a.stats()["objects"] == 1 and a.used_bytes == backend.size(key_of(1))
    got = a.get_many([key_of(2), key_of(1)])  # batched lookups probe too
    assert got[0] is None
    assert_same(got[1], chunk(1))


def test_a_put_replaces_another_value_and_uploads_nothing_for_the_same_one(backend):
    """Review #7: the remote kept a key's first value, so an overwritten key read back its older value."""
    a, b = backend.tier(), backend.tier()
    k = key_of(5)
    assert a.put(k, chunk(1))
    assert b.put(k, chunk(1))  # the same value: its checksum matches, nothing is uploaded
    assert b.put(k, chunk(2, 8192))  # another value: replaced in one atomic step
    assert_same(a.get(k), chunk(2, 8192))
    # a store racing another writer's publish of another value: ours is the newer put, it replaces theirs
    payload, size = b._prepare(k, chunk(3))
    b._store(k, payload, size)
    assert_same(a.get(k), chunk(3))
    assert a.stats()["errors"] == b.stats()["errors"] == 0
    # the same new key many times in one batch: every put succeeds, accounted once
    k2 = key_of(6)
    assert a.put_many([(k2, chunk(6))] * 6) == [True] * 6
    assert_same(a.get(k2), chunk(6))
    assert len(a) == 2
    assert a.stats()["reserved_bytes"] == 0


def test_compression_roundtrip_and_smaller(backend):
    z = backend.tier(compression="zstd")
    plain = backend.tier(list_on_open=False)
    value = {"k": torch.zeros(16384), "v": torch.arange(16384, dtype=torch.int32).remainder(7)}
    assert z.put(key_of(1), value)
    assert plain.put(key_of(2), value)
    assert_same(z.get(key_of(1)), value)
    assert backend.size(key_of(1)) * 10 < backend.size(key_of(2))
    assert z.used_bytes == backend.size(key_of(1))
    # objects are self-describing: either tier reads both codecs
    assert_same(plain.get(key_of(1)), value)
    assert_same(z.get(key_of(2)), value)
    random = chunk(3, 1 << 16)  # incompressible data still round-trips
    assert z.put(key_of(3), random)
    assert_same(plain.get(key_of(3)), random)


def test_batched_io_is_concurrent_and_bounded():
    peak, active, lock = [0], [0], threading.Lock()

    class Slow(RemoteTier):
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

    with Slow(url=memory_url(), max_in_flight=4) as t:
        items = [(key_of(i), chunk(i)) for i in range(16)]
        assert t.put_many(items) == [True] * 16
        assert 1 < peak[0] <= 4  # overlapping, and bounded by max_in_flight
        peak[0] = 0
        got = t.get_many([k for k, _ in items])
        assert 1 < peak[0] <= 4
        for (_, value), result in zip(items, got, strict=True):
            assert_same(result, value)
        assert t.stats()["hits"] == 16 and t.stats()["puts"] == 16
        fsspec.filesystem("memory").rm(t.url, recursive=True)


def test_shared_mount_publish_is_atomic_and_listing_ignores_junk(tmp_path):
    root = tmp_path / "kv"
    b = Backend(root.as_uri())
    t = b.tier()
    for i in range(5):
        assert t.put(key_of(i), chunk(i))
    files = sorted(p.name for p in root.rglob("*") if p.is_file())
    assert len(files) == 5 and all(f.endswith(".tso") for f in files)  # no temp files left behind
    # a writer that died mid-write leaves a temp file; stray files are not objects either
    hexkey = key_of(9).hex()
    (root / hexkey[:2]).mkdir(exist_ok=True)
    (root / hexkey[:2] / f"{hexkey}.tso.deadbeef.tmp").write_bytes(b"partial")
    (root / "README").write_text("not an object")
    t.close()
    t2 = b.tier()
    assert sorted(k.hex() for k in t2.keys()) == sorted(key_of(i).hex() for i in range(5))
    assert not t2.contains(key_of(9))


def test_bad_configuration_is_a_config_error(tmp_path):
    for url in ("nosuchscheme://bucket/kv", "", None):
        with pytest.raises(ConfigError, match=re.escape(repr(url))):
            RemoteTier(url=url)
    with pytest.raises(ConfigError, match="compression"):
        RemoteTier(url=memory_url(), compression="lz4")
    with pytest.raises(ConfigError, match="max_in_flight"):
        RemoteTier(url=memory_url(), max_in_flight=0)
    with pytest.raises(ConfigError, match="storage_options"):
        RemoteTier(url=memory_url(), storage_options=["endpoint"])
    assert not any(tmp_path.iterdir())


def test_unreachable_endpoint_degrades(caplog):
    caplog.set_level(logging.WARNING, logger="tierstore")
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "testing", "secret": "testing",
               "skip_instance_cache": True,
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    start = time.monotonic()
    with RemoteTier(url="s3://unreachable/kv", storage_options=options) as t:  # the listing fails: empty
        assert len(t) == 0
        assert t.put(key_of(0), chunk(0)) is False
        assert t.get(key_of(0)) is None
        assert t.put_many([(key_of(1), chunk(1)), (key_of(2), chunk(2))]) == [False, False]
        assert t.get_many([key_of(1), key_of(2)]) == [None, None]
        assert t.contains_many([key_of(3), key_of(4)]) == [False, False]
        warnings = len(caplog.records)
        assert t.put(key_of(0), chunk(0)) is False
        stats = t.stats()
    assert len(caplog.records) == warnings  # logged once per kind of failure, not per call
    assert stats["errors"] >= 8 and stats["misses"] == 3 and stats["puts"] == 0
    assert stats["used_bytes"] == 0 and stats["reserved_bytes"] == 0
    assert time.monotonic() - start < 30


def test_failing_storage_fails_fast_then_recovers(monkeypatch):
    with RemoteTier(url=memory_url()) as t:
        t.storage.retry_after = 0.5  # long enough that a loaded machine still calls again inside it
        assert t.put(key_of(0), chunk(0))
        calls = []
        real_cat = t.fs.cat_file

        def broken(*args, **kwargs):
            calls.append(args)
            raise ConnectionResetError("connection reset by peer")

        monkeypatch.setattr(t.fs, "cat_file", broken)
        assert t.get(key_of(0)) is None and len(calls) == 1
        assert t.get(key_of(0)) is None and len(calls) == 1  # backing off: no request at all
        assert t.put(key_of(1), chunk(1)) is False
        assert t.stats()["errors"] >= 3 and t.stats()["corrupt"] == 0
        monkeypatch.setattr(t.fs, "cat_file", real_cat)
        time.sleep(0.6)
        assert_same(t.get(key_of(0)), chunk(0))  # the index entry survived the outage
        assert t.put(key_of(1), chunk(1))
        fsspec.filesystem("memory").rm(t.url, recursive=True)


def test_filesystem_without_create_mode(monkeypatch):
    with RemoteTier(url=memory_url()) as t:
        real_pipe = t.fs.pipe_file
        monkeypatch.setattr(t.fs, "pipe_file", lambda path, value: real_pipe(path, value))  # an older fs
        assert t.put(key_of(0), chunk(0))
        payload, size = t._prepare(key_of(0), chunk(1))
        t._store(key_of(0), payload, size)  # exists with another value: checked first, then replaced
        assert_same(t.get(key_of(0)), chunk(1))
        assert t.stats()["errors"] == 0
        fsspec.filesystem("memory").rm(t.url, recursive=True)


def test_cuda_device_read():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    with RemoteTier(url=memory_url()) as t:
        t.put(key_of(0), chunk(0))
        got = t.get(key_of(0), device="cuda")
        assert got["k"].is_cuda
        assert_same({k: v.cpu() for k, v in got.items()}, chunk(0))


CHILD = r"""
import json, sys
from tierstore.testing.data import chunk, key_of
from tierstore.tiers.remote import RemoteTier

out = []
for url, options in json.loads(sys.argv[1]):
    with RemoteTier(url=url, storage_options=options, list_on_open=False) as t:
        got = t.get(key_of(1))
        seen = got is not None and all(got[n].equal(v) for n, v in chunk(1).items())
        replaced = t.put(key_of(1), chunk(7))            # another value: replaces it (review #7)
        published = t.put(key_of(2), chunk(2))
        payload, size = t._prepare(key_of(3), chunk(3))  # the same value again: nothing uploaded
        t._store(key_of(3), payload, size)
        out.append({"seen": seen, "replaced": replaced, "published": published, **t.stats()})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_share_a_prefix(s3_prefix, tmp_path):
    backends = [Backend(*s3_prefix()),
                Backend((tmp_path / "nfs" / "kv").as_uri())]
    tiers = [b.tier() for b in backends]
    for t in tiers:
        assert t.put(key_of(1), chunk(1)) and t.put(key_of(3), chunk(3))
    arg = json.dumps([[b.url, b.storage_options] for b in backends])
    proc = subprocess.run([sys.executable, "-c", CHILD, arg], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for report in json.loads(proc.stdout):
        assert report["seen"] and report["replaced"] and report["published"], report
        assert report["errors"] == report["corrupt"] == 0, report
    for b, t in zip(backends, tiers, strict=True):
        assert t.contains(key_of(2))  # published by the other process, found without reopening
        assert_same(t.get(key_of(2)), chunk(2))
        assert_same(t.get(key_of(1)), chunk(7))  # the child's later put replaced our value
        assert_same(t.get(key_of(3)), chunk(3))
        assert t.used_bytes == sum(b.size(key_of(i)) for i in (1, 2, 3))
        t.close()


def test_remove_stale_temp_removes_only_our_temp_names(backend):
    """Probe 8.9: gc deleted a foreign ``exports/nightly.tmp`` under a shared prefix (any ``*.tmp``)."""
    t = backend.tier()
    assert t.put(key_of(0), chunk(0))
    hexkey = key_of(1).hex()
    ours = f"{backend.root}/{hexkey[:2]}/{hexkey}.tso.{uuid.uuid4().hex}.tmp"  # what _publish_local writes
    foreign = [f"{backend.root}/exports/nightly.tmp",                       # someone else's file
               f"{backend.root}/{hexkey[:2]}/{hexkey}.tso.0123abcd.tmp",  # not our uuid form
               f"{backend.root}/00/{hexkey}.tso.{uuid.uuid4().hex}.tmp",  # not in its key's folder
               f"{backend.root}/{hexkey[:2]}/notes.tmp"]
    for path in [ours, *foreign]:
        backend.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        backend.fs.pipe_file(path, b"partial object of a writer that died")
    assert t.remove_stale_temp(older_than=3600) == 0  # young: a live writer may still own it
    assert backend.fs.exists(ours)
    time.sleep(0.05)
    assert t.remove_stale_temp(older_than=0) == 1
    assert not backend.fs.exists(ours)
    assert all(backend.fs.exists(path) for path in foreign)
    assert_same(t.get(key_of(0)), chunk(0))  # objects are never temp files
    with pytest.raises(InvalidInputError):
        t.remove_stale_temp(older_than=-1)


def test_stale_temp_gc_never_follows_a_symlink(tmp_path):
    b = Backend((tmp_path / "kv").as_uri())
    t = b.tier()
    hexkey = key_of(1).hex()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / f"{hexkey}.tso.{uuid.uuid4().hex}.tmp"
    victim.write_bytes(b"not under the prefix")
    (tmp_path / "kv").mkdir(exist_ok=True)
    (tmp_path / "kv" / hexkey[:2]).symlink_to(outside, target_is_directory=True)
    time.sleep(0.05)
    assert t.remove_stale_temp(older_than=0) == 0
    assert victim.exists()


def test_remote_capacity_is_refused_and_writers_never_delete_each_other(backend, tmp_path):
    """Review C5: probes overfilled a bounded remote index, and the next put evicted (deleted) the objects
    another writer had just published. A shared prefix has no per-process capacity."""
    with pytest.raises(ConfigError, match="lifecycle"):
        backend.tier(capacity=3 * 8192)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.capacity.*lifecycle"):
        tierstore.config.parse_config({"tiers": [{"kind": "host", "capacity": "1MiB"},
                                                 {"kind": "remote", "url": memory_url(), "capacity": "1GiB"}]})
    first, second = backend.tier(), backend.tier()
    for i in range(8):
        assert first.put(key_of(i), chunk(i, 8000))
    assert second.contains_many([key_of(i) for i in range(8)]) == [True] * 8  # probes index them
    for i in range(8, 24):
        assert second.put(key_of(i), chunk(i, 8000))
    assert all(backend.fs.exists(backend.path(key_of(i))) for i in range(24))
    assert second.stats()["evictions"] == first.stats()["evictions"] == 0


def test_remove_older_than_bounds_a_shared_prefix_by_age(backend):
    t = backend.tier()
    for i in range(3):
        assert t.put(key_of(i), chunk(i))
    foreign = f"{backend.root}/exports/model.bin"
    backend.fs.makedirs(f"{backend.root}/exports", exist_ok=True)
    backend.fs.pipe_file(foreign, b"someone else's")
    assert t.remove_older_than(3600) == 0
    time.sleep(0.05)
    assert t.remove_older_than(0) == 3
    assert backend.fs.exists(foreign) and len(t) == 0 and t.get(key_of(0)) is None
    with pytest.raises(InvalidInputError):
        t.remove_older_than(float("nan"))


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1/kv", "s3://bucket:notaport/kv", "memory://kv\0x"])
def test_malformed_url_is_a_config_error_at_open(url, tmp_path):
    """Probe 4.18: ``http://[::1`` opened, and then every listing and put failed with logged errors."""
    with pytest.raises(ConfigError, match="url"):
        RemoteTier(url=url)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url"):
        tierstore.open({"tiers": [{"kind": "remote", "url": url}]})
    with pytest.raises(ConfigError, match="endpoint_url"):
        tierstore.config.parse_config({"tiers": [{"kind": "remote", "url": memory_url(),
                                                  "storage_options": {"endpoint_url": url}}]})


def test_config_and_tier_accept_the_same_urls():
    """Review A.7: the two URL checks diverged (``simplecache::memory://`` passed one, failed the other)."""
    for url in (f"simplecache::{memory_url()}", memory_url(), "file:///tmp/kv", "/tmp/kv"):
        tierstore.config.parse_config({"tiers": [{"kind": "remote", "url": url}]})
        RemoteTier(url=url, list_on_open=False).close()
    for url in ("nosuch://x", "simplecache::nosuch://x"):
        with pytest.raises(ConfigError):
            tierstore.config.parse_config({"tiers": [{"kind": "remote", "url": url}]})
        with pytest.raises(ConfigError):
            RemoteTier(url=url)


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
