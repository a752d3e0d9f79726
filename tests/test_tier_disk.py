import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import objformat
from tierstore.errors import ConfigError, InvalidInputError, LockedError
from tierstore.testing.data import TierTests, assert_same, chunk, key_of
from tierstore.tiers import objfile, tier_class
from tierstore.tiers.disk import DiskTier, ReadOnlyError
from tierstore.tiers.layout import object_relpath, temp_name

REPO = str(Path(tierstore.__file__).resolve().parent.parent)


def _files(root: Path, pattern: str = "*/*.tso") -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file())


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


class TestDiskTier(TierTests):
    persistent = True
    checksummed = True
    codec = "none"

    def make_tier(self, capacity):
        return DiskTier(capacity=capacity, path=self.tmp_path / "disk", codec=self.codec)

    def reopen(self, tier):
        tier.close()
        return DiskTier(name=tier.name, capacity=tier.capacity, path=tier.path, codec=tier.codec)

    def overwrite(self, tier, key, data):
        (Path(tier.path) / object_relpath(key)).write_bytes(data)

    def damage(self, tier, key, how):
        path = Path(tier.path) / object_relpath(key)
        data = bytearray(path.read_bytes())
        if how == "flip":
            hdr = objformat.parse_header(data)
            data[hdr.payload_offset] ^= 0x01
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))

    def test_used_bytes_equal_file_sizes(self):
        t = self.tier()
        for i in range(6):
            t.put(key_of(i), chunk(i, 1000 * (i + 1)))
        t.put(key_of(2), chunk(9, 777))  # overwrite with another size
        t.delete(key_of(4))
        files = _files(Path(t.path))
        assert len(files) == len(t) == 5
        assert t.used_bytes == sum(p.stat().st_size for p in files)


class TestDiskTierZstd(TestDiskTier):
    codec = "zstd"

    def damage(self, tier, key, how):
        path = Path(tier.path) / object_relpath(key)
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))


def test_zstd_shrinks_compressible_chunks(tmp_path):
    t = DiskTier(path=tmp_path / "z", codec="zstd")
    value = {"x": torch.zeros(1 << 16)}
    t.put(key_of(0), value)
    assert t.used_bytes < 4096
    assert_same(t.get(key_of(0)), value)
    t.close()


# ---------------------------------------------------------------------- open, paths, registry
def test_registered_kind_and_path_handling(tmp_path, monkeypatch):
    assert tier_class("disk") is DiskTier
    monkeypatch.setenv("HOME", str(tmp_path))
    t = DiskTier(path="~/nested/cache")
    assert t.path == str(tmp_path / "nested" / "cache")
    assert (tmp_path / "nested" / "cache" / "ab").is_dir()
    assert t.stats()["kind"] == "disk"
    t.close()


def test_unusable_path_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "sub"
    with pytest.raises(ConfigError, match="afile"):
        DiskTier(path=bad)
    with pytest.raises(ConfigError, match="afile"):
        DiskTier(path=tmp_path / "afile")
    with pytest.raises(ConfigError, match="nothere"):
        DiskTier(path=tmp_path / "nothere", read_only=True)
    with pytest.raises(ConfigError):
        DiskTier(path=None)
    with pytest.raises(ConfigError):
        DiskTier(path=tmp_path / "c", codec="lz4")
    with pytest.raises(ConfigError):
        DiskTier(path=tmp_path / "c", io_threads=0)


@pytest.mark.parametrize("io_threads", [1, 4])
def test_batched_io_keeps_order(tmp_path, io_threads):
    t = DiskTier(path=tmp_path / "d", io_threads=io_threads)
    items = [(key_of(i), chunk(i, 1000 + 8 * i)) for i in range(12)]
    assert t.put_many(items) == [True] * 12
    got = t.get_many([key_of(i) for i in range(13)])
    for (_, value), g in zip(items, got[:12], strict=True):
        assert_same(g, value)
    assert got[12] is None
    assert t.used_bytes == sum(p.stat().st_size for p in _files(Path(t.path)))
    t.close()
    with pytest.raises(tierstore.ClosedError):
        t.get_many([key_of(0), key_of(1)])


