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
from tierstore.backends.file import FileBackend
from tierstore.backends.fsspec import FsspecBackend
from tierstore.testing.data import assert_same, chunk, key_of
from tierstore.transfers import Tier

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
    """The background writer into ``tier`` stops at its backend's ``write_many`` until released; other callers
    pass. Yields ``(arrived, release)``: ``arrived`` is set once the writer holds a batch (already read)."""
    arrived, release = threading.Event(), threading.Event()
    original = tier.backend.write_many

    def write_many(items):
        if in_writer():
            arrived.set()
            release.wait(10)
        return original(items)

    tier.backend.write_many = write_many
    try:
        yield arrived, release
    finally:
        release.set()


@contextmanager
def writer_paused(store: tierstore.TieredStore) -> Iterator[threading.Event]:
    """Write-back takes up no key (so it holds no slot and pins nothing) until released. Meanwhile it sleeps
    until the next change: with writes due and never taken, its idle wait would be zero (a spin that starves
    the test's own thread of the GIL: 30,000 puts ran past pytest's 10-minute timeout)."""
    writeback = store._writeback  # noqa: SLF001
    release, original, idle = threading.Event(), writeback._due, writeback._idle
    writeback._due = lambda: original() if release.is_set() else None
    writeback._idle = lambda: idle() if release.is_set() else 1.0
    try:
        yield release
    finally:
        release.set()
        store.residency.notify()


def refusing(tier: Tier, unless=lambda: False):
    """``tier``'s backend refuses every write (unless ``unless()``); ``del tier.backend.write_many`` undoes it."""
    original = tier.backend.write_many
    tier.backend.write_many = lambda items: original(items) if unless() else [OSError("refused") for _ in items]


def test_a_chunk_is_dirty_from_the_instant_a_tier_holds_it(tmp_path):
    """C1: an eviction between the top tier taking a chunk and put() returning must not drop it as clean."""
    with open_store(tmp_path, host=ONE) as s:
        host = s.tier("host").backend
        original = host.write_many
        s._transfers.pin_wait = 0.3

        def put_then_evict(items):
            stored = original(items)
            if items[0][0] == key_of(1):
                s.put(key_of(2), chunk(2, CHUNK))  # another put needs key 1's room in the window
            return stored

        host.write_many = put_then_evict
        s.put(key_of(1), chunk(1, CHUNK))
        del host.write_many
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
    with FsspecBackend(url=url) as other_engine:
        for i in range(n):
            other_engine.write(key_of(i), chunk(i, CHUNK))
    config = {"tiers": [{"kind": "host", "capacity": 2 * 8192, "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")},
                        {"kind": "remote", "url": url}], "on_pressure": "keep"}
    with tierstore.open(config) as s:
        disk = s.tier("disk")
        if eviction_write == "succeeds":
            behind = writer_stalled(disk)  # the disk writer falls behind the remote's (probe 1.5)
        else:
            behind = writer_paused(s)  # every writer falls behind; the disk refuses eviction writes
            refusing(disk, unless=in_writer)
        with behind:
            for i in range(n):
                s.put(key_of(i), chunk(i, CHUNK))
        s.flush(timeout=30)
        assert [i for i in range(n) if "disk" not in s.holders(key_of(i))] == []
        for i in range(n):
            assert_same(disk.backend.read(key_of(i)), chunk(i, CHUNK))


def test_failed_write_back_is_retried_and_the_dirty_chunk_kept_meanwhile(tmp_path):
    """C6a: transient failures of the lower tier (raised or refused) lose nothing, even across evictions."""
    with open_store(tmp_path) as s:
        lower = s.tier("lower")
        original, calls = lower.backend.write_many, [0]

        def flaky(items):
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(errno.EIO, "injected transient failure")  # (a backend that breaks its contract)
            if calls[0] == 2:
                return [OSError(errno.EIO, "refused") for _ in items]
            return original(items)

        lower.backend.write_many = flaky
        with writer_paused(s):  # only evictions write for now: their first two writes fail
            for i in range(8):  # the host holds 3
                s.put(key_of(i), chunk(i, CHUNK))
        s.flush(timeout=30)
        assert calls[0] > 2
        for i in range(8):
            assert "lower" in s.holders(key_of(i)), i
            assert_same(s.get(key_of(i)), chunk(i, CHUNK))


