"""The store facade's contract, one test per finding of the turn-3 review and probe of 6bda77c.

Every test here failed on that commit: close racing the batched/async API (review #2, probe 1.7/1.10),
a remote outage freezing local caching (#3), a refused put poisoning flush (#6), read-path promotion
re-reading and writing every tier on the caller's thread (#4), an overwritten key reading back its first
value from a write-once remote (#7, probe 9.1/9.2), a deleted key coming back into a remote index (#9),
``out`` buffers that alias or carry the conjugate bit (probe 1.4-1.6), and the missing ``delete``, ``pin``
/ ``release`` and ``readiness`` calls (review D.5).
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import tierstore
from tierstore import errors
from tierstore.backends.fsspec import FsspecBackend
from tierstore.testing.data import assert_same, chunk, key_of

CHUNK = 8000  # bytes per test chunk


def wait_for(condition, timeout=10.0):
    """Wait until ``condition()`` holds (the effect of a background job)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def publish(url, keys, size=4096, **options):
    """Objects of ``keys`` written to the shared tier by another engine."""
    with FsspecBackend(url=url, **options) as other_engine:
        for k in keys:
            other_engine.write(key_of(k), chunk(k, size))


def refuse_writes(tier):
    """An outage: every write to ``tier``'s backend fails (undone by ``restore``)."""
    tier.backend.write_many = lambda items: [OSError("outage") for _ in items]


def restore(tier):
    del tier.backend.write_many  # the class's method again


def host_disk(tmp_path, host="16MiB", **extra):
    return {"tiers": [{"kind": "host", "capacity": host, "pinned": False},
                      {"kind": "disk", "path": str(tmp_path / "disk")}], **extra}


# ---------------------------------------------------------------------- close vs the batched API (#2)
def test_close_racing_put_many_async_loses_nothing_it_acknowledged(tmp_path):
    """Probe 1.10: the future resolved to 3,000 x True and only 158-394 chunks reached disk."""
    items = [(key_of(i), chunk(i, 4096)) for i in range(3000)]
    store = tierstore.open(host_disk(tmp_path, host="64MiB"))
    future = store.put_many_async(items)
    time.sleep(0.15)
    store.close(timeout=60)
    try:
        acked = future.result(timeout=60)
    except errors.ClosedError:
        acked = [False] * len(items)  # refused as a whole: nothing acknowledged, nothing to check
    with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}]}) as again:
        held = again.contains_many([k for k, _ in items])
    lost = [i for i, (a, h) in enumerate(zip(acked, held, strict=True)) if a and not h]
    assert not lost, f"{len(lost)} acknowledged chunks are not on disk after close"
    assert any(acked) or future.exception(timeout=0) is not None


def test_close_waits_for_a_running_put_many(tmp_path):
    """Review #2 / r01: a put_many running when close() starts must either land whole below or not be
    acknowledged."""
    store = tierstore.open(host_disk(tmp_path))
    disk = store.tier("disk")
    host = store.tier("host").backend
    original, entered = host.write_many, threading.Event()

    def slow_put(items):
        entered.set()
        time.sleep(0.05)
        return original(items)

    host.write_many = slow_put
    result: dict[str, object] = {}
    items = [(key_of(i), chunk(i)) for i in range(8)]
    worker = threading.Thread(target=lambda: result.update(ok=store.put_many(items)))
    worker.start()
    entered.wait(5)
    store.close(timeout=30)
    worker.join(30)
    assert result["ok"] == [True] * 8
    with tierstore.open({"tiers": [{"kind": "disk", "path": disk.backend.path}]}) as again:
        assert again.contains_many([key_of(i) for i in range(8)]) == [True] * 8


