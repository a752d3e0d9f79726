"""Write-back keeps what it acknowledged: regression tests for review C1, C4a, C6, C9, C10, C.2 and probe 1.5.

Each test forces its race deterministically: a tier method is wrapped so that the other party acts in
the exact window the bug needs (the background writer is recognised by its thread name).
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import tierstore
from tierstore import errors
from tierstore.testing.tiers import assert_same, chunk, key_of
from tierstore.tiers.base import Tier
from tierstore.tiers.disk import DiskTier
from tierstore.tiers.remote import RemoteTier

REPO = Path(__file__).resolve().parents[1]
CHUNK = 8000  # bytes per test chunk (two float32 tensors)
ONE = 12000  # a host capacity that holds exactly one chunk


def open_store(tmp_path: Path, host: int = 3 * 8192, lower: str = "device", **extra: object) -> tierstore.TieredStore:
    lower_tier = ({"kind": "device", "device": "cpu", "name": "lower", "capacity": "4MiB"} if lower == "device"
                  else {"kind": "disk", "path": str(tmp_path / "disk"), "name": "lower"})
    return tierstore.open({"tiers": [{"kind": "host", "capacity": host, "pinned": False}, lower_tier],
                           "on_pressure": "keep", **extra})  # the guarantees under test: nothing acknowledged dropped


def in_writer() -> bool:
    return threading.current_thread().name.startswith("tierstore-writeback")


@contextmanager
def writer_stalled(tier: Tier) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The background writer into ``tier`` stops at its ``put_many`` until released; other callers pass.

    Yields ``(arrived, release)``: ``arrived`` is set once the writer holds a batch (already read).
    """
    arrived, release = threading.Event(), threading.Event()
    original = tier.put_many

    def put_many(items, **kw):
        if in_writer():
            arrived.set()
            release.wait(10)
        return original(items, **kw)

    tier.put_many = put_many
    try:
        yield arrived, release
    finally:
        release.set()


@contextmanager
def writer_paused(store: tierstore.TieredStore) -> Iterator[threading.Event]:
    """Background writers wait before they take up any key (so they claim and pin nothing) until released."""
    owner, name = (store, "_write_down") if hasattr(store, "_write_down") else (store._wb, "_write")  # old: _write_down
    release, original = threading.Event(), getattr(owner, name)
    setattr(owner, name, lambda keys, level: (release.wait(10), original(keys, level))[1])
    try:
        yield release
    finally:
        release.set()


def test_a_chunk_is_dirty_from_the_instant_a_tier_holds_it(tmp_path):
    """C1: an eviction between the top tier taking a chunk and put() returning must not drop it as clean."""
    with open_store(tmp_path, host=ONE) as s:
        host = s.tier("host")
        original = host.put_many

        def put_then_evict(items, **kw):
            stored = original(items, **kw)
            if items[0][0] == key_of(1):
                host.put(key_of(2), chunk(2, CHUNK))  # another put evicts key 1 in the window
            return stored

        host.put_many = put_then_evict
        s.put(key_of(1), chunk(1, CHUNK))
        host.put_many = original
        s.flush(timeout=30)
        assert_same(s.get(key_of(1)), chunk(1, CHUNK))


def test_overwrite_during_write_back_never_leaves_the_old_value_below(tmp_path):
    """C4a: the writer has read v1 when put(k, v2) arrives; after eviction the lower tier must serve v2."""
    v1, v2 = chunk(1, CHUNK), chunk(2, CHUNK)
    with open_store(tmp_path) as s:
        with writer_stalled(s.tier("lower")) as (arrived, release):
            s.put(key_of(0), v1)
            assert arrived.wait(10)
            overwrite = threading.Thread(target=s.put, args=(key_of(0), v2))
            overwrite.start()  # the put may wait for the write in flight, but must not be overtaken by it
            time.sleep(0.2)
            release.set()
            overwrite.join(30)
            s.flush(timeout=30)
        for i in range(10, 16):  # push key 0 out of the host tier
            s.put(key_of(i), chunk(i, CHUNK))
        s.flush(timeout=30)
        assert s.where(key_of(0)) == "lower"
        assert_same(s.get(key_of(0)), v2)


