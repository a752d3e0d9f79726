"""The disk backend touches only its own files, keeps them private, and shares a host with other processes.

Probe rows 8.3, 8.4, 8.8 (deleting through symlinks / foreign files), 6.3 (``rm .lock``), 8.12 (modes),
and review §D.4 (two processes with the default config).
"""

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tierstore
from tierstore.backends import dirlock
from tierstore.backends.file import FileBackend
from tierstore.backends.fsspec import FsspecBackend
from tierstore.backends.layout import object_relpath, temp_name
from tierstore.errors import LockedError
from tierstore.store import TieredStore
from tierstore.testing.data import assert_same, chunk, key_of

REPO = str(Path(tierstore.__file__).resolve().parent.parent)


def _victim(tmp_path: Path, key_prefix: str = "ab") -> dict[Path, bytes]:
    """An outside folder full of files a careless cleanup would match (temp names, object names)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    hexname = key_prefix + "0" * 62
    files = {victim / "thesis-draft.docx": b"years of work", victim / "nightly.tmp": b"export",
             victim / f"{hexname}.1234.abcdef012345.tmp": b"an old-style temp name",
             victim / f"{hexname}.tso.{'0' * 32}.tmp": b"a temp name of ours",
             victim / f"{hexname}.tso": b"not an object"}
    for p, data in files.items():
        p.write_bytes(data)
    return files


def _intact(files: dict[Path, bytes]) -> bool:
    return all(p.is_file() and p.read_bytes() == data for p, data in files.items())


def _store(root: Path, **options) -> TieredStore:
    """A store whose one tier is the disk directory ``root``: opening it lists the directory (laying out its
    folders and removing our stale temp files), as every store does at open."""
    return TieredStore.from_backends([FileBackend(path=root, **options)])


def _tier(s: TieredStore) -> dict:
    (stats,) = s.stats()["tiers"].values()
    return stats


def test_symlinked_tmp_folder_is_not_emptied(tmp_path):  # probe 8.3
    root = tmp_path / "d"
    _store(root).close()
    files = _victim(tmp_path)
    if (root / "tmp").is_dir():  # older versions made a tmp/ folder; the attacker replaces it
        (root / "tmp").rmdir()
    os.symlink(tmp_path / "victim", root / "tmp")
    with _store(root) as s:  # the listing at open removes legacy temp files from tmp/: not through a link
        assert s.put(key_of(0), chunk(0))
    assert _intact(files)
    assert (root / "tmp").is_symlink()  # not ours to remove either


def test_symlinked_fanout_folder_is_neither_cleaned_nor_written(tmp_path):  # probe 8.4
    root = tmp_path / "d"
    _store(root).close()
    key = next(key_of(i) for i in range(10_000) if key_of(i).hex().startswith("ab"))
    (root / "ab").rmdir()
    files = _victim(tmp_path)
    os.symlink(tmp_path / "victim", root / "ab")
    with _store(root) as s:
        assert s.residency.keys(0) == []  # the planted <hex>.tso is not indexed
        assert s.put(key, chunk(1)) is False  # no write through the link: a counted, skipped put
        assert _tier(s)["errors"] == 1
        assert s.get(key) is None
        assert not key_of(0).hex().startswith("ab") and s.put(key_of(0), chunk(0))  # other folders work
        s.delete(key)  # nothing removed through the link either
    assert _intact(files) and sorted(os.listdir(tmp_path / "victim")) == sorted(p.name for p in files)


def test_foreign_files_in_a_shared_directory_are_kept(tmp_path):  # probe 8.8: `path: ~`
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    (home / "ab").mkdir()
    files = {home / "tmp" / "thesis-draft.docx": b"draft", home / "tmp" / "build.tmp": b"b",
             home / "notes.txt": b"n", home / "ab" / "leftover.tmp": b"l"}
    for p, data in files.items():
        p.write_bytes(data)
    with _store(home) as s:
        s.put(key_of(0), chunk(0))
    with _store(home) as s:
        assert_same(s.get(key_of(0)), chunk(0))
        assert s.residency.keys(0) == [key_of(0)]
    assert _intact(files)


def test_removing_the_lock_file_does_not_let_a_second_owner_in(tmp_path):  # probe 6.3
    root = tmp_path / "d"
    owner = FileBackend(path=root)
    os.unlink(root / ".lock")
    with pytest.raises(LockedError):
        FileBackend(path=root)
    (root / ".lock").write_text("1 elsewhere\n")  # a replaced note changes nothing either
    with pytest.raises(LockedError, match="pid 1 on host elsewhere"):
        FileBackend(path=root)
    owner.close()
    FileBackend(path=root).close()


def test_lock_falls_back_to_the_note_file_where_directories_cannot_be_locked(tmp_path, monkeypatch):
    import errno
    import fcntl

    real_flock = fcntl.flock

    def nfs_like_flock(fd, op):  # NFS: flock is a POSIX lock, which needs a descriptor open for writing
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)

    monkeypatch.setattr(dirlock.fcntl, "flock", nfs_like_flock)
    root = tmp_path / "d"
    owner = FileBackend(path=root)
    with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        FileBackend(path=root)
    owner.write(key_of(0), chunk(0))
    owner.close()
    b = FileBackend(path=root)
    assert_same(b.read(key_of(0)), chunk(0))
    b.close()


def _modes(root: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.lstat().st_mode))
            for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_created_private_whatever_the_umask(tmp_path, umask):  # probe 8.12
    old = os.umask(umask)
    try:
        with _store(tmp_path / "d") as s:  # every folder laid out at open, one object written
            assert s.put(key_of(0), chunk(0))
        r = FsspecBackend(url=(tmp_path / "shared" / "kv").as_uri())
        r.write(key_of(0), chunk(0))
        r.close()
    finally:
        os.umask(old)
    assert _modes(tmp_path / "d") == {("dir", 0o700), ("file", 0o600)}
    assert _modes(tmp_path / "shared") == {("dir", 0o700), ("file", 0o600)}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_group_permissions_when_asked(tmp_path, umask):
    old = os.umask(umask)
    try:
        with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "g"), "permissions": "group"},
                                       {"kind": "remote", "url": str(tmp_path / "r"), "permissions": "group"}],
                             "write_policy": "write_through"}) as store:
            store.put(key_of(0), chunk(0))
    finally:
        os.umask(old)
    assert _modes(tmp_path / "g") == {("dir", 0o770), ("file", 0o660)}
    assert _modes(tmp_path / "r") == {("dir", 0o770), ("file", 0o660)}


def test_reopen_tightens_folders_a_wider_umask_left(tmp_path):
    root = tmp_path / "d"
    _store(root).close()
    (root / "ab").chmod(0o755)
    _store(root).close()
    assert stat.S_IMODE((root / "ab").stat().st_mode) == 0o700


# ---------------------------------------------------------------------- several processes, one config
def _child(code: str, env: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, **env, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TIERSTORE_CONFIG", None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


_ENGINE = """
    import sys, time
    import tierstore
    from tierstore.testing.data import chunk, key_of
    i = int(sys.argv[1]) if len(sys.argv) > 1 else {i}
    store = tierstore.open()  # the embedded default config
    store.put(key_of(i), chunk(i))
    store.flush()
    print(store.tier("disk").backend.path, flush=True)
    time.sleep(120)