def test_close_waits_for_running_promotions_and_ends_the_queued_ones(tmp_path):
    """CI flake (test_state_machine_file_remote): close() cancelled queued promotion jobs without ending them
    (a prefetch future never resolved) and did not wait for the running ones, so the disk tier kept its
    directory locked after close() and reopening it raised LockedError."""
    store = tierstore.open(host_disk(tmp_path, max_in_flight=1))
    keys = [key_of(i) for i in range(6)]
    store.put_many([(k, chunk(i)) for i, k in enumerate(keys)])
    store.flush()
    assert store.evict(keys, tier="host") == len(keys)
    disk = store.tier("disk").backend
    original, entered = disk.read_tensors, threading.Event()

    def slow_read(key):  # inside the backend call: the directory is in use meanwhile
        entered.set()
        time.sleep(0.3)
        return original(key)

    disk.read_tensors = slow_read
    prefetched = store.prefetch(keys)
    assert entered.wait(10)
    store.close(timeout=30)
    with tierstore.open(host_disk(tmp_path)) as again:  # the directory is free at once
        assert again.contains_many(keys) == [True] * len(keys)
    try:
        held = prefetched.result(timeout=10)  # resolves: the queued jobs ended with ClosedError
    except errors.ClosedError:
        held = None
    assert held is None or held <= len(keys)


def test_a_prefetch_racing_a_reads_promotion_of_the_same_key_reports_it_promoted(tmp_path):
    """CI flake (test_state_machine_file_remote): a read's promotion was landing the key in the top tier when a
    prefetch of it began; the prefetch found the slot busy and reported 0 at once instead of the outcome."""
    store = tierstore.open(host_disk(tmp_path))
    try:
        store.put(key_of(1), chunk(1))
        store.flush()
        assert store.evict([key_of(1)], tier="host") == 1
        host = store.tier("host").backend
        original, landing = host.write_many, threading.Event()

        def slow_write(items):
            landing.set()
            time.sleep(0.3)
            return original(items)

        host.write_many = slow_write
        assert store.get(key_of(1)) is not None  # its promotion to host runs in the background
        assert landing.wait(10)
        assert store.prefetch([key_of(1)]).result(timeout=30) == 1
        assert store.where(key_of(1)) == "host"
    finally:
        store.close()


@pytest.mark.parametrize("call", ["contains", "contains_many", "lookup", "where", "readiness", "pin", "delete",
                                  "get_many", "put_many", "flush", "prefetch"])
def test_a_closed_store_refuses_every_call(tmp_path, call):
    """Probe 1.7: contains, contains_many and lookup still answered True from closed tiers."""
    store = tierstore.open(host_disk(tmp_path))
    store.put(key_of(1), chunk(1))
    store.close()
    k = key_of(1)
    args = {"contains": (k,), "contains_many": ([k],), "lookup": ([k],), "where": (k,), "readiness": ([k],),
            "pin": ([k],), "delete": ([k],), "get_many": ([k],), "put_many": ([(k, chunk(1))],), "flush": (),
            "prefetch": ([k],)}[call]
    with pytest.raises(errors.ClosedError):
        getattr(store, call)(*args)
    with pytest.raises(errors.ClosedError):
        store.get_many_async([k])


# ---------------------------------------------------------------------- pressure and flush (#3, #6)
def failing_remote(tmp_path, **extra):
    """A store over a file:// remote whose writes all fail (an outage) — and the remote tier."""
    store = tierstore.open({"tiers": [{"kind": "host", "capacity": 4 * 8192, "pinned": False},
                                      {"kind": "remote", "url": f"file://{tmp_path}/remote"}], **extra})
    remote = store.tier("remote")
    refuse_writes(remote)
    return store, remote


def test_a_remote_outage_does_not_freeze_local_caching(tmp_path):
    """Review #3: with the remote down, 20 of 20 new puts were refused once the host held dirty chunks."""
    store, _ = failing_remote(tmp_path)
    with store:
        ok = [store.put(key_of(i), chunk(i, CHUNK)) for i in range(20)]
        assert ok == [True] * 20
        for i in range(16, 20):  # the newest are served
            assert_same(store.get(key_of(i)), chunk(i, CHUNK))
        st = store.stats()
        assert st["on_pressure"] == "drop" and st["tiers"]["remote"]["writeback_dropped"] > 0
        with pytest.raises(errors.WriteBackError) as info:  # the held ones still fail; the dropped are named
            store.flush(timeout=30)
        assert info.value.dropped and not set(info.value.dropped) & set(info.value.failed)
        assert set(info.value.dropped) <= {key_of(i) for i in range(20)}


