"""The batched and asynchronous store API: per-key results, misses, duplicates, out= buffers, isolated
errors, write-back marking, concurrent probing in lookup, futures."""

import os
import sys
import threading
import time

import pytest
import torch

import tierstore
from tierstore.backends.fsspec import FsspecBackend
from tierstore.errors import ClosedError, InvalidInputError, InvalidTypeError
from tierstore.testing.data import assert_same, chunk, key_of, run_threads

CHUNK = 8000


def _wait_for(condition, timeout=10.0):
    """Wait until ``condition()`` holds (the effect of a background job)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def open_store(tmp_path, host=3 * 8192, **extra):
    return tierstore.open({"tiers": [{"kind": "host", "capacity": host, "pinned": False},
                                     {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "4MiB"}],
                           **extra})


def empty_like(data):
    return {n: torch.empty_like(t) for n, t in data.items()}


def pins(store, settle=5.0):
    """Pins held per tier once in-flight background copies are done (a redundant write-back may still
    hold one for a moment after flush; a leaked pin never goes away)."""
    deadline = time.monotonic() + settle
    while True:
        held = {name: t["pinned"] for name, t in store.stats()["tiers"].items()}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.01)


def test_get_many_per_key_from_each_tier_and_misses_in_order(tmp_path):
    with open_store(tmp_path) as s:
        for i in range(6):  # host holds 3: the first ones end up on disk only
            s.put(key_of(i), chunk(i, CHUNK))
        s.flush()
        where = {i: s.where(key_of(i)) for i in range(6)}
        assert set(where.values()) == {"host", "disk"}
        keys = [key_of(5), key_of(99), key_of(0), key_of(3), key_of(98)]
        got = s.get_many(keys)
        assert got[1] is None and got[4] is None
        for i, r in zip((5, 0, 3), (got[0], got[2], got[3]), strict=True):
            assert_same(r, chunk(i, CHUNK))
        st = s.stats()
        assert st["hits"] == 3 and st["misses"] == 2
        s.flush()  # promotion is a background job: a flush waits for the tiers it fills
        _wait_for(lambda: s.where(key_of(0)) == "host")  # retain: a disk hit is promoted like get() does
        assert pins(s) == {"host": 0, "disk": 0}


def test_get_many_fills_out_buffers_and_isolates_a_bad_one(tmp_path):
    with open_store(tmp_path) as s:
        for i in range(5):
            s.put(key_of(i), chunk(i, CHUNK))
        s.flush()
        outs = [empty_like(chunk(i, CHUNK)) for i in range(5)]
        outs[2] = {"k": torch.empty(3), "v": torch.empty(3)}  # wrong shape for chunk 2
        got = s.get_many([key_of(i) for i in range(5)], out=outs)
        assert got[2] is None
        for i in (0, 1, 3, 4):
            assert_same(got[i], chunk(i, CHUNK))
            assert got[i]["k"].data_ptr() == outs[i]["k"].data_ptr()  # filled in place, no allocation
        assert pins(s) == {"host": 0, "disk": 0}
        with pytest.raises(InvalidInputError):
            s.get_many([key_of(0)], out=outs)  # one out per key
        with pytest.raises(InvalidTypeError):
            s.get_many(key_of(0))


def test_duplicate_keys_leave_no_pins(tmp_path):
    with open_store(tmp_path) as s:
        s.put(key_of(1), chunk(1, CHUNK))
        s.flush()
        got = s.get_many([key_of(1), key_of(1), key_of(2), key_of(1)])
        assert got[2] is None and all(got[i] is not None for i in (0, 1, 3))
        assert pins(s) == {"host": 0, "disk": 0}
        got = s.get_many([key_of(1)] * 4, out=[empty_like(chunk(1, CHUNK)) for _ in range(4)])
        for r in got:
            assert_same(r, chunk(1, CHUNK))
        assert len({id(r["k"]) for r in got}) == 4
        assert pins(s) == {"host": 0, "disk": 0}
        s.put(key_of(2), chunk(2, CHUNK))  # a pinned key would block eviction; none is left pinned
        s.put(key_of(3), chunk(3, CHUNK))
        s.put(key_of(4), chunk(4, CHUNK))
        assert s.stats()["tiers"]["host"]["evictions"] >= 1


def test_put_many_marks_dirty_like_put_and_rejects_bad_items_alone(tmp_path):
    with open_store(tmp_path) as s:
        items = [(key_of(i), chunk(i, CHUNK)) for i in range(3)]
        items.insert(1, ("not a key", chunk(9, CHUNK)))
        items.insert(3, (key_of(7), {"x": "not a tensor"}))
        items.append(42)
        items.append((key_of(0), chunk(0, CHUNK)))  # a duplicate is fine
        ok = s.put_many(items)
        assert ok == [True, False, True, False, True, False, True]
        assert s.stats()["pending_writeback"] <= 3
        s.flush()
        for i in range(3):
            assert "disk" in s.holders(key_of(i))
            assert_same(s.get(key_of(i)), chunk(i, CHUNK))
        assert s.stats()["tiers"]["disk"]["writeback_failed"] == 0
        with pytest.raises(InvalidTypeError):
            s.put_many({"k": torch.zeros(1)})


def test_put_many_refuses_per_item_what_put_refuses(tmp_path):
    """The object format's limits (dims, dimension size) apply to each batch item as to ``put``."""
    deep = {"x": torch.zeros([1] * 65)}  # a valid tensor, but the format allows 64 dims
    wide = {"x": torch.zeros(0, 1 << 41)}  # empty, but a dimension over the format's limit
    with open_store(tmp_path) as s:
        for bad in (deep, wide):
            with pytest.raises(InvalidInputError):
                s.put(key_of(8), bad)
        ok = s.put_many([(key_of(0), chunk(0, CHUNK)), (key_of(8), deep), (key_of(9), wide),
                         (key_of(1), chunk(1, CHUNK))])
        assert ok == [True, False, False, True]
        s.flush()
        assert not s.contains(key_of(8)) and not s.contains(key_of(9))
        for i in range(2):
            assert_same(s.get(key_of(i)), chunk(i, CHUNK))