def test_stale_temp_files_removed_on_open(tmp_path):
    t = DiskTier(path=tmp_path / "d")
    t.put(key_of(0), chunk(0))
    t.close()
    root = tmp_path / "d"
    ours = root / key_of(1).hex()[:2] / temp_name(key_of(1))
    ours.write_bytes(b"half")
    (root / "tmp").mkdir()  # older versions staged objects in tmp/
    (root / "tmp" / f"{key_of(1).hex()}.123.abcdef012345.tmp").write_bytes(b"half")
    foreign = [root / "README", root / "ab" / "leftover.tmp", root / "ab" / f"{key_of(2).hex()}.tso.x.tmp"]
    for p in foreign:
        p.write_text("not ours")
    t = DiskTier(path=root)
    assert not ours.exists() and not (root / "tmp").exists()
    assert all(p.exists() for p in foreign)  # files that are not ours are left alone
    assert [k.hex() for k in t.keys()] == [key_of(0).hex()]
    t.close()


def test_lru_order_rebuilt_from_mtime(tmp_path):
    root = tmp_path / "d"
    t = DiskTier(path=root)
    for i in range(4):
        t.put(key_of(i), chunk(i))
    t.close()
    now = time.time()
    for age, i in zip((400, 100, 300, 200), range(4), strict=True):  # used: 0, 2, 3, 1; over a minute ago
        os.utime(root / object_relpath(key_of(i)), (now - age, now - age))
    t = DiskTier(path=root)
    assert t.keys() == [key_of(i) for i in (0, 2, 3, 1)]
    assert t.get(key_of(0)) is not None  # a hit refreshes mtime ...
    t.close()
    t = DiskTier(path=root)
    assert t.keys()[-1] == key_of(0)  # ... so it survives the restart as the most recently used
    t.close()


def test_reopen_with_lower_capacity_trims_lru(tmp_path):
    root = tmp_path / "d"
    t = DiskTier(path=root)
    for i in range(4):
        t.put(key_of(i), chunk(i, 8000))
        os.utime(root / object_relpath(key_of(i)), ns=(i * 10**9, i * 10**9))
    one = t.used_bytes // 4
    t.close()
    t = DiskTier(path=root, capacity=2 * one)
    assert t.keys() == [key_of(2), key_of(3)]
    assert t.used_bytes == sum(p.stat().st_size for p in _files(root)) <= t.capacity
    t.close()