def test_keep_policy_keeps_every_dirty_chunk_and_the_put_says_it_was_refused(tmp_path):
    """Review #6: a refused put returned None, and every later flush raised for it forever."""
    store, remote = failing_remote(tmp_path, on_pressure="keep")
    with store:
        results = [store.put(key_of(i), chunk(i, CHUNK)) for i in range(6)]
        assert results[:4] == [True] * 4 and results[4:] == [False, False]  # the put itself reports it
        for i in range(4):
            assert_same(store.get(key_of(i)), chunk(i, CHUNK))  # nothing acknowledged was dropped
        restore(remote)  # the remote is back
        report = store.flush(timeout=30)  # the refused puts are not failures of write-back
        assert report.dropped == {}
        assert store.flush(timeout=30).dropped == {}


def test_every_flush_names_a_drop_until_the_key_is_put_again(tmp_path):
    store, remote = failing_remote(tmp_path)
    with store:
        for i in range(12):
            store.put(key_of(i), chunk(i, CHUNK))
        restore(remote)
        first = store.flush(timeout=30)
        assert first.dropped and all(v == ("remote",) for v in first.dropped.values())
        assert store.flush(timeout=30).dropped == first.dropped  # a second flusher learns of it too
        k = next(iter(first.dropped))
        store.put(k, chunk(99, CHUNK))
        assert k not in store.flush(timeout=30).dropped


# ---------------------------------------------------------------------- promotion (#4)
def test_retain_reads_each_remote_chunk_once_and_fills_the_disk_off_the_callers_thread(tmp_path):
    """Review #4: with one concurrent put every hit was read twice, and promotion wrote host and disk
    one key at a time on the caller's thread."""
    url = f"file://{tmp_path}/remote"
    n = 32
    publish(url, range(n), CHUNK)
    config = {"tiers": [{"kind": "host", "capacity": "16MiB", "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")}, {"kind": "remote", "url": url}]}
    with tierstore.open(config) as store:
        remote, disk = store.tier("remote").backend, store.tier("disk").backend
        reads, disk_writers, caller = [0], set(), threading.current_thread().name
        original_read, original_put = remote._read_encoded, disk.write_many

        def counted(key):
            reads[0] += 1
            time.sleep(0.002)  # widen the window for the concurrent put
            return original_read(key)

        def recorded(items):
            disk_writers.add(threading.current_thread().name)
            return original_put(items)

        remote._read_encoded, disk.write_many = counted, recorded
        stop = threading.Event()

        def put_other_keys() -> None:
            j = 1000
            while not stop.is_set():
                store.put(key_of(j), chunk(j, CHUNK))
                j += 1

        writer = threading.Thread(target=put_other_keys)
        writer.start()
        try:
            got = store.get_many([key_of(i) for i in range(n)])
        finally:
            stop.set()
            writer.join()
        assert all(g is not None for g in got)
        wait_for(lambda: all(store.where(key_of(i)) == "host" for i in range(n)))  # promoted by a job
        store.flush(timeout=30)
        assert reads[0] == n, f"{reads[0]} remote reads for {n} chunks"  # the promotion read none again
        assert all("disk" in store.holders(key_of(i)) for i in range(n))  # the tier in between, by write-back
        assert caller not in disk_writers


def test_a_read_never_admits_a_value_older_than_a_put_that_ended_meanwhile(tmp_path):
    """Rule 6 of write-back: the read found v1 below; a put of v2 ended before the read admitted v1."""
    store = tierstore.open({"tiers": [{"kind": "host", "capacity": "16MiB", "pinned": False},
                                      {"kind": "disk", "path": str(tmp_path / "disk")}],
                            "write_policy": "write_through"})
    with store:
        k = key_of(7)
        store.put(k, chunk(1, CHUNK))
        assert store.evict(k, tier="host") == 1  # v1 on disk only
        disk = store.tier("disk").backend
        original = disk.read_many

        def read_then_overwrite(keys, device="cpu"):
            got = original(keys, device=device)
            refuse_writes(store.tier("host"))  # the put of v2 lands on disk only (host refuses it)
            try:
                store.put(k, chunk(2, CHUNK))
            finally:
                restore(store.tier("host"))
            return got

        disk.read_many = read_then_overwrite
        assert_same(store.get_many([k])[0], chunk(1, CHUNK))  # what the read found
        disk.read_many = original
        time.sleep(0.2)  # the promotion job of what the read found has run (and refused)
        assert_same(store.get(k), chunk(2, CHUNK))  # never v1 admitted above v2