def test_put_many_write_through_and_oversize(tmp_path):
    with open_store(tmp_path, write_policy="write_through") as s:
        big = {"x": torch.zeros(40_000)}  # 160 kB: too big for the host tier, fits on disk
        ok = s.put_many([(key_of(1), chunk(1, CHUNK)), (key_of(2), big)])
        assert ok == [True, True]
        assert s.holders(key_of(1)) == ["host", "disk"]
        assert s.where(key_of(2)) == "disk"


def test_contains_many_and_async_forms(tmp_path):
    with open_store(tmp_path) as s:
        fut = s.put_many_async([(key_of(i), chunk(i, CHUNK)) for i in range(4)])
        assert fut.result(10) == [True] * 4
        assert s.contains_many([key_of(0), key_of(9), key_of(3)]) == [True, False, True]
        assert s.contains_many_async([key_of(9)]).result(10) == [False]
        outs = [empty_like(chunk(i, CHUNK)) for i in range(4)]
        got = s.get_many_async([key_of(i) for i in range(4)], out=outs).result(10)
        for i in range(4):
            assert_same(got[i], chunk(i, CHUNK))
    with pytest.raises(ClosedError):
        s.get_many_async([key_of(0)])


def test_batched_calls_under_a_thread_storm_stay_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    sys.setswitchinterval(1e-6)
    try:
        with open_store(tmp_path, host=4 * 8192) as s:
            def worker(t):
                for r in range(6):
                    ids = [(t + r + j) % 10 for j in range(4)] + [t % 10]  # overlapping keys, a duplicate
                    assert all(s.put_many([(key_of(i), chunk(i, CHUNK)) for i in ids]))
                    for i, got in zip(ids, s.get_many([key_of(i) for i in ids]), strict=True):
                        if got is not None:  # evicted in between is a miss, never wrong data
                            assert_same(got, chunk(i, CHUNK))
            run_threads(worker, 6)
            s.flush()
            assert pins(s) == {"host": 0, "disk": 0}
            for i in range(10):
                assert_same(s.get(key_of(i)), chunk(i, CHUNK))
    finally:
        sys.setswitchinterval(0.005)


