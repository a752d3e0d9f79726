"""The ``disk`` backend (:class:`~tierstore.backends.file.FileBackend`): the conformance suite, then what is
particular to a directory of object files — paths, temp files, the index and LRU order rebuilt from a listing,
hostile files, reads into caller buffers, read-only views, the process lock, crashes and a full filesystem.

Capacity, LRU order, eviction and ENOSPC handling are the store's (:mod:`tierstore.residency`): those tests run a
store whose one tier is a disk directory."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import objformat
from tierstore.backends import Hit, backend_class, objfile
from tierstore.backends.file import FileBackend, ReadOnlyError
from tierstore.backends.layout import object_relpath, temp_name
from tierstore.errors import ClosedError, ConfigError, CorruptObjectError, InvalidInputError, LockedError
from tierstore.store import TieredStore
from tierstore.testing.backends import BackendTests
from tierstore.testing.data import assert_same, chunk, key_of

REPO = str(Path(tierstore.__file__).resolve().parent.parent)


def _files(root: Path, pattern: str = "*/*.tso") -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file())


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def _store(root, capacity: int | None = None, **options) -> TieredStore:
    """A store whose one tier is the disk directory ``root`` (listed, indexed and trimmed at open)."""
    return TieredStore.from_backends([(FileBackend(path=root, **options), capacity)])


def _tier(s: TieredStore) -> dict:
    (stats,) = s.stats()["tiers"].values()
    return stats


class TestFileBackend(BackendTests):
    persistent = True
    checksummed = True
    codec = "none"
    verify_reads = "always"

    def make_backend(self, capacity):
        self._made = getattr(self, "_made", 0) + 1  # a directory per backend: each holds its directory's lock
        return FileBackend(path=self.tmp_path / f"disk{self._made}", codec=self.codec, verify_reads=self.verify_reads)

    def reopen(self, backend):
        backend.close()
        return FileBackend(name=backend.name, path=backend.path, codec=backend.codec, verify_reads=self.verify_reads)

    def overwrite(self, backend, key, data):
        (Path(backend.path) / object_relpath(key)).write_bytes(data)

    def damage(self, backend, key, how):
        path = Path(backend.path) / object_relpath(key)
        data = bytearray(path.read_bytes())
        if how == "flip":
            hdr = objformat.parse_header(data)
            data[hdr.payload_offset] ^= 0x01
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))

    def test_used_bytes_equal_file_sizes(self):
        s = self.store()
        for i in range(6):
            s.put(key_of(i), chunk(i, 1000 * (i + 1)))
        s.put(key_of(2), chunk(9, 777))  # overwrite with another size
        s.delete(key_of(4))
        root = Path(s.tiers[0].backend.path)
        files = _files(root)
        st = self.tier_stats(s)
        assert len(files) == st["objects"] == 5
        assert st["used_bytes"] == sum(p.stat().st_size for p in files)
        assert {f.key: f.size for f in s.tiers[0].backend.list()} == {
            key_of(i): (root / object_relpath(key_of(i))).stat().st_size for i in (0, 1, 2, 3, 5)}


class TestFileBackendVerifyOnce(TestFileBackend):
    """``verify_reads: once``: every conformance check (damage included) holds when reads of files the
    backend wrote or verified skip the checksum."""

    verify_reads = "once"


class TestFileBackendZstd(TestFileBackend):
    codec = "zstd"

    def damage(self, backend, key, how):
        path = Path(backend.path) / object_relpath(key)
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))


def test_zstd_shrinks_compressible_chunks(tmp_path):
    b = FileBackend(path=tmp_path / "z", codec="zstd")
    value = {"x": torch.zeros(1 << 16)}
    b.write(key_of(0), value)
    assert b.stat_many([key_of(0)])[0] < 4096
    assert_same(b.read(key_of(0)), value)
    b.close()


# ---------------------------------------------------------------------- open, paths, registry
def test_registered_kind_and_path_handling(tmp_path, monkeypatch):
    assert backend_class("disk") is FileBackend
    monkeypatch.setenv("HOME", str(tmp_path))
    b = FileBackend(path="~/nested/cache")
    assert b.path == str(tmp_path / "nested" / "cache")
    b.close()
    with tierstore.open({"tiers": [{"kind": "disk", "path": "~/nested/cache"}]}) as s:
        assert s.tier("disk").backend.path == str(tmp_path / "nested" / "cache")
        assert (tmp_path / "nested" / "cache" / "ab").is_dir()  # the listing at open lays out the folders
        assert s.stats()["tiers"]["disk"]["kind"] == "disk"


def test_unusable_path_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "sub"
    with pytest.raises(ConfigError, match="afile"):
        FileBackend(path=bad)
    with pytest.raises(ConfigError, match="afile"):
        FileBackend(path=tmp_path / "afile")
    with pytest.raises(ConfigError, match="nothere"):
        FileBackend(path=tmp_path / "nothere", read_only=True)
    with pytest.raises(ConfigError):
        FileBackend(path=None)
    with pytest.raises(ConfigError):
        FileBackend(path=tmp_path / "c", codec="lz4")
    with pytest.raises(ConfigError):
        FileBackend(path=tmp_path / "c", io_threads=0)


@pytest.mark.parametrize("io_threads", [1, 4])
def test_batched_io_keeps_order(tmp_path, io_threads):
    b = FileBackend(path=tmp_path / "d", io_threads=io_threads)
    items = [(key_of(i), chunk(i, 1000 + 8 * i)) for i in range(12)]
    assert b.write_many([(k, b.prepare(k, v)) for k, v in items]) == [None] * 12
    got = b.read_many([key_of(i) for i in range(13)])
    for (_, value), g in zip(items, got[:12], strict=True):
        assert isinstance(g, Hit)
        assert_same(g.value, value)
    assert got[12] is None
    root = Path(b.path)
    assert {f.key: f.size for f in b.list()} == {k: (root / object_relpath(k)).stat().st_size for k, _ in items}
    assert sum(b.stat_many([k for k, _ in items])) == sum(p.stat().st_size for p in _files(root))
    b.close()
    with pytest.raises(ClosedError):
        b.read_many([key_of(0), key_of(1)])
    with pytest.raises(ClosedError):
        b.write_many([(key_of(20), b.prepare(key_of(20), chunk(20)))])
    assert not (root / object_relpath(key_of(20))).exists()
    assert all(isinstance(r, ClosedError) for r in b.delete_many([key_of(0)]))  # each item's result
    assert (root / object_relpath(key_of(0))).exists()
    with pytest.raises(ClosedError):
        b.read_into_many([key_of(0)], [{n: torch.empty_like(v) for n, v in items[0][1].items()}])


class _HeldWrite(FileBackend):
    """A disk backend whose writes wait for ``go`` before they touch the directory (a write in flight, held)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.started, self.go = threading.Event(), threading.Event()

    def _store(self, key, payload):
        self.started.set()
        assert self.go.wait(30)
        return super()._store(key, payload)