# ---------------------------------------------------------------------- overwrite with a remote tier (#7)
@pytest.mark.parametrize("backend", ["file", "s3"])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_an_overwritten_key_never_reads_back_its_first_value(tmp_path, request, backend, policy):
    """Probe 9.1/9.2: flush succeeded, and after eviction get returned v1 from the write-once remote."""
    if backend == "s3":
        server = request.getfixturevalue("s3_server")
        remote = {"kind": "remote", "url": f"s3://{server.new_bucket('ow')}/kv",
                  "storage_options": server.storage_options}
    else:
        remote = {"kind": "remote", "url": f"file://{tmp_path}/remote"}
    config = {"tiers": [{"kind": "host", "capacity": 2 * 8192, "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": 2 * 8192}, remote],
              "write_policy": policy}
    k = key_of(1)
    with tierstore.open(config) as store:
        store.put(k, chunk(1, CHUNK))
        store.flush(timeout=30)
        store.put(k, chunk(2, CHUNK))
        store.flush(timeout=30)
        for i in range(10, 30):  # push k out of host and disk
            store.put(key_of(i), chunk(i, CHUNK))
        store.flush(timeout=30)
        assert store.where(k) == "remote"
        assert_same(store.get(k), chunk(2, CHUNK))
    with tierstore.open({"tiers": [remote]}) as fresh:  # another process sees the new value too
        assert_same(fresh.get(k), chunk(2, CHUNK))


# ---------------------------------------------------------------------- a deleted key stays deleted (#9)
def test_a_read_racing_a_delete_does_not_bring_the_key_back_into_the_index(tmp_path):
    """Review #9: the reader fetched the object, the delete ran, then the reader indexed the key again."""
    url = f"file://{tmp_path}/remote"
    publish(url, [1])
    with tierstore.open({"tiers": [{"kind": "remote", "url": url, "list_on_open": False}]}) as store:
        backend = store.tier("remote").backend
        original, fetched, deleted = backend.read_many, threading.Event(), threading.Event()

        def fetch_then_wait(keys, device="cpu"):
            got = original(keys, device)
            fetched.set()
            deleted.wait(5)
            return got

        backend.read_many = fetch_then_wait
        reader = threading.Thread(target=lambda: store.get(key_of(1)))
        reader.start()
        assert fetched.wait(5)
        store.delete(key_of(1))
        deleted.set()
        reader.join(10)
        assert store.lookup([key_of(1)], probe=False) == 0  # the index did not take it back
        assert not store.contains(key_of(1))


# ---------------------------------------------------------------------- out buffers (probe 1.4-1.6)
@pytest.mark.parametrize("how", ["overlap", "same-buffer", "conj"])
def test_out_buffers_that_alias_or_carry_the_conjugate_bit_are_refused(tmp_path, how):
    with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}]}) as store:
        value = {"x": torch.arange(256, dtype=torch.float32).to(torch.complex64) * (1 + 1j)}
        store.put(key_of(1), value)
        store.put(key_of(2), {"x": value["x"] * 2})
        if how == "conj":
            outs = [{"x": torch.empty(256, dtype=torch.complex64).conj()}]
            keys = [key_of(1)]
        elif how == "overlap":
            buf = torch.empty(300, dtype=torch.complex64)
            outs, keys = [{"x": buf[:256]}, {"x": buf[40:296]}], [key_of(1), key_of(2)]
        else:
            buf = torch.empty(256, dtype=torch.complex64)
            outs, keys = [{"x": buf}, {"x": buf}], [key_of(1), key_of(2)]
        with pytest.raises(errors.InvalidInputError):
            store.get_many(keys, out=outs)
        with pytest.raises(errors.InvalidInputError):
            store.get_many_async(keys, out=outs).result(10)
        whole = torch.empty(512, dtype=torch.complex64)  # adjacent, not overlapping: fine
        got = store.get_many([key_of(1), key_of(2)], out=[{"x": whole[:256]}, {"x": whole[256:]}])
        assert torch.equal(got[0]["x"], value["x"]) and torch.equal(got[1]["x"], value["x"] * 2)