def test_lookup_probes_a_cold_shared_prefix_concurrently(tmp_path, monkeypatch):
    url = f"file://{tmp_path / 'shared'}"
    with FsspecBackend(url=url) as writer:
        for i in range(64):
            writer.write(key_of(i), chunk(i, 512))
    # a second instance opened without listing: every key must be found in storage
    reader = tierstore.open({"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                                       {"kind": "remote", "url": url, "list_on_open": False,
                                        "max_in_flight": 16}]})
    active, peak, calls = [0], [0], [0]
    lock = threading.Lock()
    original = FsspecBackend._stat

    def slow_stat(self, key):  # a 20 ms round trip per HEAD
        with lock:
            active[0] += 1
            calls[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.02)
            return original(self, key)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(FsspecBackend, "_stat", slow_stat)
    with reader:
        keys = [key_of(i) for i in range(64)] + [key_of(1000 + i) for i in range(200)]
        assert reader.lookup(keys) == 64
        assert peak[0] >= 8  # HEADs overlap instead of running one by one
        assert calls[0] <= 64 + 64  # the misses past the run are probed one window at a time, not all 200
        calls[0] = 0
        assert reader.lookup(keys[:64]) == 64
        assert calls[0] == 0  # found keys are in the index now


def test_get_many_from_the_remote_tier_only(s3_server, s3_bucket):
    options = s3_server.storage_options
    url = f"s3://{s3_bucket}/kv"
    with FsspecBackend(url=url, storage_options=options) as writer:
        for i in range(8):
            writer.write(key_of(i), chunk(i, CHUNK))
    cfg = {"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                     {"kind": "remote", "url": url, "storage_options": options, "list_on_open": False}]}
    with tierstore.open(cfg) as s:
        keys = [key_of(i) for i in range(10)]
        got = s.get_many(keys, out=[empty_like(chunk(i, CHUNK)) for i in range(10)])
        assert got[8] is None and got[9] is None
        s.flush()
        for i in range(8):
            assert_same(got[i], chunk(i, CHUNK))
            _wait_for(lambda i=i: s.where(key_of(i)) == "host")  # promoted by a background job


def test_get_many_of_a_batch_at_one_tier_counts_it_once_and_falls_back_per_key(tmp_path):
    """A batch whose keys all sit at one tier is read in one go (its hits counted as one batch); a key that
    tier fails is then read from the tier below, the rest of the batch untouched."""
    cfg = {"tiers": [{"kind": "disk", "name": "a", "path": str(tmp_path / "a"), "capacity": "4MiB"},
                     {"kind": "disk", "name": "b", "path": str(tmp_path / "b"), "capacity": "4MiB"}],
           "write_policy": "write_through", "prefetch_policy": "transient"}
    with tierstore.open(cfg) as s:
        data = {i: chunk(i, CHUNK) for i in range(6)}
        assert s.put_many([(key_of(i), data[i]) for i in range(6)]) == [True] * 6
        keys = [key_of(i) for i in (0, 1, 2, 3, 4, 5, 2)]  # a duplicate gets its own result
        outs = [empty_like(data[0]) for _ in keys]
        before = s.stats()["tiers"]
        got = s.get_many(keys, out=outs)
        for i, r, o in zip((0, 1, 2, 3, 4, 5, 2), got, outs, strict=True):
            assert r is not None and all(r[n] is o[n] for n in o)
            assert_same(o, data[i])
        after = s.stats()["tiers"]
        assert after["a"]["hits"] - before["a"]["hits"] == 7 and after["b"]["hits"] == before["b"]["hits"]
        assert after["a"]["bytes_out"] - before["a"]["bytes_out"] == 7 * s.tier("a").backend.stat_many(
            [key_of(0)])[0]

        os.unlink(s.tier("a").backend.object_path(key_of(3)))  # tier a loses one object behind the store's back
        outs = [empty_like(data[0]) for _ in keys]
        got = s.get_many(keys, out=outs)
        for i, r, o in zip((0, 1, 2, 3, 4, 5, 2), got, outs, strict=True):
            assert r is not None
            assert_same(o, data[i])
        final = s.stats()["tiers"]
        assert final["a"]["hits"] - after["a"]["hits"] == 6 and final["b"]["hits"] - after["b"]["hits"] == 1
        assert final["a"]["misses"] - after["a"]["misses"] == 1
        assert s.where(key_of(3)) == "b"  # (transient: nothing promoted back)
        assert pins(s) == {"a": 0, "b": 0}