def test_durable_mode(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    t = DiskTier(path=tmp_path / "d", durable=True)
    assert t.put(key_of(0), chunk(0))
    assert len(synced) == 2  # the file before the rename, its folder after
    assert_same(t.get(key_of(0)), chunk(0))
    t.close()
    t = DiskTier(path=tmp_path / "d", durable=True)
    assert_same(t.get(key_of(0)), chunk(0))
    t.close()


def test_hostile_files_are_misses(tmp_path):
    root = tmp_path / "d"
    t = DiskTier(path=root)
    t.put(key_of(0), chunk(0))
    t.close()
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
    t = DiskTier(path=root)
    assert all(p.exists() for p in misplaced)  # not ours: neither indexed nor removed
    assert not t.contains(key_of(7)) and not t.contains(key_of(8))
    assert len(t) == 5 and not t.contains(key_of(5)) and not t.contains(key_of(6))
    assert t.used_bytes == sum(p.stat().st_size for p in _files(root) if not p.is_symlink() and p not in misplaced)
    for i in (1, 2, 3, 4):
        assert t.get(key_of(i)) is None
        assert not (root / object_relpath(key_of(i))).exists()
    assert t.stats()["corrupt"] == 4
    assert_same(t.get(key_of(0)), chunk(0))
    assert t.get(key_of(6)) is None and t.get(key_of(5)) is None
    assert t.used_bytes == (root / object_relpath(key_of(0))).stat().st_size
    t.close()


# ---------------------------------------------------------------------- get into caller buffers
def test_load_into_reads_straight_into_out(tmp_path):
    t = DiskTier(path=tmp_path / "d")
    value = {"a": torch.randn(7, 3), "b": torch.arange(5, dtype=torch.int16), "s": torch.tensor(2.5),
             "e": torch.empty(0, 4), "m": torch.tensor([True, False, True])}
    t.put(key_of(0), value)
    out = {n: torch.empty_like(v) for n, v in value.items()}
    ptrs = {n: v.data_ptr() for n, v in out.items()}
    size = t.pin([key_of(0)])[0]
    try:
        got = t._load_into(key_of(0), size, out)
    finally:
        t.unpin([key_of(0)])
    assert {n: v.data_ptr() for n, v in got.items()} == ptrs
    assert_same(out, value)
    with pytest.raises(InvalidInputError):
        t._load_into(key_of(0), size, {"a": torch.empty(7, 3)})
    with pytest.raises(InvalidInputError):
        t._load_into(key_of(0), size, {**out, "a": torch.empty(3, 7)})
    # a non-contiguous destination goes through the copying path
    out2 = {**{n: torch.empty_like(v) for n, v in value.items()}, "a": torch.empty(3, 7).t()}
    got = t._load_into(key_of(0), size, out2)
    assert got["a"] is out2["a"]
    assert_same({n: v.contiguous() for n, v in got.items()}, value)
    # a damaged payload is detected after the read
    path = Path(t.path) / object_relpath(key_of(0))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(tierstore.CorruptObjectError):
        t._load_into(key_of(0), size, out)
    t.close()


def test_many_tensors_exceed_iov_max(tmp_path):
    t = DiskTier(path=tmp_path / "d")
    value = {f"t{i}": torch.full((3,), i, dtype=torch.int16) for i in range(1500)}  # > IOV_MAX parts
    t.put(key_of(0), value)
    assert_same(t.get(key_of(0)), value)
    out = {n: torch.empty_like(v) for n, v in value.items()}
    assert_same(t._load_into(key_of(0), t.used_bytes, out), value)
    t.close()


# ---------------------------------------------------------------------- read-only views
def test_read_only_view(tmp_path):
    root = tmp_path / "d"
    owner = DiskTier(path=root)
    owner.put(key_of(0), chunk(0))
    view = DiskTier(path=root, read_only=True)  # no lock needed beside the owner
    assert_same(view.get(key_of(0)), chunk(0))
    owner.put(key_of(1), chunk(1))
    assert_same(view.get(key_of(1)), chunk(1))  # found on storage although listed after open
    assert view.put(key_of(2), chunk(2)) is False and view.stats()["skipped"] == 1  # skipped, not raised
    assert not (root / object_relpath(key_of(2))).exists()
    with pytest.raises(ReadOnlyError, match="read-only"):
        view.delete(key_of(0))
    owner.delete(key_of(0))
    assert view.get(key_of(0)) is None  # vanished: a miss
    (root / object_relpath(key_of(1))).write_bytes(b"garbage")
    assert view.get(key_of(1)) is None and view.stats()["corrupt"] == 1
    assert (root / object_relpath(key_of(1))).exists()  # a read-only view never removes files
    view.close()
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
        from tierstore.tiers.disk import DiskTier
        from tierstore.testing.data import chunk, key_of
        t = DiskTier(path={str(root)!r})
        t.put(key_of(0), chunk(0))
        print("ready", flush=True)
        time.sleep(120)
    """)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with pytest.raises(LockedError, match=f"pid {child.pid}") as info:
            DiskTier(path=root)
        assert isinstance(info.value, BlockingIOError)
        view = DiskTier(path=root, read_only=True)  # inspecting beside the owner is fine
        assert_same(view.get(key_of(0)), chunk(0))
        view.close()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        t = DiskTier(path=root)  # the kernel released the dead holder's lock
        assert_same(t.get(key_of(0)), chunk(0))
        # now we hold it: the lock note names us, and a second opener is refused
        assert (root / ".lock").read_text().split()[0] == str(os.getpid())
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            DiskTier(path=root)
        t.close()
        DiskTier(path=root).close()  # close released it
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
        from tierstore.tiers.disk import DiskTier
        from tierstore.testing.data import chunk, key_of
        t = DiskTier(path={str(root)!r})
        for i in range(5):
            t.put(key_of(i), chunk(i, 1 << 18))
        real_replace = os.replace
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = die
        t.put(key_of(5), chunk(5, 1 << 18))
    """)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert _tmp_files(root), "the killed writer should have left a temp file behind"
    child = _child(f"""
        from tierstore.tiers.disk import DiskTier
        from tierstore.testing.data import chunk, key_of
        t = DiskTier(path={str(root)!r})
        i = 10
        while True:
            t.put(key_of(i), chunk(i, 1 << 18))
            print(i, flush=True)
            i += 1
    """)
    try:
        for _ in range(30):
            assert child.stdout.readline(), child.stderr.read()
    finally:
        child.kill()
        child.wait()
    t = DiskTier(path=root)
    assert _tmp_files(root) == []
    assert t.used_bytes == sum(p.stat().st_size for p in _files(root))
    keys = {k.hex() for k in t.keys()}
    assert {key_of(i).hex() for i in range(5)} <= keys and key_of(5).hex() not in keys
    assert len(keys) >= 35
    hits = 0
    for k in t.keys():
        i = next(i for i in list(range(5)) + list(range(10, 10 + len(keys))) if key_of(i) == k)
        got = t.get(k)
        if got is not None:
            assert_same(got, chunk(i, 1 << 18))
            hits += 1
    assert hits + t.stats()["corrupt"] == len(keys)
    t.close()