# ---------------------------------------------------------------------- delete, pin, readiness (D.5)
def test_delete_removes_a_key_from_every_tier_and_from_pending_write_back(tmp_path):
    config = {"tiers": [{"kind": "host", "capacity": "16MiB", "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")},
                        {"kind": "remote", "url": f"file://{tmp_path}/remote"}]}
    with tierstore.open(config) as store:
        store.put(key_of(1), chunk(1))
        store.flush(timeout=30)
        store.put(key_of(2), chunk(2))  # maybe still pending below
        assert store.delete([key_of(1), key_of(2), key_of(3)]) == 2
        store.flush(timeout=30)
        assert store.contains_many([key_of(1), key_of(2)]) == [False, False]
        assert store.holders(key_of(2)) == []
        assert all(t.backend.stat_many([key_of(2)]) == [None] for t in store.tiers)
        assert store.delete(key_of(1)) == 0
    with tierstore.open(config) as again:
        assert again.get(key_of(1)) is None and again.get(key_of(2)) is None


def test_pin_holds_keys_against_eviction_until_released(tmp_path):
    with tierstore.open(host_disk(tmp_path, host=3 * 8192)) as store:
        for i in range(3):
            store.put(key_of(i), chunk(i, CHUNK))
        pin = store.pin([key_of(0), key_of(1), key_of(9)])
        assert pin.ready == 2
        for i in range(3, 9):
            store.put(key_of(i), chunk(i, CHUNK))
        assert store.where(key_of(0)) == "host" and store.where(key_of(1)) == "host"
        store.flush(timeout=30)  # every chunk clean: nothing but the pins decides what is evicted
        store.release(pin)
        store.release(pin)  # a second release does nothing
        for i in range(9, 15):
            store.put(key_of(i), chunk(i, CHUNK))
        assert store.where(key_of(0)) == "disk"


def test_readiness_answers_at_once_and_reports_a_promotion_in_flight(tmp_path):
    url = f"file://{tmp_path}/remote"
    publish(url, range(2, 6))
    config = {"tiers": [{"kind": "host", "capacity": "16MiB", "pinned": False}, {"kind": "remote", "url": url}]}
    with tierstore.open(config) as store:
        store.put(key_of(0), chunk(0))
        store.put(key_of(1), chunk(1))
        remote = store.tier("remote").backend
        original, release = remote.stat_many, threading.Event()

        def slow_probe(keys):
            release.wait(10)
            return original(keys)

        remote.stat_many = slow_probe
        keys = [key_of(i) for i in range(8)]
        t0 = time.monotonic()
        first = store.readiness(keys)
        assert time.monotonic() - t0 < 1.0  # no I/O on the caller's thread
        assert first.ready == 2 and first.pending == 6  # being probed and promoted
        release.set()
        deadline = time.monotonic() + 30
        while (r := store.readiness(keys, promote=False)).pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r == tierstore.store.Readiness(ready=6, pending=0)


def test_get_takes_out_and_device_as_keywords_only(tmp_path):
    """Review #12: store.get(k, bufs) failed inside torch; now both calls take out/device as keywords."""
    with tierstore.open(host_disk(tmp_path)) as store:
        store.put(key_of(1), chunk(1))
        with pytest.raises(TypeError):
            store.get(key_of(1), {"k": torch.empty(1)})  # type: ignore[misc]
        out = {k: torch.empty_like(v) for k, v in chunk(1).items()}
        assert store.get(key_of(1), out=out) is not None and store.get_many([key_of(1)], out=[out])[0] is not None
        with pytest.raises(errors.InvalidInputError):
            store.get(key_of(1), out={"k": torch.empty(3)})