def test_close_keeps_the_directory_for_a_write_in_flight(tmp_path):
    """close() while a write runs (a write-back past the store's close deadline): later calls are refused, the
    running write still lands through the directory's own descriptor, and the lock goes when it ends."""
    root = tmp_path / "d"
    b = _HeldWrite(path=root)
    results = []
    writer = threading.Thread(target=lambda: results.extend(b.write_many([(key_of(0), b.prepare(key_of(0),
                                                                                                  chunk(0)))])))
    writer.start()
    assert b.started.wait(30)
    b.close()
    with pytest.raises(ClosedError):
        b.read_many([key_of(0)])
    with pytest.raises(LockedError):  # still held for the write in flight
        FileBackend(path=root)
    b.go.set()
    writer.join(30)
    assert results == [None]
    with FileBackend(path=root) as again:  # released by the write that ended last
        assert_same(again.read(key_of(0)), chunk(0))


def test_stale_temp_files_removed_on_open(tmp_path):
    root = tmp_path / "d"
    b = FileBackend(path=root)
    b.write(key_of(0), chunk(0))
    b.close()
    ours = root / key_of(1).hex()[:2] / temp_name(key_of(1))
    ours.parent.mkdir(mode=0o700, exist_ok=True)
    ours.write_bytes(b"half")
    (root / "tmp").mkdir()  # older versions staged objects in tmp/
    (root / "tmp" / f"{key_of(1).hex()}.123.abcdef012345.tmp").write_bytes(b"half")
    (root / "ab").mkdir(mode=0o700, exist_ok=True)
    foreign = [root / "README", root / "ab" / "leftover.tmp", root / "ab" / f"{key_of(2).hex()}.tso.x.tmp"]
    for p in foreign:
        p.write_text("not ours")
    with _store(root) as s:
        assert not ours.exists() and not (root / "tmp").exists()
        assert all(p.exists() for p in foreign)  # files that are not ours are left alone
        assert s.residency.keys(0) == [key_of(0)]
        assert _tier(s)["used_bytes"] == (root / object_relpath(key_of(0))).stat().st_size


