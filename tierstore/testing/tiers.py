"""``TierTests``: the conformance suite every tier passes (zarr's ``StoreTests`` is the model).

Subclass it in a test module and implement :meth:`make_tier` (and, for tiers that persist or keep
checksummed objects, :meth:`reopen` and :meth:`damage`)::

    class TestHostTier(TierTests):
        def make_tier(self, capacity):
            return HostTier(capacity=capacity)
"""

from __future__ import annotations

import threading

import pytest
import torch

from ..errors import ClosedError, InvalidInputError, InvalidTypeError, TierstoreError
from ..keys import ChunkKey
from ..tensors import DTYPES
from ..tiers.base import Tier
from .data import assert_same, chunk, key_of, reencode, run_threads, sample_tensor, unsupported_object

MiB = 1 << 20

__all__ = ["MiB", "TierTests", "assert_same", "chunk", "key_of", "reencode", "run_threads", "sample_tensor",
           "unsupported_object"]


class TierTests:
    """Behaviour every tier shares. Subclasses set the class attributes and implement the hooks."""

    #: objects survive close() and reopen()
    persistent: bool = False
    #: stored objects carry checksums that :meth:`damage` can break
    checksummed: bool = False
    #: rounds per thread in the race test (slow remote backends may lower it)
    race_iterations: int = 200
    #: the tier takes a capacity and evicts (shared remote tiers do not: their capacity tests are skipped)
    bounded: bool = True

    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path):
        self.tmp_path = tmp_path
        self._open: list[Tier] = []
        yield
        for t in self._open:
            t.close()

    # hooks -----------------------------------------------------------------
    def make_tier(self, capacity: int | None) -> Tier:
        raise NotImplementedError

    def reopen(self, tier: Tier) -> Tier:
        """Close ``tier`` and open the same storage again."""
        raise NotImplementedError

    def damage(self, tier: Tier, key: ChunkKey, how: str) -> None:
        """Corrupt the stored object: ``how`` is ``"flip"`` (one payload bit) or ``"truncate"``."""
        raise NotImplementedError

    def overwrite(self, tier: Tier, key: ChunkKey, data: bytes) -> None:
        """Replace the stored object's bytes with ``data``, behind the tier's back (checksummed tiers)."""
        raise NotImplementedError

    def tier(self, capacity: int | None = 64 * MiB) -> Tier:
        t = self.make_tier(capacity if self.bounded else None)
        self._open.append(t)
        return t

    def bounded_tier(self, capacity: int) -> Tier:
        """A tier of ``capacity`` bytes for a test of eviction; skips the test for unbounded tiers."""
        if not self.bounded:
            pytest.skip("tier has no capacity")
        return self.tier(capacity)

    @staticmethod
    def fits(t: Tier) -> bool:
        return t.capacity is None or t.used_bytes <= t.capacity

    # round trips -----------------------------------------------------------
    @pytest.mark.parametrize("dtype", sorted(DTYPES.values(), key=str), ids=str)
    def test_roundtrip_every_dtype(self, dtype):
        t = self.tier()
        value = {"x": sample_tensor(dtype, (4, 7)), "scalar": sample_tensor(dtype, ()),
                 "empty": sample_tensor(dtype, (0, 3))}
        key = key_of(1)
        assert t.put(key, value)
        assert_same(t.get(key), value)

    def test_non_contiguous_and_odd_shapes(self):
        t = self.tier()
        base = torch.arange(6 * 5 * 4, dtype=torch.float32).reshape(6, 5, 4)
        value = {"transposed": base.transpose(0, 2), "strided": base[::2, 1:, ::3],
                 "odd": torch.arange(13, dtype=torch.int16)}
        t.put(key_of(2), value)
        got = t.get(key_of(2))
        assert got is not None
        for name in value:
            assert torch.equal(got[name], value[name])
            assert got[name].is_contiguous()

    def test_get_returns_caller_owned_copies(self):
        t = self.tier()
        value = chunk(3)
        original = {k: v.clone() for k, v in value.items()}
        t.put(key_of(3), value)
        value["k"].zero_()  # mutate after put
        got = t.get(key_of(3))
        assert_same(got, original)
        assert got is not None
        got["v"].zero_()  # mutate a result
        assert_same(t.get(key_of(3)), original)

    def test_get_into_out(self):
        t = self.tier()
        value = chunk(4)
        t.put(key_of(4), value)
        out = {k: torch.empty_like(v) for k, v in value.items()}
        result = t.get(key_of(4), out=out)
        assert result is not None
        assert result["k"].data_ptr() == out["k"].data_ptr()
        assert_same(out, value)
        with pytest.raises(InvalidInputError):
            t.get(key_of(4), out={"k": torch.empty(3)})

    def test_miss_is_none(self):
        t = self.tier()
        assert t.get(key_of(99)) is None
        assert not t.contains(key_of(99))
        assert t.stats()["misses"] == 1

    def test_batched_calls(self):
        t = self.tier()
        items = [(key_of(i), chunk(i)) for i in range(5)]
        assert t.put_many(items) == [True] * 5
        assert t.contains_many([key_of(0), key_of(7), key_of(4)]) == [True, False, True]
        got = t.get_many([key_of(1), key_of(8), key_of(3)])
        assert_same(got[0], items[1][1])
        assert got[1] is None
        assert_same(got[2], items[3][1])
        assert t.delete_many([key_of(0), key_of(9)]) == 1
        assert not t.contains(key_of(0))

    # overwrite, delete, accounting ------------------------------------------
    def test_overwrite(self):
        t = self.tier()
        t.put(key_of(5), chunk(1, 4096))
        t.put(key_of(5), chunk(2, 8192))
        expected = chunk(2, 8192) if t.overwrites else chunk(1, 4096)
        assert_same(t.get(key_of(5)), expected)
        assert len(t) == 1
        assert t.used_bytes == t.stats()["used_bytes"] > 0

    def test_overwrite_in_a_full_tier(self):
        """Replacing the only chunk of a full tier works: the old value's bytes count as freed."""
        t = self.bounded_tier(12000)  # one 8000-byte chunk (plus any object header) fits, two do not
        assert t.put(key_of(5), chunk(1, 8000))
        assert t.put(key_of(5), chunk(2, 8000))
        assert_same(t.get(key_of(5)), chunk(2, 8000) if t.overwrites else chunk(1, 8000))
        assert len(t) == 1 and self.fits(t)
        assert t.stats()["reserved_bytes"] == 0 and t.stats()["skipped"] == 0

    def test_duplicate_keys_in_batched_calls(self):
        """A key repeated in one batched call is fine everywhere, and leaks no pin (review C3)."""
        t = self.tier(capacity=12000)  # one chunk fits
        assert t.put(key_of(0), chunk(0, 8000))
        assert t.contains_many([key_of(0), key_of(1), key_of(0)]) == [True, False, True]
        got = t.get_many([key_of(0), key_of(1), key_of(0), key_of(0)])
        assert got[1] is None
        for value in (got[0], got[2], got[3]):
            assert_same(value, chunk(0, 8000))
        assert got[0] is not None
        got[0]["k"].zero_()  # each slot owns its tensors
        assert_same(got[2], chunk(0, 8000))
        assert t.stats()["pinned"] == 0
        t.pin_wait = 0.3
        assert t.put(key_of(1), chunk(1, 8000))  # in a bounded tier, key 0 is evictable: no pin was left behind
        assert t.contains(key_of(0)) is not self.bounded
        assert t.put_many([(key_of(2), chunk(2, 8000)), (key_of(2), chunk(2, 8000))]) == [True, True]
        assert_same(t.get(key_of(2)), chunk(2, 8000))
        used = t.used_bytes
        assert t.delete_many([key_of(2), key_of(2)]) == 1
        assert not t.contains(key_of(2)) and t.used_bytes < used

    def test_delete_and_byte_accounting(self):
        t = self.tier()
        sizes = []
        for i in range(4):
            t.put(key_of(i), chunk(i, 4096 * (i + 1)))
            sizes.append(t.used_bytes)
        assert sizes == sorted(sizes) and len(set(sizes)) == 4
        assert t.delete(key_of(3))
        assert t.used_bytes == sizes[2]
        assert not t.delete(key_of(3))
        for i in range(3):
            t.delete(key_of(i))
        assert t.used_bytes == 0 and len(t) == 0

    def test_capacity_never_exceeded_and_lru_order(self):
        t = self.bounded_tier(5 * 8192 + 4096)
        for i in range(5):
            assert t.put(key_of(i), chunk(i, 8000))
        assert t.get(key_of(0)) is not None  # LRU order now 1, 2, 3, 4, 0
        for i in (5, 6):
            assert t.put(key_of(i), chunk(i, 8000))
            assert t.capacity is not None and t.used_bytes <= t.capacity
        assert [i for i in range(7) if t.contains(key_of(i))] == [0, 3, 4, 5, 6]
        assert t.stats()["evictions"] == 2

    def test_oversize_is_skipped_not_stored(self):
        t = self.bounded_tier(4096)
        t.put(key_of(0), chunk(0, 1024))
        assert not t.put(key_of(1), chunk(1, 1 << 16))
        assert not t.contains(key_of(1))
        assert t.contains(key_of(0))  # nothing was evicted for a value that can never fit
        assert t.stats()["skipped"] == 1

    def test_pinned_keys_are_not_evicted(self):
        t = self.bounded_tier(3 * 8192)
        t.put(key_of(0), chunk(0, 8000))
        t.pin([key_of(0)])
        for i in range(1, 6):
            t.put(key_of(i), chunk(i, 8000))
        assert t.contains(key_of(0))
        t.unpin([key_of(0)])
        for i in range(6, 9):
            t.put(key_of(i), chunk(i, 8000))
        assert not t.contains(key_of(0))

    def test_put_waits_briefly_for_pins_then_skips(self):
        t = self.bounded_tier(12000)  # one 8000-byte chunk (plus any object header) fits, two do not
        t.pin_wait = 0.3
        t.put(key_of(0), chunk(0, 8000))
        t.pin([key_of(0)])
        assert not t.put(key_of(1), chunk(1, 8000))  # the only victim stays pinned: skipped, not stuck
        assert t.contains(key_of(0))
        t.pin_wait = 10.0  # generous: a loaded CI machine may run the timer late
        threading.Timer(0.1, t.unpin, args=([key_of(0)],)).start()
        assert t.put(key_of(1), chunk(1, 8000))  # released while the put waited: it evicts and lands
        assert not t.contains(key_of(0)) and t.contains(key_of(1))

    def test_internal_reads_leave_lru_order_alone(self):
        t = self.bounded_tier(3 * 8192 + 4096)
        for i in range(3):
            t.put(key_of(i), chunk(i, 8000))
        with t.borrowed(key_of(0)) as value:  # write-back / eviction copies are not "use"
            assert_same(value, chunk(0, 8000))
        t.put(key_of(3), chunk(3, 8000))
        assert not t.contains(key_of(0)) and t.contains(key_of(1))

    def test_before_evict_sees_the_victim(self):
        t = self.bounded_tier(2 * 8192)
        seen = []

        def hook(tier, key):
            with tier.borrowed(key) as value:
                seen.append((key, value is not None))

        t.before_evict = hook
        for i in range(4):
            t.put(key_of(i), chunk(i, 8000))
        assert seen and all(ok for _, ok in seen)
        assert seen[0][0] == key_of(0)

    # integrity --------------------------------------------------------------
    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_corrupt_object_is_a_counted_miss(self, how):
        if not self.checksummed:
            pytest.skip("tier keeps no checksummed objects")
        t = self.tier()
        t.put(key_of(0), chunk(0))
        t.put(key_of(1), chunk(1))
        self.damage(t, key_of(0), how)
        assert t.get(key_of(0)) is None
        assert t.stats()["corrupt"] == 1
        assert_same(t.get(key_of(1)), chunk(1))
        if t.shared:  # a reader never deletes from shared storage; an explicit repair does
            assert t.contains(key_of(0))
            assert t.verify_many([key_of(0), key_of(1)], repair=True) == ["corrupt", "ok"]
        assert not t.contains(key_of(0))
        assert t.put(key_of(0), chunk(0))  # a fresh put heals it
        assert_same(t.get(key_of(0)), chunk(0))

    @pytest.mark.parametrize("what", ["version", "dtype"])
    def test_unsupported_object_is_a_miss_and_never_removed(self, what):
        if not self.checksummed:
            pytest.skip("tier keeps no checksummed objects")
        t = self.tier()
        t.put(key_of(0), chunk(0))
        self.overwrite(t, key_of(0), unsupported_object(key_of(0), what))
        assert t.get(key_of(0)) is None
        assert t.get(key_of(0), out={"x": torch.empty(16, dtype=torch.int32)}) is None
        stats = t.stats()
        assert stats["unsupported"] == 2 and stats["corrupt"] == 0
        assert t.verify_many([key_of(0)], repair=True) == ["unsupported"]
        assert t.contains(key_of(0))  # still stored, for the readers that can read it

    # persistence ------------------------------------------------------------
    def test_persistence_across_reopen(self):
        if not self.persistent:
            pytest.skip("tier is not persistent")
        t = self.tier()
        for i in range(3):
            t.put(key_of(i), chunk(i, 4096 * (i + 1)))
        t.delete(key_of(1))
        used = t.used_bytes
        t2 = self.reopen(t)
        self._open.append(t2)
        assert sorted(k.hex() for k in t2.keys()) == sorted(key_of(i).hex() for i in (0, 2))
        assert t2.used_bytes == used
        assert_same(t2.get(key_of(2)), chunk(2, 4096 * 3))
        assert t2.put(key_of(3), chunk(3))
        assert t2.used_bytes > used

    # concurrency ------------------------------------------------------------
    def test_many_threads(self):
        t = self.tier(capacity=40 * 8192)

        hits = [0] * 6

        def worker(w):
            for i in range(30):
                k = key_of(w * 1000 + i % 12)
                value = chunk(w * 1000 + i % 12, 8000)
                t.put(k, value)
                got = t.get(k)
                if got is not None:  # another thread may have evicted it in between
                    assert_same(got, value)
                    hits[w] += 1
                assert self.fits(t)

        run_threads(worker, 6)
        assert self.fits(t)
        assert t.stats()["reserved_bytes"] == 0 and t.stats()["pinned"] == 0
        assert sum(hits) > 0, "every read right after its put missed"
        held = t.keys()
        assert held, "the tier kept nothing"
        for k in held:  # what survived the storm is exactly what was put under that key
            n = next(n for w in range(6) for n in range(w * 1000, w * 1000 + 12) if key_of(n) == k)
            assert_same(t.get(k), chunk(n, 8000))

    def test_close_racing_operations(self):
        """close() while other threads put, get and delete: they finish or raise ClosedError, nothing hangs,
        and a second close() is a no-op."""
        t = self.tier(capacity=8 * 8192)
        started = threading.Barrier(5)

        def worker(w):
            started.wait()
            try:
                for i in range(200):
                    k = key_of(w * 1000 + i % 10)
                    t.put(k, chunk(i % 10, 8000))
                    got = t.get(k)
                    if got is not None:
                        assert_same(got, chunk(i % 10, 8000))
                    if i % 7 == 0:
                        t.delete(k)
            except ClosedError:
                pass

        failures: list[BaseException] = []

        def workers():
            try:
                run_threads(worker, 4)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                failures.append(exc)

        storm = threading.Thread(target=workers)
        storm.start()
        started.wait()
        t.close()
        storm.join(30)
        assert not storm.is_alive() and not failures, failures
        t.close()

    def test_racing_overwrites_deletes_and_reads(self):
        """Each key has one writer cycling through versions while other threads read and delete it:
        every read is a miss or exactly one version of that key (never another key's bytes)."""
        t = self.tier(capacity=24 * 8192)
        versions, nworkers = 3, 6

        def value(n, v):
            return chunk(n * versions + v, 8000)

        def check(got, n, exact=None):
            if got is None:
                return
            if exact is not None and t.overwrites:
                assert_same(got, exact)
            elif not any(torch.equal(got["k"], value(n, v)["k"]) and torch.equal(got["v"], value(n, v)["v"])
                         for v in range(versions)):
                raise AssertionError(f"key {n}: bytes of no version of this key")

        def worker(w):
            for i in range(self.race_iterations):
                n, other = w * 100 + i % 8, (w + 1) % nworkers * 100 + i % 8
                mine = value(n, i // 8 % versions)
                t.put(key_of(n), mine)
                check(t.get(key_of(n)), n, exact=mine)
                check(t.get(key_of(other)), other)
                if i % 5 == 0:
                    t.delete(key_of(other))

        run_threads(worker, nworkers)
        stats = t.stats()
        assert stats["reserved_bytes"] == 0 and stats["pinned"] == 0
        assert self.fits(t)
        for k in t.keys():  # the index and storage agree after the storm
            assert t.get(k) is not None

    # bad input --------------------------------------------------------------
    def test_bad_input(self):
        t = self.tier()
        with pytest.raises(InvalidTypeError):
            t.put("not-a-key", chunk(0))  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError):
            t.put(key_of(0), {"x": [1, 2, 3]})  # type: ignore[dict-item]
        with pytest.raises(InvalidTypeError):
            t.put(key_of(0), torch.zeros(3))  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            t.put(key_of(0), {})
        with pytest.raises(InvalidTypeError):
            t.get(b"raw bytes")  # type: ignore[arg-type]
        with pytest.raises(TierstoreError):
            t.put(key_of(0), {"x": torch.zeros(3).to_sparse()})
        with pytest.raises(InvalidInputError):  # a dtype with no stable storage name
            t.put(key_of(0), {"x": torch.zeros(3, dtype=torch.complex32)})
        assert len(t) == 0  # nothing stored by a failed call

    def test_negative_capacity_rejected(self):
        with pytest.raises(ValueError):  # an unbounded tier refuses any capacity
            self.make_tier(-1)