def test_switch_interval_race_of_put_many_async_and_close(tmp_path):
    """Many small races of close() against queued async puts: an acknowledged chunk is always on disk."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(5):
            path = tmp_path / f"r{round_}"
            store = tierstore.open({"tiers": [{"kind": "host", "capacity": "8MiB", "pinned": False},
                                              {"kind": "disk", "path": str(path)}]})
            base = round_ * 1000
            futures = [store.put_many_async([(key_of(base + 10 * j + i), chunk(i)) for i in range(10)])
                       for j in range(20)]
            store.close(timeout=60)
            acked = []
            for j, f in enumerate(futures):
                try:
                    acked += [key_of(base + 10 * j + i) for i, ok in enumerate(f.result(timeout=60)) if ok]
                except errors.ClosedError:
                    pass
            with tierstore.open({"tiers": [{"kind": "disk", "path": str(path)}]}) as again:
                assert all(again.contains_many(acked)), round_
    finally:
        sys.setswitchinterval(old)



# ---------------------------------------------------------------------- disk -> remote moves object bytes
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_write_back_from_disk_to_remote_moves_the_object_as_it_is(tmp_path, monkeypatch, codec):
    """Issue 17: write-back decoded the disk object into tensors and encoded it again (a second checksum pass
    and a copy); now the remote gets the disk object's bytes, encoded once, by the put."""
    from tierstore import objformat
    from tierstore.backends.layout import object_relpath

    encodes: list[str] = []
    original = objformat.encode

    def counted(*args, **kwargs):
        encodes.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(objformat, "encode", counted)
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "codec": codec},
                        {"kind": "remote", "url": f"file://{tmp_path}/remote", "compression": codec}]}
    with tierstore.open(config) as store:
        for i in range(8):
            store.put(key_of(i), chunk(i, CHUNK))
        store.flush(timeout=30)
        assert len(encodes) == 8 and not any(n.startswith("tierstore-writeback") for n in encodes)
        for i in range(8):
            rel = object_relpath(key_of(i))
            assert (tmp_path / "remote" / rel).read_bytes() == (tmp_path / "disk" / rel).read_bytes()
        assert store.stats()["tiers"]["remote"]["bytes_in"] == sum(
            (tmp_path / "disk" / object_relpath(key_of(i))).stat().st_size for i in range(8))


def test_write_through_never_serves_the_older_value_a_refusing_tier_kept(tmp_path):
    """A write_through put that one tier refuses leaves that tier pending (skipped by reads, retried by
    write-back) instead of serving the older value it still holds once the others evict the key."""
    config = {"tiers": [{"kind": "host", "capacity": 2 * 8192, "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": 2 * 8192},
                        {"kind": "remote", "url": f"file://{tmp_path}/remote"}], "write_policy": "write_through"}
    k = key_of(1)
    with tierstore.open(config) as store:
        assert store.put(k, chunk(1, CHUNK))
        remote = store.tier("remote")
        refuse_writes(remote)  # an outage: the remote keeps v1
        assert store.put(k, chunk(2, CHUNK))  # host and disk took it
        for i in range(10, 16):  # push k out of host and disk, as far as they may
            store.put(key_of(i), chunk(i, CHUNK))
        assert_same(store.get(k), chunk(2, CHUNK))
        restore(remote)  # back: write-back retries the remote
        store.flush(timeout=30)
        for i in range(20, 26):
            store.put(key_of(i), chunk(i, CHUNK))
        store.flush(timeout=30)
        assert_same(store.get(k), chunk(2, CHUNK))
    with tierstore.open({"tiers": [config["tiers"][2]]}) as fresh:
        assert_same(fresh.get(k), chunk(2, CHUNK))


def test_locate_names_the_tier_holding_each_key_of_the_leading_run(tmp_path):
    """``locate`` (what the token hit rate per tier counts): the highest tier holding each leading key's
    current value; ``local`` skips shared tiers without I/O; a tier pending an overwrite is skipped."""
    cfg = host_disk(tmp_path, prefetch_policy="transient")
    cfg["tiers"].append({"kind": "remote", "url": f"file://{tmp_path}/remote"})
    with tierstore.open(cfg) as store:
        keys = [key_of(i) for i in range(5)]
        for k in keys[:4]:
            assert store.put(k, chunk(0, CHUNK))
        store.flush()  # every tier holds keys 0-3
        assert store.evict(keys[:2], tier="host") == 2
        assert store.locate(keys) == ["disk", "disk", "host", "host"]
        assert store.lookup(keys) == 4
        assert store.evict(keys[0], tier="disk") == 1
        assert store.locate(keys) == ["remote", "disk", "host", "host"]
        assert store.locate(keys, local=True) == []  # key 0 is only in the shared tier
        assert store.locate(keys[1:], local=True) == ["disk", "host", "host"]
        assert store.locate([]) == []
        with pytest.raises(errors.InvalidTypeError):
            store.locate(keys[0])
