import errno

import pytest
import torch

import tierstore
from tierstore.backends.memory import DeviceBackend, HostBackend
from tierstore.testing.backends import BackendTests
from tierstore.testing.data import chunk, key_of


class TestHostBackend(BackendTests):
    def make_backend(self, capacity):
        return HostBackend(capacity=capacity, pinned=False, pool=False)


class TestHostPoolBackend(BackendTests):
    """The slot pool that pinned host memory uses under CUDA, exercised with plain memory."""

    def make_backend(self, capacity):
        return HostBackend(capacity=capacity, pool=True, slot_size=8192)


class TestDeviceBackend(BackendTests):
    def make_backend(self, capacity):
        return DeviceBackend(device="cpu")


def _host_store(capacity, **pool):
    return tierstore.open({"tiers": [{"kind": "host", "capacity": capacity, "pinned": False, **pool}]})


def test_pool_evicts_for_fragmentation():
    with _host_store(4 * 8192, pool=True, slot_size=8192) as s:
        pool = s.tier("host").backend.pool
        for i in range(4):
            assert s.put(key_of(i), chunk(i, 8000))
        s.delete([key_of(0), key_of(2)])  # two free slots, not adjacent
        assert pool.free_slots() == 2 and pool.largest_free() == 8192
        assert s.put(key_of(9), chunk(9, 16000))  # needs a run of two: evicts the LRU neighbour
        assert s.contains(key_of(9))
        st = s.stats()["tiers"]["host"]
        assert st["used_bytes"] <= st["capacity_bytes"]
        assert torch.equal(s.get(key_of(9))["k"], chunk(9, 16000)["k"])


def test_pool_memory_is_fixed():
    """Every chunk a pooled host tier holds lives inside its one preallocated buffer."""
    with _host_store(4 * 8192, pool=True, slot_size=8192) as s:
        backend = s.tier("host").backend
        lo = backend.pool.buffer.data_ptr()
        hi = lo + backend.pool.buffer.numel()
        for i in range(50):
            s.put(key_of(i), chunk(i, 8000 * (1 + i % 2)))
            held = s.residency.keys(0)
            assert held
            for k in held:
                with backend.borrow(k) as stored:
                    assert stored is not None
                    for v in stored.values():
                        assert lo <= v.data_ptr() and v.data_ptr() + v.numel() * v.element_size() <= hi


def test_a_pool_run_being_read_is_not_reused_until_the_reader_is_done():
    """A chunk replaced or deleted while a borrower still reads it keeps its bytes until the borrow ends."""
    backend = HostBackend(capacity=2 * 8192, pinned=False, pool=True, slot_size=8192)
    backend.write(key_of(0), chunk(0, 8000))
    with backend.borrow(key_of(0)) as lent:
        backend.delete(key_of(0))
        backend.write(key_of(1), chunk(1, 8000))
        with pytest.raises(OSError) as err:  # the only other run is the one being read
            backend.write(key_of(2), chunk(2, 8000))
        assert err.value.errno == errno.ENOMEM
        assert torch.equal(lent["k"], chunk(0, 8000)["k"])
    assert backend.pool.free_slots() == 1  # freed by the last reader
    backend.write(key_of(2), chunk(2, 8000))
    backend.close()


def test_cuda_device_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from tierstore.errors import ConfigError
    with pytest.raises(ConfigError):
        DeviceBackend(device="cuda:0")