"""


def test_two_processes_with_the_default_config(tmp_path):  # review D.4
    env = {"HOME": str(tmp_path)}
    first = _child(_ENGINE.format(i=1), env)
    second = None
    try:
        path1 = first.stdout.readline().strip()
        assert path1, first.stderr.read()
        second = _child(_ENGINE.format(i=2), env)
        path2 = second.stdout.readline().strip()
        assert path2, second.stderr.read()
        base = str(tmp_path / ".cache" / "tierstore" / "disk")
        assert (path1, path2) == (base, base + ".1")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        first = _child(_ENGINE.format(i=3), env)  # a restart gets its own directory back
        assert first.stdout.readline().strip() == base, first.stderr.read()
        views = [FileBackend(path=p, read_only=True) for p in (base, base + ".1")]
        assert [len(list(v.list())) for v in views] == [2, 1]  # chunks 1 and 3 in disk, 2 in disk.1
        assert_same(views[1].read(key_of(2)), chunk(2))
        for v in views:
            v.close()
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_instances_all_taken_names_every_holder(tmp_path):
    owners = [FileBackend(path=tmp_path / "d", instances=2) for _ in range(2)]
    assert [o.path for o in owners] == [str(tmp_path / "d"), str(tmp_path / "d.1")]
    with pytest.raises(LockedError, match="all 2 directories are in use"):
        FileBackend(path=tmp_path / "d", instances=2)
    owners[0].close()
    b = FileBackend(path=tmp_path / "d", instances=2)
    assert b.path == str(tmp_path / "d")
    b.close()
    owners[1].close()


def test_read_only_disk_tier_inside_a_store_serves_and_is_never_written(tmp_path):  # review C10
    root = tmp_path / "d"
    with FileBackend(path=root) as owner:
        owner.write(key_of(0), chunk(0))
    cfg = {"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                     {"kind": "disk", "path": str(root), "read_only": True}],
           "write_policy": "write_through"}
    with tierstore.open(cfg) as store:
        assert_same(store.get(key_of(0)), chunk(0))  # served from the read-only tier, promoted to host
        assert store.put(key_of(1), chunk(1))  # raised ReadOnlyError before
        assert_same(store.get(key_of(1)), chunk(1))
        assert store.holders(key_of(1)) == ["host"]
        store.flush()  # nothing is pending for the read-only tier either
        assert store.stats()["tiers"]["disk"]["puts"] == 0 and store.stats()["pending_writeback"] == 0
        assert store.delete(key_of(0)) == 1  # the host copy goes; the read-only directory keeps its object
    assert not (root / object_relpath(key_of(1))).exists()
    assert (root / object_relpath(key_of(0))).exists()


def test_temp_names_are_unique_and_recognised():
    from tierstore.backends.layout import is_temp_name

    names = {temp_name(key_of(0)) for _ in range(100)}
    assert len(names) == 100 and all(is_temp_name(n) and is_temp_name(f"x/ab/{n}") for n in names)
    assert not any(is_temp_name(n) for n in ("nightly.tmp", f"{key_of(0).hex()}.tso", "a.tso.b.tmp",
                                              temp_name(key_of(0)) + ".tmp"))


def test_a_symlinked_lock_note_is_refused_and_its_target_kept(tmp_path):  # probe 8.7 (held; keep it)
    root = tmp_path / "d"
    FileBackend(path=root).close()
    target = tmp_path / "precious"
    target.write_text("keep me")
    (root / ".lock").unlink()
    (root / ".lock").symlink_to(target)
    with pytest.raises(tierstore.ConfigError, match=".lock"):
        FileBackend(path=root)
    assert target.read_text() == "keep me"
    FileBackend(path=root, read_only=True).close()  # a read-only view never writes the note


def test_an_older_version_holding_the_lock_file_is_respected(tmp_path):
    import fcntl

    root = tmp_path / "d"
    FileBackend(path=root).close()
    fd = os.open(root / ".lock", os.O_RDWR)  # what versions before the directory lock did
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(LockedError):
            FileBackend(path=root)
    finally:
        os.close(fd)
    FileBackend(path=root).close()


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_a_removed_folder_is_recreated_once_by_racing_writers(tmp_path, fast_switching):
    import threading

    root = tmp_path / "d"
    b = FileBackend(path=root, io_threads=8)
    list(b.list())  # what a store does at open: lays out the folders
    keys = [k for k in (key_of(i) for i in range(20_000)) if k.hex().startswith("ab")][:16]
    (root / "ab").rmdir()  # e.g. a cleanup script removed the empty folder
    start = threading.Barrier(8)
    results: list[BaseException | None] = []

    def writer(i: int) -> None:
        start.wait()
        results.extend(b.write_many([(k, b.prepare(k, chunk(j)))])[0] for j, k in enumerate(keys) if j % 8 == i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert results == [None] * 16 and b.stats()["failures"] == {}
    assert stat.S_IMODE((root / "ab").stat().st_mode) == 0o700
    for j, k in enumerate(keys):
        assert_same(b.read(k), chunk(j))
    b.close()