def test_lru_order_rebuilt_from_mtime(tmp_path):
    root = tmp_path / "d"
    with _store(root) as s:
        for i in range(4):
            s.put(key_of(i), chunk(i))
    now = time.time()
    for age, i in zip((400, 100, 300, 200), range(4), strict=True):  # used: 0, 2, 3, 1; over a minute ago
        os.utime(root / object_relpath(key_of(i)), (now - age, now - age))
    with _store(root) as s:
        assert s.residency.keys(0) == [key_of(i) for i in (0, 2, 3, 1)]
        assert s.get(key_of(0)) is not None  # a hit refreshes mtime ...
    assert (root / object_relpath(key_of(0))).stat().st_mtime > now - 60
    with _store(root) as s:
        assert s.residency.keys(0)[-1] == key_of(0)  # ... so it survives the restart as the most recently used


def test_reopen_with_lower_capacity_trims_lru(tmp_path):
    root = tmp_path / "d"
    with _store(root) as s:
        for i in range(4):
            s.put(key_of(i), chunk(i, 8000))
            os.utime(root / object_relpath(key_of(i)), ns=(i * 10**9, i * 10**9))
        one = _tier(s)["used_bytes"] // 4
    with _store(root, capacity=2 * one) as s:
        assert s.residency.keys(0) == [key_of(2), key_of(3)]
        st = _tier(s)
        assert st["used_bytes"] == sum(p.stat().st_size for p in _files(root)) <= st["capacity_bytes"]
        assert st["evictions"] == 2
        assert_same(s.get(key_of(3)), chunk(3, 8000))


