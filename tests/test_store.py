"""TieredStore behaviour: policies, dirty eviction, promotion, prefetch, lookup, stats, threads."""

import threading
import time

import pytest
import torch

import tierstore
from tierstore.errors import ClosedError, InvalidInputError, InvalidTypeError, TierTimeoutError
from tierstore.testing.data import assert_same, chunk, key_of, run_threads

CHUNK = 8000  # bytes per test chunk


def _wait_for(condition, expected=True, timeout=10.0):
    """Wait until ``condition()`` is true (a background job's effect); with ``expected`` false, check that it
    stays false for a moment."""
    deadline = time.monotonic() + (timeout if expected else 0.3)
    while time.monotonic() < deadline:
        if condition():
            break
        time.sleep(0.01)
    assert bool(condition()) is expected


def open_store(tmp_path, host=3 * 8192, lower="device", host_options=(), **extra):
    lower_tier = ({"kind": "device", "device": "cpu", "name": "lower", "capacity": "4MiB"} if lower == "device"
                  else {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "4MiB", "name": "lower"})
    host_tier = {"kind": "host", "capacity": host, "pinned": False, **dict(host_options)}
    return tierstore.open({"tiers": [host_tier, lower_tier], **extra})


def test_put_get_roundtrip_and_miss(tmp_path):
    with open_store(tmp_path) as s:
        s.put(key_of(1), chunk(1, CHUNK))
        assert_same(s.get(key_of(1)), chunk(1, CHUNK))
        assert s.get(key_of(2)) is None
        assert s.contains(key_of(1)) and not s.contains(key_of(2))
        st = s.stats()
        assert st["hits"] == 1 and st["misses"] == 1
        assert st["tiers"]["host"]["hits"] == 1


def test_write_back_reaches_every_tier_after_flush(tmp_path):
    with open_store(tmp_path) as s:
        s.put(key_of(1), chunk(1, CHUNK))
        s.flush()
        assert "lower" in s.holders(key_of(1))
        assert s.stats()["tiers"]["lower"]["writeback_done"] == 1
        assert s.stats()["pending_writeback"] == 0


def test_write_through_returns_when_every_tier_has_it(tmp_path):
    with open_store(tmp_path, write_policy="write_through") as s:
        s.put(key_of(1), chunk(1, CHUNK))
        assert s.holders(key_of(1)) == ["host", "lower"]


def test_dirty_chunk_is_written_back_before_eviction(tmp_path):
    with open_store(tmp_path) as s:
        blocker = threading.Event()
        lower = s.tier("lower").backend
        original = lower.write_many

        def stalled_background_writes(items):  # the background writer stalls; evictions write on the put's thread
            if threading.current_thread().name.startswith("tierstore-writeback"):
                blocker.wait(10)
            return original(items)

        lower.write_many = stalled_background_writes
        s._transfers.pin_wait = 0.2  # a put whose only victims are being written waits this long, then skips
        s._writeback.pipeline = 1  # one stalled batch: the chunks put after it stay dirty and unclaimed (victims)
        for i in range(8):  # host holds 3: dirty evictions must write synchronously (or the put goes below)
            s.put(key_of(i), chunk(i, CHUNK))
        for i in range(8):
            assert s.where(key_of(i)) is not None, i
        st = s.stats()["tiers"]
        assert st["host"]["evictions"] >= 1
        assert st["lower"]["writeback_done"] >= st["host"]["evictions"]  # each written down, not by the writer
        blocker.set()
        s.flush()
        for i in range(8):
            assert_same(s.get(key_of(i)), chunk(i, CHUNK))


def test_retain_promotes_and_transient_does_not(tmp_path):
    for policy, promoted in (("retain", True), ("transient", False)):
        with open_store(tmp_path / policy, prefetch_policy=policy) as s:
            for i in range(6):
                s.put(key_of(i), chunk(i, CHUNK))
            s.flush()
            # which chunks the host gave up depends on write-back timing (a victim being written is kept)
            i = next(i for i in range(6) if s.where(key_of(i)) == "lower")
            assert_same(s.get(key_of(i)), chunk(i, CHUNK))
            _wait_for(lambda i=i: s.where(key_of(i)) == "host", promoted)  # (a promotion is a background job)
            assert (s.where(key_of(i)) == "host") is promoted
            assert "lower" in s.holders(key_of(i))  # a promoted chunk stays below too