# ---------------------------------------------------------------------- a full filesystem
def _fault_fs(monkeypatch, limit: int):
    """Make writes under the tier fail with ENOSPC once ``limit`` bytes of files exist (fallback)."""
    real_writev = os.writev

    def writev(fd, bufs):
        used = sum(p.stat().st_size for p in _FS_ROOT[0].rglob("*") if p.is_file())
        if used + sum(len(memoryview(b)) for b in bufs) > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writev(fd, bufs)

    monkeypatch.setattr(os, "writev", writev)


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


def _fill_until_enospc(t: DiskTier, nbytes: int, n: int) -> None:
    for i in range(n):
        assert t.put(key_of(i), chunk(i, nbytes)), i  # every put lands: older chunks make room
        assert t.used_bytes <= t.capacity if t.capacity is not None else True


def _check_after_enospc(t: DiskTier, root: Path, nbytes: int, n: int) -> None:
    st = t.stats()
    assert st["enospc"] >= 1
    limit = st["space_limit_bytes"]  # what the storage really holds, until free space is probed again
    assert limit is not None and limit < 1 << 20
    assert t.used_bytes <= limit
    assert t.used_bytes == sum(p.stat().st_size for p in _files(root))
    assert _tmp_files(root) == []
    kept = [i for i in range(n) if t.contains(key_of(i))]
    assert kept and kept == list(range(n - len(kept), n))  # the newest chunks survived
    assert_same(t.get(key_of(n - 1)), chunk(n - 1, nbytes))


def test_enospc_on_a_real_small_filesystem(small_fs):
    t = DiskTier(path=small_fs / "d", capacity=64 << 20)  # capacity far above what the fs holds
    _fill_until_enospc(t, 100_000, 30)
    _check_after_enospc(t, small_fs / "d", 100_000, 30)
    t.close()


def test_enospc_injected(tmp_path, monkeypatch):
    root = tmp_path / "d"
    _FS_ROOT[:] = [root]
    t = DiskTier(path=root)  # unbounded until the "disk" fills
    _fault_fs(monkeypatch, 1 << 20)
    _fill_until_enospc(t, 100_000, 30)
    _check_after_enospc(t, root, 100_000, 30)
    t.close()