@pytest.mark.parametrize("eviction_write", ["succeeds", "fails"])
def test_eviction_never_skips_a_pending_middle_tier(tmp_path, eviction_write):
    """C6b / probe 1.5: chunks another engine already published to the remote must still reach the disk.

    With ``fails``, the disk refuses the writes made during eviction: the victims may go (the remote holds
    them), and the disk's writer must read them from the deeper tier.
    """
    url = f"file://{tmp_path}/remote"
    n = 24
    with RemoteTier(url=url) as other_engine:
        assert all(other_engine.put_many([(key_of(i), chunk(i, CHUNK)) for i in range(n)]))
    config = {"tiers": [{"kind": "host", "capacity": 2 * 8192, "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")},
                        {"kind": "remote", "url": url}], "on_pressure": "keep"}
    with tierstore.open(config) as s:
        disk = s.tier("disk")
        if eviction_write == "succeeds":
            behind = writer_stalled(disk)  # the disk writer falls behind the remote's (probe 1.5)
        else:
            behind = writer_paused(s)  # every writer falls behind; the disk refuses eviction writes
            original = disk.put_many
            disk.put_many = lambda items, **kw: original(items, **kw) if in_writer() else [False] * len(items)
        with behind:
            for i in range(n):
                s.put(key_of(i), chunk(i, CHUNK))
        s.flush(timeout=30)
        assert [i for i in range(n) if not disk.contains(key_of(i), )] == []
        for i in range(n):
            assert_same(disk.get(key_of(i)), chunk(i, CHUNK))


def test_failed_write_back_is_retried_and_the_dirty_chunk_kept_meanwhile(tmp_path):
    """C6a: transient failures of the lower tier (raised or refused) lose nothing, even across evictions."""
    with open_store(tmp_path) as s:
        lower = s.tier("lower")
        original, calls = lower.put_many, [0]

        def flaky(items, **kw):
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(errno.EIO, "injected transient failure")
            if calls[0] == 2:
                return [False] * len(items)
            return original(items, **kw)

        lower.put_many = flaky
        with writer_paused(s):  # only evictions write for now: their first two writes fail
            for i in range(8):  # the host holds 3
                s.put(key_of(i), chunk(i, CHUNK))
        s.flush(timeout=30)
        assert calls[0] > 2
        for i in range(8):
            assert lower.contains(key_of(i)), i
            assert_same(s.get(key_of(i)), chunk(i, CHUNK))


def test_flush_names_what_could_not_be_written_and_keeps_it_held(tmp_path, caplog):
    """C6a / contract 4: a lower tier that keeps refusing makes flush() raise WriteBackError naming keys and
    tiers; the dirty chunks are never evicted meanwhile, and once the tier recovers a flush writes them."""
    s = open_store(tmp_path)
    s.close_timeout = 2
    lower = s.tier("lower")
    original = lower.put_many
    lower.put_many = lambda items, **kw: [False] * len(items)
    for i in range(3):
        s.put(key_of(i), chunk(i, CHUNK))
    with pytest.raises(errors.WriteBackError) as info:
        s.flush(timeout=30)
    assert info.value.failed == {key_of(i): ("lower",) for i in range(3)}
    assert isinstance(info.value, OSError) and isinstance(info.value, errors.TierstoreError)
    # the host is full of unwritten chunks: under on_pressure: keep none of them is dropped, so this put
    # lands nowhere, and says so itself (review #6: it is not a flush failure, now or later)
    assert s.put(key_of(3), chunk(3, CHUNK)) is False
    for i in range(3):
        assert_same(s.get(key_of(i)), chunk(i, CHUNK))
    assert s.stats()["tiers"]["host"]["evictions"] == 0
    with pytest.raises(errors.WriteBackError) as info:  # still failing: reported again until written
        s.flush(timeout=30)
    assert info.value.failed == {key_of(i): ("lower",) for i in range(3)}
    lower.put_many = original
    assert s.put(key_of(3), chunk(3, CHUNK))  # the tier is back: a put lands, and the retries flush grants succeed
    s.flush(timeout=30)
    assert all(s.where(key_of(i)) is not None and lower.contains(key_of(i)) for i in range(4))
    lower.put_many = lambda items, **kw: [False] * len(items)
    s.put(key_of(4), chunk(4, CHUNK))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        s.close()  # never raises for write-back failures: one warning names what it abandoned
    assert any("abandoning write-back of 1 chunks" in r.getMessage() and key_of(4).hex()[:16] in r.getMessage()
               for r in caplog.records)
    s.close()