def test_flush_names_what_could_not_be_written_and_keeps_it_held(tmp_path, caplog):
    """C6a / contract 4: a lower tier that keeps refusing makes flush() raise WriteBackError naming keys and
    tiers; the dirty chunks are never evicted meanwhile, and once the tier recovers a flush writes them."""
    s = open_store(tmp_path)
    s.close_timeout = 2
    lower = s.tier("lower")
    refusing(lower)
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
    del lower.backend.write_many
    assert s.put(key_of(3), chunk(3, CHUNK))  # the tier is back: a put lands, and the retries flush grants succeed
    s.flush(timeout=30)
    assert all(s.where(key_of(i)) is not None and "lower" in s.holders(key_of(i)) for i in range(4))
    refusing(lower)
    s.put(key_of(4), chunk(4, CHUNK))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        s.close()  # never raises for write-back failures: one warning names what it abandoned
    assert any("abandoning write-back of 1 chunks" in r.getMessage() and key_of(4).hex()[:16] in r.getMessage()
               for r in caplog.records)
    s.close()


def test_close_waits_for_a_put_in_flight(tmp_path):
    """C.2: a put that passed the open check while close() starts is still flushed, not left behind."""
    s = open_store(tmp_path, lower="disk")
    host = s.tier("host").backend
    original, landed = host.write_many, threading.Event()

    def slow(items):
        stored = original(items)
        landed.set()
        time.sleep(0.3)  # close() begins while this put is between the host tier and its return
        return stored

    host.write_many = slow
    putter = threading.Thread(target=s.put, args=(key_of(1), chunk(1, CHUNK)))
    putter.start()
    assert landed.wait(10)
    s.close()
    putter.join(10)
    with FileBackend(path=tmp_path / "disk") as disk:
        assert_same(disk.read(key_of(1)), chunk(1, CHUNK))


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
    with FileBackend(path=tmp_path / "disk") as disk:
        missing = [i for i in acknowledged if disk.stat_many([key_of(i)])[0] is None]
    assert acknowledged and missing == []