def test_durable_mode(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    b = FileBackend(path=tmp_path / "d", durable=True)
    b.write(key_of(0), chunk(0))
    assert len(synced) == 2  # the file before the rename, its folder after
    assert_same(b.read(key_of(0)), chunk(0))
    b.close()
    b = FileBackend(path=tmp_path / "d", durable=True)
    assert_same(b.read(key_of(0)), chunk(0))
    b.close()


def test_hostile_files_are_misses(tmp_path):
    root = tmp_path / "d"
    with _store(root) as s:
        s.put(key_of(0), chunk(0))
    good = (root / object_relpath(key_of(0))).read_bytes()
    (root / object_relpath(key_of(1))).write_bytes(good)  # a valid object under the wrong name
    (root / object_relpath(key_of(2))).write_bytes(os.urandom(5000))  # garbage
    (root / object_relpath(key_of(3))).write_bytes(b"")  # torn to nothing
    huge_header = objformat.PREFIX.pack(objformat.MAGIC, 1, 1 << 30, bytes(16))
    (root / object_relpath(key_of(4))).write_bytes(huge_header + b"{}")
    os.mkdir(root / object_relpath(key_of(5)))  # a directory with an object's name
    os.symlink(root / object_relpath(key_of(0)), root / object_relpath(key_of(6)))
    wrong_dir = "00" if not key_of(7).hex().startswith("00") else "01"
    misplaced = [root / wrong_dir / f"{key_of(7).hex()}.tso",
                 root / key_of(8).hex()[:2] / f"{key_of(8).hex().upper()}.tso"]
    for p in misplaced:
        p.write_bytes(good)
    with _store(root) as s:
        assert all(p.exists() for p in misplaced)  # not ours: neither indexed nor removed
        assert not s.contains(key_of(7)) and not s.contains(key_of(8))
        assert _tier(s)["objects"] == 5 and not s.contains(key_of(5)) and not s.contains(key_of(6))
        assert _tier(s)["used_bytes"] == sum(p.stat().st_size for p in _files(root)
                                             if not p.is_symlink() and p not in misplaced)
        for i in (1, 2, 3, 4):
            assert s.get(key_of(i)) is None
            assert not (root / object_relpath(key_of(i))).exists()  # damaged objects of our own go
        assert _tier(s)["corrupt"] == 4
        assert_same(s.get(key_of(0)), chunk(0))
        assert s.get(key_of(6)) is None and s.get(key_of(5)) is None
        assert _tier(s)["used_bytes"] == (root / object_relpath(key_of(0))).stat().st_size
    assert (root / object_relpath(key_of(6))).is_symlink() and (root / object_relpath(key_of(5))).is_dir()


# ---------------------------------------------------------------------- reads into caller buffers
def test_read_into_reads_straight_into_out(tmp_path):
    b = FileBackend(path=tmp_path / "d")
    value = {"a": torch.randn(7, 3), "b": torch.arange(5, dtype=torch.int16), "s": torch.tensor(2.5),
             "e": torch.empty(0, 4), "m": torch.tensor([True, False, True])}
    b.write(key_of(0), value)
    for planned in (True, False):  # planned from the write, then the careful read of a fresh backend
        if not planned:
            b.close()
            b = FileBackend(path=tmp_path / "d")
        out = {n: torch.empty_like(v) for n, v in value.items()}
        ptrs = {n: v.data_ptr() for n, v in out.items()}
        (got,) = b.read_into_many([key_of(0)], [out])
        assert isinstance(got, Hit) and got.size == b.stat_many([key_of(0)])[0]
        assert {n: v.data_ptr() for n, v in got.value.items()} == ptrs
        assert_same(out, value)
    bad = b.read_into_many([key_of(0), key_of(0)], [{"a": torch.empty(7, 3)}, {**out, "a": torch.empty(3, 7)}])
    assert all(isinstance(r, InvalidInputError) for r in bad)
    # a non-contiguous destination goes through the copying path
    out2 = {**{n: torch.empty_like(v) for n, v in value.items()}, "a": torch.empty(3, 7).t()}
    (got,) = b.read_into_many([key_of(0)], [out2])
    assert isinstance(got, Hit) and got.value["a"] is out2["a"]
    assert_same({n: v.contiguous() for n, v in got.value.items()}, value)
    # a damaged payload is detected after the read
    path = Path(b.path) / object_relpath(key_of(0))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    (got,) = b.read_into_many([key_of(0)], [out])
    assert isinstance(got, CorruptObjectError)
    b.close()


def test_many_tensors_exceed_iov_max(tmp_path):
    b = FileBackend(path=tmp_path / "d")
    value = {f"t{i}": torch.full((3,), i, dtype=torch.int16) for i in range(1500)}  # > IOV_MAX parts
    b.write(key_of(0), value)
    assert_same(b.read(key_of(0)), value)
    out = {n: torch.empty_like(v) for n, v in value.items()}
    (got,) = b.read_into_many([key_of(0)], [out])
    assert isinstance(got, Hit)
    assert_same(got.value, value)
    b.close()


# ---------------------------------------------------------------------- read-only views
def test_read_only_view(tmp_path):
    root = tmp_path / "d"
    owner = FileBackend(path=root)
    owner.write(key_of(0), chunk(0))
    view = FileBackend(path=root, read_only=True)  # no lock needed beside the owner
    assert view.capabilities.shared and not view.capabilities.writable
    assert_same(view.read(key_of(0)), chunk(0))
    owner.write(key_of(1), chunk(1))
    assert_same(view.read(key_of(1)), chunk(1))
    with pytest.raises(ReadOnlyError, match="read-only"):
        view.write(key_of(2), chunk(2))
    with pytest.raises(ReadOnlyError, match="read-only"):
        view.delete(key_of(0))
    assert not (root / object_relpath(key_of(2))).exists()
    owner.delete(key_of(0))
    assert view.read(key_of(0)) is None  # vanished: a miss
    owner.write(key_of(0), chunk(0))
    view.close()

    with TieredStore.from_backends([FileBackend(path=root, read_only=True)]) as s:
        owner.write(key_of(3), chunk(3))
        assert_same(s.get(key_of(3)), chunk(3))  # found on storage although written after the store opened
        assert s.put(key_of(2), chunk(2)) is False  # never written: the put lands nowhere
        assert not (root / object_relpath(key_of(2))).exists()
        assert s.delete(key_of(0)) == 0 and (root / object_relpath(key_of(0))).exists()
        owner.delete(key_of(0))
        assert s.get(key_of(0)) is None  # vanished: a miss
        (root / object_relpath(key_of(1))).write_bytes(b"garbage")
        assert s.get(key_of(1)) is None and _tier(s)["corrupt"] == 1
        assert (root / object_relpath(key_of(1))).exists()  # a read-only view never removes files
        assert _tier(s)["puts"] == 0
    owner.close()


# ---------------------------------------------------------------------- process lock
def _child(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_lock_is_per_process_and_dies_with_it(tmp_path):
    root = tmp_path / "d"
    child = _child(f"""
        import sys, time
        from tierstore.backends.file import FileBackend
        from tierstore.testing.data import chunk, key_of
        b = FileBackend(path={str(root)!r})
        b.write(key_of(0), chunk(0))
        print("ready", flush=True)
        time.sleep(120)
    """)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with pytest.raises(LockedError, match=f"pid {child.pid}") as info:
            FileBackend(path=root)
        assert isinstance(info.value, BlockingIOError)
        view = FileBackend(path=root, read_only=True)  # inspecting beside the owner is fine
        assert_same(view.read(key_of(0)), chunk(0))
        view.close()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        b = FileBackend(path=root)  # the kernel released the dead holder's lock
        assert_same(b.read(key_of(0)), chunk(0))
        # now we hold it: the lock note names us, and a second opener is refused
        assert (root / ".lock").read_text().split()[0] == str(os.getpid())
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            FileBackend(path=root)
        b.close()
        FileBackend(path=root).close()  # close released it
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.slow
def test_crash_mid_write_leaves_a_consistent_directory(tmp_path):
    root = tmp_path / "d"
    # the writer dies by SIGKILL twice: once right before a rename, once at an arbitrary moment
    child = _child(f"""
        import os, signal
        from tierstore.backends.file import FileBackend
        from tierstore.testing.data import chunk, key_of
        b = FileBackend(path={str(root)!r})
        for i in range(5):
            b.write(key_of(i), chunk(i, 1 << 18))
        real_replace = os.replace
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = die
        b.write(key_of(5), chunk(5, 1 << 18))
    """)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert _tmp_files(root), "the killed writer should have left a temp file behind"
    child = _child(f"""
        from tierstore.backends.file import FileBackend
        from tierstore.testing.data import chunk, key_of
        b = FileBackend(path={str(root)!r})
        i = 10
        while True:
            b.write(key_of(i), chunk(i, 1 << 18))
            print(i, flush=True)
            i += 1
    """)
    try:
        for _ in range(30):
            assert child.stdout.readline(), child.stderr.read()
    finally:
        child.kill()
        child.wait()
    with _store(root) as s:
        assert _tmp_files(root) == []
        assert _tier(s)["used_bytes"] == sum(p.stat().st_size for p in _files(root))
        held = s.residency.keys(0)
        keys = {k.hex() for k in held}
        assert {key_of(i).hex() for i in range(5)} <= keys and key_of(5).hex() not in keys
        assert len(keys) >= 35
        hits = 0
        for k in held:
            i = next(i for i in list(range(5)) + list(range(10, 10 + len(keys))) if key_of(i) == k)
            got = s.get(k)
            if got is not None:
                assert_same(got, chunk(i, 1 << 18))
                hits += 1
        assert hits + _tier(s)["corrupt"] == len(keys)


# ---------------------------------------------------------------------- a full filesystem
def _fault_fs(monkeypatch, limit: int):
    """Make writes under the tier fail with ENOSPC once ``limit`` bytes of files exist (fallback)."""
    real_pwritev = os.pwritev

    def pwritev(fd, bufs, offset):
        used = sum(p.stat().st_size for p in _FS_ROOT[0].rglob("*") if p.is_file())
        if used + sum(len(memoryview(b)) for b in bufs) > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


_FS_ROOT: list[Path] = []


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (needs mount privileges); skipped where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here ({res.stderr.decode().strip() or res.returncode}); "
                    "test_enospc_injected covers the same path with fault injection")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_until_enospc(s: TieredStore, nbytes: int, n: int) -> None:
    for i in range(n):
        assert s.put(key_of(i), chunk(i, nbytes)), i  # every put lands: older chunks make room
        st = _tier(s)
        assert st["capacity_bytes"] is None or st["used_bytes"] <= st["capacity_bytes"]


def _check_after_enospc(s: TieredStore, root: Path, nbytes: int, n: int) -> None:
    st = _tier(s)
    assert st["enospc"] >= 1
    limit = st["space_limit_bytes"]  # what the storage really holds, until free space is probed again
    assert limit is not None and limit < 1 << 20
    assert st["used_bytes"] <= limit
    assert st["used_bytes"] == sum(p.stat().st_size for p in _files(root))
    assert _tmp_files(root) == []
    kept = [i for i in range(n) if s.contains(key_of(i))]
    assert kept and kept == list(range(n - len(kept), n))  # the newest chunks survived
    assert_same(s.get(key_of(n - 1)), chunk(n - 1, nbytes))


def test_enospc_on_a_real_small_filesystem(small_fs):
    with _store(small_fs / "d", capacity=64 << 20) as s:  # capacity far above what the fs holds
        _fill_until_enospc(s, 100_000, 30)
        _check_after_enospc(s, small_fs / "d", 100_000, 30)


def test_enospc_injected(tmp_path, monkeypatch):
    root = tmp_path / "d"
    _FS_ROOT[:] = [root]
    with _store(root) as s:  # unbounded until the "disk" fills
        _fault_fs(monkeypatch, 1 << 20)
        _fill_until_enospc(s, 100_000, 30)
        _check_after_enospc(s, root, 100_000, 30)


class _Interleaved(FileBackend):
    """A disk backend that lets another thread run ``before`` its next batched read touches the storage and
    ``after`` that read, before it returns (the interleaving a race would need, made certain)."""

    before = after = None

    def read_many(self, keys, device="cpu"):
        before, after, self.before, self.after = self.before, self.after, None, None
        _on_another_thread(before)
        got = super().read_many(keys, device)
        _on_another_thread(after)
        return got


def _on_another_thread(fn) -> None:
    if fn is None:
        return
    failed: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)

    th = threading.Thread(target=run)
    th.start()
    th.join(30)
    assert not th.is_alive() and not failed, failed


