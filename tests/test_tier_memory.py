import pytest
import torch

from tierstore.testing.tiers import TierTests, chunk, key_of
from tierstore.tiers.device import DeviceTier
from tierstore.tiers.host import HostTier


class TestHostTier(TierTests):
    def make_tier(self, capacity):
        return HostTier(capacity=capacity, pinned=False, pool=False)


class TestHostPoolTier(TierTests):
    """The slot pool that pinned host memory uses under CUDA, exercised with plain memory."""

    def make_tier(self, capacity):
        return HostTier(capacity=capacity, pool=True, slot_size=8192)


class TestDeviceTier(TierTests):
    def make_tier(self, capacity):
        return DeviceTier(capacity=capacity, device="cpu")


def test_pool_evicts_for_fragmentation():
    t = HostTier(capacity=4 * 8192, pool=True, slot_size=8192)
    for i in range(4):
        assert t.put(key_of(i), chunk(i, 8000))
    t.delete(key_of(0))
    t.delete(key_of(2))  # two free slots, not adjacent
    assert t.pool.free_slots() == 2 and t.pool.largest_free() == 8192
    assert t.put(key_of(9), chunk(9, 16000))  # needs a run of two: evicts the LRU neighbour
    assert t.contains(key_of(9))
    assert t.used_bytes <= t.capacity
    assert torch.equal(t.get(key_of(9))["k"], chunk(9, 16000)["k"])


def test_pool_memory_is_fixed():
    """Every chunk a pooled host tier holds lives inside its one preallocated buffer."""
    t = HostTier(capacity=4 * 8192, pool=True, slot_size=8192)
    lo = t.pool.buffer.data_ptr()
    hi = lo + t.pool.buffer.numel()
    for i in range(50):
        t.put(key_of(i), chunk(i, 8000 * (1 + i % 2)))
        assert t.keys()
        for k in t.keys():
            with t.borrowed(k) as stored:
                assert stored is not None
                for v in stored.values():
                    assert lo <= v.data_ptr() and v.data_ptr() + v.numel() * v.element_size() <= hi


def test_cuda_device_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from tierstore.errors import ConfigError
    with pytest.raises(ConfigError):
        DeviceTier(device="cuda:0")
