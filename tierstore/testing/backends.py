"""``BackendTests``: the conformance suite every backend passes (zarr's ``StoreTests`` is the model).

It checks the :class:`~tierstore.backends.Backend` contract itself (writes, reads into fresh tensors or
caller-owned ones, objects, deletes, lookups, listings, damage, concurrency), then the backend as one tier of a
store (capacity, LRU order, pins, eviction, what a damaged object does), so a third-party backend that passes
it can be registered and named in a config. Subclass it in a test module and implement :meth:`make_backend`
(and, for backends that persist or keep checksummed objects, :meth:`reopen` and :meth:`damage`)::

    class TestHostBackend(BackendTests):
        def make_backend(self, capacity):
            return HostBackend(capacity=capacity)
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ..backends import Backend, Hit
from ..errors import ClosedError, CorruptObjectError, InvalidInputError, InvalidTypeError, UnsupportedObjectError
from ..keys import ChunkKey
from ..store import TieredStore
from ..tensors import DTYPES
from .data import assert_same, chunk, key_of, reencode, run_threads, sample_tensor, unsupported_object

MiB = 1 << 20

__all__ = ["BackendTests", "MiB", "assert_same", "chunk", "key_of", "reencode", "run_threads", "sample_tensor",
           "unsupported_object"]


def _value(got: Any) -> Any:
    """A read result's chunk (``None`` for a miss); an exception result is raised."""
    if isinstance(got, BaseException):
        raise got
    return None if got is None else got.value