def test_a_store_never_closed_is_flushed_at_interpreter_exit(tmp_path):
    """C10: a process that forgets close() still writes its chunks down before it exits (bounded)."""
    config = {"tiers": [{"kind": "host", "capacity": "4MiB", "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")}]}
    code = textwrap.dedent(f"""
        import time, tierstore
        from tierstore.testing.data import chunk, key_of
        s = tierstore.open({config!r})
        disk = s.tier("disk").backend
        original = disk.write_many
        disk.write_many = lambda items: (time.sleep(0.05), original(items))[1]  # a slow lower tier
        for i in range(40):
            s.put(key_of(i), chunk(i, {CHUNK}))
        print("exiting without close", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    with FileBackend(path=tmp_path / "disk") as disk:
        assert [i for i in range(40) if disk.stat_many([key_of(i)])[0] is None] == []
        assert_same(disk.read(key_of(39)), chunk(39, CHUNK))


def test_prefetch_does_not_wait_on_its_own_pin(tmp_path):
    """C9: promoting B into a full host evicts dirty A, whose write-back needs B's slot below; the prefetch
    must not hold B pinned there meanwhile (it used to wait pin_wait, then skip the promotion)."""
    s = tierstore.open({"tiers": [{"kind": "host", "capacity": ONE, "pinned": False},
                                  {"kind": "device", "device": "cpu", "name": "lower", "capacity": ONE}],
                        "prefetch_policy": "transient"})
    with s:
        s._transfers.pin_wait = 0.5
        s.put(key_of(1), chunk(1, CHUNK))  # B
        s.flush(timeout=30)
        with writer_paused(s):  # A stays dirty in the host, unpinned
            s.put(key_of(2), chunk(2, CHUNK))  # A evicts the clean B from the host
            assert s.where(key_of(1)) == "lower"
            assert s.prefetch([key_of(1)]).result(timeout=30) == 1
        assert s.stats()["tiers"]["lower"]["skipped"] == 0  # A's write below never gave up waiting on B's pin
        assert s.where(key_of(1)) == "host"
        assert_same(s.get(key_of(2)), chunk(2, CHUNK))  # A was written below before it left the host


def test_prefetch_surfaces_failures(tmp_path):
    """C10: an exception inside a promotion reaches the caller through the future and is counted."""
    with open_store(tmp_path) as s:
        s.put(key_of(1), chunk(1, CHUNK))

        def broken(keys, tiers=None):
            raise RuntimeError("injected control plane bug")

        s.residency.locate = broken
        with pytest.raises(RuntimeError, match="injected control plane bug"):
            s.prefetch([key_of(1), key_of(2)]).result(timeout=30)
        assert s.stats()["prefetch_errors"] == 2


@pytest.mark.parametrize("order", ["read_only_below", "read_only_on_top"])
def test_a_read_only_tier_serves_reads_and_is_never_written(tmp_path, order):
    """C10: a read_only disk tier inside a store: gets, promotions, puts and evictions never raise."""
    shared = tmp_path / "shared"
    with FileBackend(path=shared) as owner:
        owner.write(key_of(0), chunk(0, CHUNK))
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
    with FileBackend(path=shared, read_only=True) as view:
        assert [f.key for f in view.list()] == [key_of(0)]  # nothing was written into the read-only directory


def test_promotion_and_write_back_count_as_reads_of_the_tier_they_read(tmp_path):
    # a chunk promoted out of the shared tier, and one written back out of the disk tier, are bytes read
    # from those tiers (bytes_out, tierstore_read_bytes_total): shared-tier traffic must show
    shared = {"kind": "remote", "url": (tmp_path / "shared").as_uri()}
    with tierstore.open({"tiers": [shared]}) as writer:
        assert writer.put(key_of(1), chunk(1))
        writer.flush()
    cfg = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}, shared], "prefetch_policy": "retain"}
    with tierstore.open(cfg) as store:
        assert_same(store.get(key_of(1)), chunk(1))  # read from the remote, promoted into the disk
        store.flush()
        remote = store.stats()["tiers"]["remote"]
        assert remote["bytes_out"] == remote["used_bytes"] > 0
        before = store.stats()["tiers"]["disk"]["bytes_out"]
        assert store.put(key_of(2), chunk(2))
        store.flush()  # written back: read out of the disk tier as its object
        assert store.stats()["tiers"]["disk"]["bytes_out"] > before


def test_write_back_batches_follow_the_target_tiers_own_concurrency_and_overlap(tmp_path):
    """Review turn 4 #12: write-back into a remote that allows 32 requests at once sends batches of 32 (not the
    store's max_in_flight of 8), and a second batch is under way while the first one writes."""
    url = f"file://{tmp_path}/remote"
    config = {"tiers": [{"kind": "host", "capacity": "16MiB", "pinned": False},
                        {"kind": "remote", "url": url, "max_in_flight": 32}], "max_in_flight": 8}
    with tierstore.open(config) as s:
        remote = s.tier("remote").backend
        original, sizes, running, most, lock = remote.write_many, [], [0], [0], threading.Lock()

        def write_many(items):
            with lock:
                sizes.append(len(items))
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                time.sleep(0.1)  # a distant endpoint
                return original(items)
            finally:
                with lock:
                    running[0] -= 1

        remote.write_many = write_many
        with writer_paused(s):
            assert all(s.put_many([(key_of(i), chunk(i, 1024)) for i in range(128)]))
        s.flush(timeout=60)
        assert max(sizes) == 32 and sum(sizes) == 128
        assert most[0] == 2


def test_close_writes_a_backlog_that_drains_slower_than_its_timeout(tmp_path):
    """A healthy tier below that needs longer than ``close_timeout`` to take the backlog (here ~2-4 s against
    1 s; 30,000 chunks host->disk take ~12 s against the default 10 s): close() waits on while chunks are being
    written and abandons none. It gives up only once ``close_timeout`` passes with none written."""
    s = open_store(tmp_path, host="4MiB", lower="disk")
    s.close_timeout = 1.0
    lower = s.tier("lower")
    original = lower.backend.write_many

    def slow(items):
        time.sleep(0.05 * len(items))  # slow, not stuck: a batch of 8 lands every 0.4 s
        return original(items)

    n = 80
    lower.backend.write_many = slow
    assert all(s.put_many([(key_of(i), chunk(i, CHUNK)) for i in range(n)]))
    start = time.monotonic()
    s.close()
    assert time.monotonic() - start > s.close_timeout  # (the backlog did outlast the timeout)
    with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}]}) as again:
        assert again.stats()["tiers"]["disk"]["objects"] == n
        assert_same(again.get(key_of(n - 1)), chunk(n - 1, CHUNK))