def test_a_failed_read_never_forgets_a_newer_object(tmp_path):
    """A reader that pinned a key, then failed on its object (deleted meanwhile), must not drop the object a
    put stored under that key after its pin (found by tests/test_store_threads.py)."""
    b = _Interleaved(path=tmp_path / "d")
    with TieredStore.from_backends([b]) as s:
        s.put(key_of(0), chunk(0))
        b.before = lambda: s.delete(key_of(0))  # the object vanishes under the reader ...
        b.after = lambda: s.put(key_of(0), chunk(1))  # ... and is stored again before its miss is settled
        assert s.get(key_of(0)) is None  # the reader's own read failed: a miss
        assert s.contains(key_of(0))
        assert_same(s.get(key_of(0)), chunk(1))
        assert _tier(s)["objects"] == 1


def test_one_enospc_does_not_disable_the_tier(tmp_path, monkeypatch):
    """C8: after ENOSPC the tier backs off and re-probes free space; it is not cut to 0 bytes for good."""
    with _store(tmp_path / "d") as s:  # unbounded, and empty when the device reports full
        s.residency.enospc_recheck = 0.05
        real_pwritev, failures = os.pwritev, [1]

        def pwritev(fd, bufs, offset):
            if failures[0]:
                failures[0] -= 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_pwritev(fd, bufs, offset)

        monkeypatch.setattr(os, "pwritev", pwritev)
        assert not s.put(key_of(0), chunk(0))  # nothing to evict: this put is skipped
        assert _tier(s)["enospc"] == 1
        time.sleep(0.1)  # the back-off passes; free space is probed again
        assert [s.put(key_of(i), chunk(i)) for i in range(1, 4)] == [True] * 3
        st = _tier(s)
        assert st["space_limit_bytes"] is None or st["space_limit_bytes"] > st["used_bytes"]
        assert_same(s.get(key_of(3)), chunk(3))