class BackendTests:
    """Behaviour every backend shares. Subclasses set the class attributes and implement the hooks."""

    #: what is stored survives close() and reopen()
    persistent: bool = False
    #: stored objects carry checksums that :meth:`damage` can break
    checksummed: bool = False
    #: rounds per thread in the race tests (slow remote backends may lower it)
    race_iterations: int = 200
    #: the backend may sit in a tier with a capacity (shared remote prefixes may not)
    bounded: bool = True

    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path):
        self.tmp_path = tmp_path
        self._open: list[Any] = []
        yield
        for b in self._open:
            b.close()

    # hooks -----------------------------------------------------------------
    def make_backend(self, capacity: int | None) -> Backend:
        """A fresh backend; ``capacity`` is the budget of the tier it will be (``None``: unbounded), for
        backends that size themselves by it (a memory pool); others may ignore it."""
        raise NotImplementedError

    def reopen(self, backend: Backend) -> Backend:
        """Close ``backend`` and open the same storage again."""
        raise NotImplementedError

    def damage(self, backend: Backend, key: ChunkKey, how: str) -> None:
        """Corrupt the stored object: ``how`` is ``"flip"`` (one payload bit) or ``"truncate"``."""
        raise NotImplementedError

    def overwrite(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        """Replace the stored object's bytes with ``data``, behind the backend's back (checksummed ones)."""
        raise NotImplementedError

    def backend(self) -> Backend:
        b = self.make_backend(64 * MiB if self.bounded else None)
        self._open.append(b)
        return b

    def store(self, capacity: int | None = 64 * MiB, **options: Any) -> TieredStore:
        """The backend as the one tier of a store of ``capacity`` bytes (none for unbounded backends)."""
        if capacity is not None and not self.bounded:
            capacity = None
        s = TieredStore.from_backends([(self.make_backend(capacity), capacity)], **options)
        self._open.append(s)
        return s

    def bounded_store(self, capacity: int, **options: Any) -> TieredStore:
        """A one-tier store of ``capacity`` bytes for a test of eviction; skips the test for unbounded backends."""
        if not self.bounded:
            pytest.skip("backend has no capacity")
        return self.store(capacity, **options)

    @staticmethod
    def tier_stats(s: TieredStore) -> dict[str, Any]:
        (stats,) = s.stats()["tiers"].values()
        return stats

    def fits(self, s: TieredStore) -> bool:
        st = self.tier_stats(s)
        return st["capacity_bytes"] is None or st["used_bytes"] <= st["capacity_bytes"]

    # the backend contract ----------------------------------------------------
    @pytest.mark.parametrize("dtype", sorted(DTYPES.values(), key=str), ids=str)
    def test_roundtrip_every_dtype(self, dtype):
        b = self.backend()
        value = {"x": sample_tensor(dtype, (4, 7)), "scalar": sample_tensor(dtype, ()),
                 "empty": sample_tensor(dtype, (0, 3))}
        b.write(key_of(1), value)
        assert_same(b.read(key_of(1)), value)

    def test_non_contiguous_and_odd_shapes(self):
        b = self.backend()
        base = torch.arange(6 * 5 * 4, dtype=torch.float32).reshape(6, 5, 4)
        value = {"transposed": base.transpose(0, 2), "strided": base[::2, 1:, ::3],
                 "odd": torch.arange(13, dtype=torch.int16)}
        b.write(key_of(2), value)
        got = b.read(key_of(2))
        assert got is not None
        for name in value:
            assert torch.equal(got[name], value[name])
            assert got[name].is_contiguous()

    def test_reads_are_caller_owned_copies(self):
        b = self.backend()
        value = chunk(3)
        original = {k: v.clone() for k, v in value.items()}
        b.write(key_of(3), value)
        value["k"].zero_()  # mutate after the write
        got = b.read(key_of(3))
        assert_same(got, original)
        assert got is not None
        got["v"].zero_()  # mutate a result
        assert_same(b.read(key_of(3)), original)

    def test_read_into_fills_caller_buffers(self):
        b = self.backend()
        value = chunk(4)
        b.write(key_of(4), value)
        out = {k: torch.empty_like(v) for k, v in value.items()}
        (got,) = b.read_into_many([key_of(4)], [out])
        assert isinstance(got, Hit) and got.size > 0
        assert got.value["k"].data_ptr() == out["k"].data_ptr()
        assert_same(out, value)
        (bad,) = b.read_into_many([key_of(4)], [{"k": torch.empty(3)}])
        assert isinstance(bad, InvalidInputError)

    def test_a_miss_is_none_everywhere(self):
        b = self.backend()
        assert b.read(key_of(99)) is None
        assert b.read_many([key_of(99)]) == [None]
        assert b.read_into_many([key_of(99)], [chunk(0)]) == [None]
        assert b.stat_many([key_of(99)]) == [None]
        if b.capabilities.objects:
            assert b.read_objects([key_of(99)]) == [None]
        assert b.delete_many([key_of(99)]) == [None]

    def test_batches_with_repeated_keys(self):
        b = self.backend()
        items = [(key_of(i), b.prepare(key_of(i), chunk(i))) for i in range(5)]
        assert b.write_many([*items, items[2]]) == [None] * 6
        got = b.read_many([key_of(1), key_of(8), key_of(1), key_of(3)])
        assert got[1] is None
        assert_same(_value(got[0]), chunk(1))
        assert_same(_value(got[2]), chunk(1))
        _value(got[0])["k"].zero_()  # each slot owns its tensors
        assert_same(_value(got[2]), chunk(1))
        sizes = b.stat_many([key_of(0), key_of(9), key_of(4)])
        assert sizes[1] is None and sizes[0] and sizes[2]
        assert b.delete_many([key_of(0), key_of(0), key_of(9)]) == [None] * 3
        assert b.read(key_of(0)) is None and b.read(key_of(1)) is not None

    def test_a_write_replaces_the_value(self):
        b = self.backend()
        b.write(key_of(5), chunk(1, 4096))
        b.write(key_of(5), chunk(2, 8192))
        assert_same(b.read(key_of(5)), chunk(2, 8192))

    def test_prepared_size_is_what_a_read_reports(self):
        b = self.backend()
        prepared = b.prepare(key_of(6), chunk(6, 8000))
        assert b.write_many([(key_of(6), prepared)]) == [None]
        (got,) = b.read_many([key_of(6)])
        assert isinstance(got, Hit) and got.size == prepared.size
        assert b.stat_many([key_of(6)]) == [prepared.size]

    def test_objects_move_between_backends_as_they_are(self):
        b = self.backend()
        if not b.capabilities.objects:
            pytest.skip("backend holds tensors, not objects")
        b.write(key_of(7), chunk(7))
        (got,) = b.read_objects([key_of(7)])
        assert isinstance(got, Hit)
        other = self.backend()
        other.write(key_of(7), got.value)  # an object another backend read: written as it is
        assert_same(other.read(key_of(7)), chunk(7))

    def test_borrow_lends_a_readable_chunk(self):
        b = self.backend()
        b.write(key_of(8), chunk(8))
        with b.borrow(key_of(8)) as lent:
            assert_same(lent, chunk(8))
        with b.borrow(key_of(9)) as missing:
            assert missing is None

    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_a_damaged_object_reads_as_corrupt(self, how):
        if not self.checksummed:
            pytest.skip("backend keeps no checksummed objects")
        b = self.backend()
        b.write(key_of(0), chunk(0))
        b.write(key_of(1), chunk(1))
        self.damage(b, key_of(0), how)
        got = b.read_many([key_of(0), key_of(1)])
        assert isinstance(got[0], CorruptObjectError)
        assert_same(_value(got[1]), chunk(1))
        (into,) = b.read_into_many([key_of(0)], [{k: torch.empty_like(v) for k, v in chunk(0).items()}])
        assert isinstance(into, CorruptObjectError)

    @pytest.mark.parametrize("what", ["version", "dtype"])
    def test_an_unsupported_object_reads_as_unsupported(self, what):
        if not self.checksummed:
            pytest.skip("backend keeps no checksummed objects")
        b = self.backend()
        b.write(key_of(0), chunk(0))
        self.overwrite(b, key_of(0), unsupported_object(key_of(0), what))
        (got,) = b.read_many([key_of(0)])
        assert isinstance(got, UnsupportedObjectError)

    def test_persistence_across_reopen(self):
        if not self.persistent:
            pytest.skip("backend is not persistent")
        b = self.backend()
        for i in range(3):
            b.write(key_of(i), chunk(i, 4096 * (i + 1)))
        b.delete(key_of(1))
        sizes = dict(zip((key_of(i) for i in range(3)), b.stat_many([key_of(i) for i in range(3)]), strict=True))
        b2 = self.reopen(b)
        self._open.append(b2)
        listed = {f.key: f.size for f in b2.list()}
        assert listed == {key_of(0): sizes[key_of(0)], key_of(2): sizes[key_of(2)]}
        assert_same(b2.read(key_of(2)), chunk(2, 4096 * 3))

    def test_many_threads_each_see_their_own_values(self):
        b = self.backend()

        def worker(w):
            for i in range(self.race_iterations // 4):
                k, value = key_of(w * 1000 + i % 6), chunk(w * 1000 + i, 8000)
                b.write(k, value)
                assert_same(b.read(k), value)

        run_threads(worker, 6)

    def test_close_is_idempotent_and_refuses_later_calls(self):
        b = self.make_backend(64 * MiB if self.bounded else None)
        b.write(key_of(0), chunk(0))
        b.close()
        b.close()
        try:
            got = b.read_many([key_of(0)])
        except ClosedError:
            return
        assert got in ([None], ) or isinstance(got[0], (ClosedError, OSError)) or got[0] is not None

    def test_bad_input_raises_before_anything_is_written(self):
        b = self.backend()
        with pytest.raises(InvalidTypeError):
            b.prepare(key_of(0), {"x": [1, 2, 3]})  # type: ignore[dict-item]
        with pytest.raises(InvalidInputError):
            b.prepare(key_of(0), {})
        with pytest.raises(InvalidInputError):  # a dtype with no stable storage name
            b.prepare(key_of(0), {"x": torch.zeros(3, dtype=torch.complex32)})
        assert b.read(key_of(0)) is None

    # as one tier of a store ------------------------------------------------
    def test_capacity_is_never_exceeded_and_lru_order_kept(self):
        s = self.bounded_store(5 * 8192 + 4096)
        for i in range(5):
            assert s.put(key_of(i), chunk(i, 8000))
        assert s.get(key_of(0)) is not None  # LRU order now 1, 2, 3, 4, 0
        for i in (5, 6):
            assert s.put(key_of(i), chunk(i, 8000))
            assert self.fits(s)
        assert [i for i in range(7) if s.contains(key_of(i))] == [0, 3, 4, 5, 6]
        assert self.tier_stats(s)["evictions"] == 2

    def test_an_overwrite_in_a_full_tier_replaces_in_place(self):
        s = self.bounded_store(12000)  # one 8000-byte chunk (plus any object header) fits, two do not
        assert s.put(key_of(5), chunk(1, 8000))
        assert s.put(key_of(5), chunk(2, 8000))
        assert_same(s.get(key_of(5)), chunk(2, 8000))
        st = self.tier_stats(s)
        assert st["objects"] == 1 and self.fits(s)
        assert st["reserved_bytes"] == 0 and st["skipped"] == 0

    def test_an_oversize_chunk_is_skipped_not_stored(self):
        s = self.bounded_store(4096)
        assert s.put(key_of(0), chunk(0, 1024))
        assert not s.put(key_of(1), chunk(1, 1 << 16))
        assert not s.contains(key_of(1))
        assert s.contains(key_of(0))  # nothing was evicted for a value that can never fit
        assert self.tier_stats(s)["skipped"] == 1

    def test_pinned_keys_are_not_evicted(self):
        s = self.bounded_store(3 * 8192)
        s.put(key_of(0), chunk(0, 8000))
        pin = s.pin([key_of(0)])
        assert pin.ready == 1
        s._transfers.pin_wait = 0.2
        for i in range(1, 6):
            s.put(key_of(i), chunk(i, 8000))
        assert s.contains(key_of(0))
        s.release(pin)
        for i in range(6, 9):
            s.put(key_of(i), chunk(i, 8000))
        assert not s.contains(key_of(0))

    def test_a_put_waits_briefly_for_pins_then_skips(self):
        s = self.bounded_store(12000)
        s._transfers.pin_wait = 0.3
        s.put(key_of(0), chunk(0, 8000))
        pin = s.pin([key_of(0)])
        assert not s.put(key_of(1), chunk(1, 8000))  # the only victim stays pinned: skipped, not stuck
        assert s.contains(key_of(0))
        s._transfers.pin_wait = 10.0  # generous: a loaded CI machine may run the timer late
        threading.Timer(0.1, s.release, args=(pin,)).start()
        assert s.put(key_of(1), chunk(1, 8000))  # released while the put waited: it evicts and lands
        assert not s.contains(key_of(0)) and s.contains(key_of(1))

    def test_deletes_and_byte_accounting(self):
        s = self.store()
        used = []
        for i in range(4):
            s.put(key_of(i), chunk(i, 4096 * (i + 1)))
            used.append(self.tier_stats(s)["used_bytes"])
        assert used == sorted(used) and len(set(used)) == 4
        assert s.delete(key_of(3)) == 1
        assert self.tier_stats(s)["used_bytes"] == used[2]
        assert s.delete(key_of(3)) == 0
        s.delete([key_of(i) for i in range(3)])
        st = self.tier_stats(s)
        assert st["used_bytes"] == 0 and st["objects"] == 0

    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_a_damaged_object_is_a_counted_miss(self, how):
        if not self.checksummed:
            pytest.skip("backend keeps no checksummed objects")
        s = self.store()
        s.put(key_of(0), chunk(0))
        s.put(key_of(1), chunk(1))
        self.damage(s.tiers[0].backend, key_of(0), how)
        assert s.get(key_of(0)) is None
        assert self.tier_stats(s)["corrupt"] == 1
        assert_same(s.get(key_of(1)), chunk(1))
        shared = s.tiers[0].shared  # a reader never deletes from shared storage; an explicit repair does
        assert (s.tiers[0].backend.stat_many([key_of(0)])[0] is not None) is shared
        assert s.put(key_of(0), chunk(0))  # a fresh put heals it
        assert_same(s.get(key_of(0)), chunk(0))

    @pytest.mark.parametrize("what", ["version", "dtype"])
    def test_an_unsupported_object_is_a_miss_and_never_removed(self, what):
        if not self.checksummed:
            pytest.skip("backend keeps no checksummed objects")
        s = self.store()
        s.put(key_of(0), chunk(0))
        self.overwrite(s.tiers[0].backend, key_of(0), unsupported_object(key_of(0), what))
        assert s.get(key_of(0)) is None
        assert s.get_many([key_of(0)], out=[{"x": torch.empty(16, dtype=torch.int32)}]) == [None]
        st = self.tier_stats(s)
        assert st["unsupported"] == 2 and st["corrupt"] == 0
        assert s.tiers[0].backend.stat_many([key_of(0)])[0] is not None  # still stored, for readers that can

    def test_a_reopened_store_finds_what_it_held(self):
        if not self.persistent:
            pytest.skip("backend is not persistent")
        s = self.store()
        for i in range(3):
            s.put(key_of(i), chunk(i, 4096 * (i + 1)))
        s.delete(key_of(1))
        used = self.tier_stats(s)["used_bytes"]
        backend = self.reopen(s.tiers[0].backend)
        s2 = TieredStore.from_backends([(backend, None)])
        self._open.append(s2)
        assert s2.contains_many([key_of(i) for i in range(3)]) == [True, False, True]
        assert self.tier_stats(s2)["used_bytes"] == used
        assert_same(s2.get(key_of(2)), chunk(2, 4096 * 3))

    def test_many_threads_in_a_bounded_tier(self):
        s = self.store(40 * 8192)
        hits = [0] * 6

        def worker(w):
            for i in range(30):
                k = key_of(w * 1000 + i % 12)
                value = chunk(w * 1000 + i % 12, 8000)
                s.put(k, value)
                got = s.get(k)
                if got is not None:  # another thread may have evicted it in between
                    assert_same(got, value)
                    hits[w] += 1
                assert self.fits(s)

        run_threads(worker, 6)
        st = self.tier_stats(s)
        assert self.fits(s) and st["reserved_bytes"] == 0 and st["pinned"] == 0
        assert sum(hits) > 0, "every read right after its put missed"
        held = s.residency.keys(0)
        assert held, "the tier kept nothing"
        for k in held:  # what survived the storm is exactly what was put under that key
            n = next(n for w in range(6) for n in range(w * 1000, w * 1000 + 12) if key_of(n) == k)
            assert_same(s.get(k), chunk(n, 8000))

    def test_close_racing_operations(self):
        """close() while other threads put, get and delete: they finish or raise ClosedError, nothing hangs,
        and a second close() is a no-op."""
        s = self.store(8 * 8192)
        started = threading.Barrier(5)

        def worker(w):
            started.wait()
            try:
                for i in range(200):
                    k = key_of(w * 1000 + i % 10)
                    s.put(k, chunk(i % 10, 8000))
                    got = s.get(k)
                    if got is not None:
                        assert_same(got, chunk(i % 10, 8000))
                    if i % 7 == 0:
                        s.delete(k)
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
        s.close()
        storm.join(30)
        assert not storm.is_alive() and not failures, failures
        s.close()

    def test_racing_overwrites_deletes_and_reads(self):
        """Each key has one writer cycling through versions while other threads read and delete it: every
        read is a miss or exactly one version of that key (never another key's bytes), a writer reads back
        its own last write, and the index and storage agree after the storm."""
        s = self.store(24 * 8192)
        versions, nworkers = 3, 6

        def value(n, v):
            return chunk(n * versions + v, 8000)

        def check(got, n, exact=None):
            if got is None:
                return
            if exact is not None:
                assert_same(got, exact)
            elif not any(torch.equal(got["k"], value(n, v)["k"]) and torch.equal(got["v"], value(n, v)["v"])
                         for v in range(versions)):
                raise AssertionError(f"key {n}: bytes of no version of this key")

        def worker(w):
            for i in range(self.race_iterations):
                n, other = w * 100 + i % 8, (w + 1) % nworkers * 100 + i % 8
                mine = value(n, i // 8 % versions)
                s.put(key_of(n), mine)
                check(s.get(key_of(n)), n, exact=mine)
                check(s.get(key_of(other)), other)
                if i % 5 == 0:
                    s.delete(key_of(other))

        run_threads(worker, nworkers)
        st = self.tier_stats(s)
        assert st["reserved_bytes"] == 0 and st["pinned"] == 0
        assert self.fits(s)
        held = s.residency.keys(0)
        assert all(r is not None for r in s.get_many(held))  # the index and storage agree after the storm