def test_a_failed_read_never_forgets_a_newer_object(tmp_path):
    """A reader that pinned a key, then failed on its object (deleted or damaged meanwhile), must not drop
    the object a put stored under that key after its pin (found by tests/test_store_threads.py)."""
    t = DiskTier(path=tmp_path / "d")
    t.put(key_of(0), chunk(0))
    t.pin([key_of(0)])  # a reader is about to open the object
    t.delete(key_of(0))  # ... which vanishes under it
    t.put(key_of(0), chunk(1))  # and is stored again
    t._forget(key_of(0))  # the reader's FileNotFoundError path
    t.unpin([key_of(0)])
    assert_same(t.get(key_of(0)), chunk(1))
    t.close()


def test_one_enospc_does_not_disable_the_tier(tmp_path, monkeypatch):
    """C8: after ENOSPC the tier backs off and re-probes free space; it is not cut to 0 bytes for good."""
    t = DiskTier(path=tmp_path / "d")  # unbounded, and empty when the device reports full
    t.enospc_recheck = 0.05
    real_writev, failures = os.writev, [1]

    def writev(fd, bufs):
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writev(fd, bufs)

    monkeypatch.setattr(os, "writev", writev)
    assert not t.put(key_of(0), chunk(0))  # nothing to evict: this put is skipped
    assert t.stats()["enospc"] == 1
    time.sleep(0.1)  # the back-off passes; free space is probed again
    assert [t.put(key_of(i), chunk(i)) for i in range(1, 4)] == [True] * 3
    assert t.stats()["space_limit_bytes"] is None or t.stats()["space_limit_bytes"] > t.used_bytes
    assert_same(t.get(key_of(3)), chunk(3))
    t.close()


def test_large_odd_sized_tensors_across_read_pieces(tmp_path):
    t = DiskTier(path=tmp_path / "d")
    g = torch.Generator().manual_seed(0)
    value = {"a": torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=g),
             "b": torch.randn(333_333, generator=g), "c": torch.randint(0, 9, (7,), generator=g)}
    t.put(key_of(0), value)
    assert_same(t.get(key_of(0)), value)
    out = {n: torch.empty_like(v) for n, v in value.items()}
    assert_same(t._load_into(key_of(0), t.used_bytes, out), value)
    path = Path(t.path) / object_relpath(key_of(0))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04  # a bit deep inside the second read piece or later
    path.write_bytes(bytes(data))
    with pytest.raises(tierstore.CorruptObjectError):
        t._load_into(key_of(0), t.used_bytes, out)
    assert t.get(key_of(0)) is None and t.stats()["corrupt"] == 1
    t.close()


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
    with DiskTier(path=tmp_path / "d") as t:
        keys, data = [key_of(i) for i in range(3)], [chunk(i, 8192) for i in range(3)]
        t.put_many(list(zip(keys, data, strict=True)))
        paths = [t.object_path(k) for k in keys]
        old = []
        for p in paths:
            st = os.stat(p)
            os.utime(p, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))
            old.append(os.stat(p).st_atime_ns)
        assert_same(t.get(keys[0]), data[0])  # careful whole-object read
        outs = [{n: torch.empty_like(v) for n, v in d.items()} for d in data[1:]]
        for got, d in zip(t.get_many_into(keys[1:], outs), data[1:], strict=True):  # planned reads
            assert_same(got, d)
        t._batched._plans.clear()
        assert_same(t.get(keys[2], out={n: torch.empty_like(v) for n, v in data[2].items()}), data[2])  # careful
        assert [os.stat(p).st_atime_ns for p in paths] == old


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to read as another user")
def test_objects_of_another_user_are_still_read(tmp_path):
    """O_NOATIME is refused (EPERM) on files the reader does not own: the open falls back to a plain one."""
    import tempfile

    folder = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(folder, 0o755)
        with DiskTier(path=os.path.join(folder, "d"), permissions="group") as t:
            t.put(key_of(1), chunk(1, 8192))
            path = t.object_path(key_of(1))
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