def test_large_odd_sized_tensors_across_read_pieces(tmp_path):
    b = FileBackend(path=tmp_path / "d")
    g = torch.Generator().manual_seed(0)
    value = {"a": torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=g),
             "b": torch.randn(333_333, generator=g), "c": torch.randint(0, 9, (7,), generator=g)}
    b.write(key_of(0), value)
    assert_same(b.read(key_of(0)), value)
    for _ in range(2):  # planned from the write, then carefully once the plan is forgotten
        out = {n: torch.empty_like(v) for n, v in value.items()}
        (got,) = b.read_into_many([key_of(0)], [out])
        assert isinstance(got, Hit)
        assert_same(got.value, value)
        b._reads._plans.clear()
    path = Path(b.path) / object_relpath(key_of(0))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04  # a bit deep inside the second read piece or later
    path.write_bytes(bytes(data))
    (got,) = b.read_into_many([key_of(0)], [out])
    assert isinstance(got, CorruptObjectError)
    (got,) = b.read_many([key_of(0)])
    assert isinstance(got, CorruptObjectError)
    b.close()


def _atime_after_plain_read(path):
    """Set atime an hour before mtime, read ``path`` plainly, return whether the read moved atime (relatime
    and strictatime mounts do; noatime ones do not)."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))
    with open(path, "rb") as f:
        f.read()
    return os.stat(path).st_atime_ns != st.st_mtime_ns - 3600 * 10**9


def test_reads_leave_atime_alone(tmp_path):
    """Every read path opens objects O_NOATIME: the first read after a write would otherwise dirty the inode
    (~40% of a 256 KiB read on ext4 relatime); the LRU order lives in mtime."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    if not _atime_after_plain_read(probe):
        pytest.skip("this filesystem does not update atime on reads")
    with FileBackend(path=tmp_path / "d") as b:
        keys, data = [key_of(i) for i in range(3)], [chunk(i, 8192) for i in range(3)]
        b.write_many([(k, b.prepare(k, d)) for k, d in zip(keys, data, strict=True)])
        paths = [b.object_path(k) for k in keys]
        old = []
        for p in paths:
            st = os.stat(p)
            os.utime(p, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))
            old.append(os.stat(p).st_atime_ns)
        assert_same(b.read(keys[0]), data[0])  # careful whole-object read
        (obj,) = b.read_objects([keys[0]])  # the object as it is (write-back between disks)
        assert isinstance(obj, Hit)
        outs = [{n: torch.empty_like(v) for n, v in d.items()} for d in data[1:]]
        for got, d in zip(b.read_into_many(keys[1:], outs), data[1:], strict=True):  # planned reads
            assert isinstance(got, Hit)
            assert_same(got.value, d)
        b._reads._plans.clear()
        (got,) = b.read_into_many([keys[2]], [{n: torch.empty_like(v) for n, v in data[2].items()}])  # careful
        assert isinstance(got, Hit)
        assert_same(got.value, data[2])
        assert [os.stat(p).st_atime_ns for p in paths] == old


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to read as another user")
def test_objects_of_another_user_are_still_read(tmp_path):
    """O_NOATIME is refused (EPERM) on files the reader does not own: the open falls back to a plain one."""
    import tempfile

    folder = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(folder, 0o755)
        with FileBackend(path=os.path.join(folder, "d"), permissions="group") as b:
            b.write(key_of(1), chunk(1, 8192))
            path = b.object_path(key_of(1))
        for p in (os.path.join(folder, "d"), os.path.dirname(path)):
            os.chmod(p, 0o755)
        os.chmod(path, 0o644)
        pid = os.fork()
        if pid == 0:  # the child reads as nobody: exit 0 only if the fallback was needed and worked
            try:
                os.setuid(65534)
                try:
                    os.close(os.open(path, os.O_RDONLY | os.O_NOATIME))
                    os._exit(3)  # O_NOATIME was not refused: the fallback is not exercised
                except PermissionError:
                    pass
                fd = objfile.open_for_read(path)
                os._exit(0 if len(os.read(fd, 1 << 20)) == os.path.getsize(path) else 1)
            except BaseException:
                os._exit(2)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