def test_prefetch_promotes_in_background(tmp_path):
    with open_store(tmp_path, host=4 * 8192, prefetch_policy="transient") as s:
        for i in range(8):
            s.put(key_of(i), chunk(i, CHUNK))
        s.flush()
        # which chunks the host kept depends on write-back timing (a victim being written is kept): take two it lacks
        cold = [key_of(i) for i in range(8) if s.where(key_of(i)) == "lower"][:2]
        assert len(cold) == 2
        assert s.prefetch(cold).result(timeout=10) == 2
        assert all(s.where(k) == "host" for k in cold)
        assert s.prefetch([key_of(99)]).result(timeout=10) == 0
        assert s.prefetch([]).result() == 0


def test_lookup_leading_run(tmp_path):
    with open_store(tmp_path) as s:
        keys = [key_of(i) for i in range(6)]
        for k in keys[:4]:
            s.put(k, chunk(0, CHUNK))
        s.put(keys[5], chunk(0, CHUNK))
        s.flush()
        assert s.lookup(keys) == 4
        assert s.lookup(keys[4:]) == 0
        assert s.lookup([]) == 0


def test_get_into_out_buffers(tmp_path):
    with open_store(tmp_path) as s:
        value = chunk(3, CHUNK)
        for i in range(6):
            s.put(key_of(i), chunk(i, CHUNK))
        s.put(key_of(3), value)
        s.flush()
        out = {k: torch.empty_like(v) for k, v in value.items()}
        got = s.get(key_of(3), out=out)
        assert got["k"].data_ptr() == out["k"].data_ptr()
        assert_same(out, value)
        out0 = {k: torch.empty_like(v) for k, v in chunk(0, CHUNK).items()}
        assert_same(s.get(key_of(0), out=out0), chunk(0, CHUNK))  # served from the lower tier
        with pytest.raises(InvalidInputError):
            s.get(key_of(3), out={"k": torch.empty(2)})


def test_chunk_bigger_than_top_tier_skips_it(tmp_path):
    with open_store(tmp_path, host=4096) as s:
        s.put(key_of(1), chunk(1, CHUNK))
        assert s.where(key_of(1)) == "lower"
        assert_same(s.get(key_of(1)), chunk(1, CHUNK))


def test_bad_input_and_closed(tmp_path):
    s = open_store(tmp_path)
    with pytest.raises(InvalidTypeError):
        s.put("k", chunk(0))
    with pytest.raises(InvalidTypeError):
        s.put(key_of(0), {"k": "not a tensor"})
    with pytest.raises(InvalidTypeError):
        s.get(42)
    assert s.stats()["puts"] == 0
    s.close()
    s.close()  # idempotent
    with pytest.raises(ClosedError):
        s.put(key_of(0), chunk(0))


def test_flush_timeout(tmp_path):
    with open_store(tmp_path) as s:
        lower = s.tier("lower").backend
        release = threading.Event()
        original = lower.write_many
        lower.write_many = lambda items: (release.wait(10), original(items))[1]  # only the writer calls it
        s.put(key_of(1), chunk(1, CHUNK))
        with pytest.raises(TierTimeoutError):
            s.flush(timeout=0.2)
        release.set()
        s.flush(timeout=10)


@pytest.mark.parametrize("pool", [False, True], ids=["host-plain", "host-pool"])
@pytest.mark.parametrize("lower", ["device", "disk"])
def test_many_threads_put_get_prefetch(tmp_path, lower, pool):
    with open_store(tmp_path, host=6 * 8192, lower=lower, host_options={"pool": pool, "slot_size": 8192}) as s:

        def worker(w):
            for i in range(40):
                n = w * 100 + i % 15
                s.put(key_of(n), chunk(n, CHUNK))
                got = s.get(key_of(n))
                if got is not None:
                    assert_same(got, chunk(n, CHUNK))
                other = (w + 1) % 6 * 100 + i % 15  # another worker's key: exact bytes or a miss
                got = s.get(key_of(other))
                if got is not None:
                    assert_same(got, chunk(other, CHUNK))
                if i % 10 == 0:
                    s.prefetch([key_of(w * 100 + j) for j in range(5)]).result(timeout=30)
                for t in s.stats()["tiers"].values():
                    assert t["used_bytes"] <= t["capacity_bytes"]

        run_threads(worker, 6)
        s.flush()
        for w in range(6):
            for j in range(15):
                assert_same(s.get(key_of(w * 100 + j)), chunk(w * 100 + j, CHUNK))