def test_close_waits_for_a_put_in_flight(tmp_path):
    """C.2: a put that passed the open check while close() starts is still flushed, not left behind."""
    s = open_store(tmp_path, lower="disk")
    host = s.tier("host")
    original, landed = host.put_many, threading.Event()

    def slow(items, **kw):
        stored = original(items, **kw)
        landed.set()
        time.sleep(0.3)  # close() begins while this put is between the host tier and its return
        return stored

    host.put_many = slow
    putter = threading.Thread(target=s.put, args=(key_of(1), chunk(1, CHUNK)))
    putter.start()
    assert landed.wait(10)
    s.close()
    putter.join(10)
    with DiskTier(path=tmp_path / "disk") as disk:
        assert_same(disk.get(key_of(1)), chunk(1, CHUNK))


def test_close_is_idempotent_and_thread_safe_under_load(tmp_path):
    """C.2: many closers and putters at once: closers all return, puts either land or raise ClosedError, and
    every put that returned is on the disk afterwards."""
    s = open_store(tmp_path, lower="disk")
    acknowledged: list[int] = []
    unexpected: list[BaseException] = []
    start = threading.Barrier(8)

    def putter(w: int) -> None:
        start.wait()
        for i in range(200):
            try:
                s.put(key_of(w * 1000 + i), chunk(w * 1000 + i, CHUNK))
            except errors.ClosedError:
                return
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                unexpected.append(exc)
                return
            acknowledged.append(w * 1000 + i)

    def closer(_: int) -> None:
        start.wait()
        time.sleep(0.05)
        s.close()

    threads = [threading.Thread(target=putter, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=closer, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert not unexpected, unexpected
    with DiskTier(path=tmp_path / "disk") as disk:
        missing = [i for i in acknowledged if not disk.contains(key_of(i))]
    assert acknowledged and missing == []


def test_a_store_never_closed_is_flushed_at_interpreter_exit(tmp_path):
    """C10: a process that forgets close() still writes its chunks down before it exits (bounded)."""
    config = {"tiers": [{"kind": "host", "capacity": "4MiB", "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")}]}
    code = textwrap.dedent(f"""
        import time, tierstore
        from tierstore.testing.tiers import chunk, key_of
        s = tierstore.open({config!r})
        disk = s.tier("disk")
        original = disk.put_many
        disk.put_many = lambda items, **kw: (time.sleep(0.05), original(items, **kw))[1]  # a slow lower tier
        for i in range(40):
            s.put(key_of(i), chunk(i, {CHUNK}))
        print("exiting without close", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    with DiskTier(path=tmp_path / "disk") as disk:
        assert [i for i in range(40) if not disk.contains(key_of(i))] == []
        assert_same(disk.get(key_of(39)), chunk(39, CHUNK))


def test_prefetch_does_not_wait_on_its_own_pin(tmp_path):
    """C9: promoting B into a full host evicts dirty A, whose write-back needs B's slot below; the prefetch
    must not hold B pinned there meanwhile (it used to wait pin_wait, then skip the promotion)."""
    s = tierstore.open({"tiers": [{"kind": "host", "capacity": ONE, "pinned": False},
                                  {"kind": "device", "device": "cpu", "name": "lower", "capacity": ONE}],
                        "prefetch_policy": "transient"})
    with s:
        for t in s.tiers:
            t.pin_wait = 0.5
        s.put(key_of(1), chunk(1, CHUNK))  # B
        s.flush(timeout=30)
        with writer_paused(s):  # A stays dirty in the host, unpinned
            s.put(key_of(2), chunk(2, CHUNK))  # A evicts the clean B from the host
            assert s.where(key_of(1)) == "lower"
            assert s.prefetch([key_of(1)]).result(timeout=30) == 1
        assert s.tier("lower").stats()["skipped"] == 0  # A's write below never gave up waiting on B's pin
        assert s.where(key_of(1)) == "host"
        assert_same(s.get(key_of(2)), chunk(2, CHUNK))  # A was written below before it left the host


def test_prefetch_surfaces_failures(tmp_path):
    """C10: an exception inside a promotion reaches the caller through the future and is counted."""
    with open_store(tmp_path) as s:
        s.put(key_of(1), chunk(1, CHUNK))

        def broken(keys, probe=True):
            raise RuntimeError("injected tier bug")

        s.tier("lower").contains_many = broken
        s.tier("host").contains_many = broken
        with pytest.raises(RuntimeError, match="injected tier bug"):
            s.prefetch([key_of(1), key_of(2)]).result(timeout=30)
        assert s.stats()["prefetch_errors"] == 2


@pytest.mark.parametrize("order", ["read_only_below", "read_only_on_top"])
def test_a_read_only_tier_serves_reads_and_is_never_written(tmp_path, order):
    """C10: a read_only disk tier inside a store: gets, promotions, puts and evictions never raise."""
    shared = tmp_path / "shared"
    with DiskTier(path=shared) as owner:
        owner.put(key_of(0), chunk(0, CHUNK))
    ro = {"kind": "disk", "path": str(shared), "read_only": True, "name": "shared"}
    host = {"kind": "host", "capacity": 2 * 8192, "pinned": False}
    lower = {"kind": "device", "device": "cpu", "name": "lower", "capacity": "4MiB"}
    tiers = [host, ro] if order == "read_only_below" else [ro, lower]
    with tierstore.open({"tiers": tiers}) as s:
        assert_same(s.get(key_of(0)), chunk(0, CHUNK))  # served (and, below, promoted) without raising
        for i in range(1, 6):
            s.put(key_of(i), chunk(i, CHUNK))
        s.flush(timeout=30)
        assert s.prefetch([key_of(0), key_of(5)]).result(timeout=30) >= 0
        assert_same(s.get(key_of(5)), chunk(5, CHUNK))
        if order == "read_only_on_top":
            for i in range(1, 6):
                assert_same(s.get(key_of(i)), chunk(i, CHUNK))
    with DiskTier(path=shared, read_only=True) as view:
        assert view.keys() == [key_of(0)]  # nothing was written into the read-only directory


def test_promotion_and_write_back_count_as_reads_of_the_tier_they_read(tmp_path):
    # a chunk promoted out of the shared tier, and one written back out of the disk tier, are bytes read
    # from those tiers (bytes_out, tierstore_read_bytes_total): shared-tier traffic must show
    shared = {"kind": "remote", "url": (tmp_path / "shared").as_uri()}
    with tierstore.open({"tiers": [shared]}) as writer:
        assert writer.put(key_of(1), chunk(1))
        writer.flush()
    cfg = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}, shared], "prefetch_policy": "retain"}
    with tierstore.open(cfg) as store:
        disk, remote = store.tier("disk"), store.tier("remote")
        assert_same(store.get(key_of(1)), chunk(1))  # read from the remote, promoted into the disk
        store.flush()
        assert remote.stats()["bytes_out"] == remote.used_bytes > 0
        before = disk.stats()["bytes_out"]
        assert store.put(key_of(2), chunk(2))
        store.flush()  # written back: read out of the disk tier as its object
        assert disk.stats()["bytes_out"] > before
