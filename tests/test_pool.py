"""The host pool allocator: capacity means bytes a user can store, runs coalesce, nothing overlaps."""

import random
import sys
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore.backends.memory import HostBackend
from tierstore.pool import SlotPool
from tierstore.testing.backends import BackendTests
from tierstore.testing.data import key_of


class TestHostPoolSmallSlots(BackendTests):
    """The conformance suite on a pool with the default 64-byte slots."""

    def make_backend(self, capacity):
        return HostBackend(capacity=capacity, pinned=False, pool=True)


def _pooled(capacity):
    return tierstore.open({"tiers": [{"kind": "host", "capacity": capacity, "pinned": False, "pool": True}]})


def test_small_chunks_pack_densely():
    with _pooled(1 << 20) as s:
        n = (1 << 20) // 64
        assert s.put_many([(key_of(i), {"x": torch.tensor([float(i)], dtype=torch.float64)}) for i in range(n)]) \
            == [True] * n  # 8-byte chunks: one 64-byte slot each
        st = s.stats()["tiers"]["host"]
        assert st["objects"] == n and st["evictions"] == 0
        assert st["used_bytes"] == st["capacity_bytes"] == 1 << 20
        assert s.get(key_of(1234))["x"].item() == 1234.0


@pytest.mark.parametrize("nbytes", [4096, 4100, 5000, 12_345, 65_537, (1 << 20) + 8])
def test_overhead_is_within_the_documented_bound(nbytes):
    capacity = 8 << 20
    s = _pooled(capacity)
    half = nbytes // 2
    data = {"k": torch.zeros(half, dtype=torch.uint8), "v": torch.zeros(nbytes - half, dtype=torch.uint8)}
    fit = 0
    while s.put(key_of(fit), data) and s.stats()["tiers"]["host"]["evictions"] == 0:
        fit += 1
    st = s.stats()["tiers"]["host"]
    s.close()
    charged = st["used_bytes"] / st["objects"]
    assert charged <= nbytes + 2 * 63  # each tensor 64-byte aligned, nothing more
    assert charged / nbytes - 1 <= 0.125
    assert fit >= capacity // (nbytes + 2 * 63) - 1


def test_runs_coalesce_and_never_overlap():
    pool = SlotPool(1 << 16, slot_size=64)
    rng = random.Random(7)
    live: dict[int, tuple[int, int]] = {}
    owner = [None] * pool.nslots
    for step in range(4000):
        if live and (rng.random() < 0.45 or pool.free_slots() == 0):
            i = rng.choice(list(live))
            start, n = live.pop(i)
            pool.free((start, n))
            owner[start:start + n] = [None] * n
        else:
            run = pool.alloc(rng.choice([1, 8, 64, 100, 640, 4096, 9000]))
            if run is None:
                continue
            start, n = run
            assert all(o is None for o in owner[start:start + n]), "overlapping runs"
            owner[start:start + n] = [step] * n
            live[step] = run
        assert pool.free_slots() == owner.count(None)
    for run in live.values():
        pool.free(run)
    assert pool.free_slots() == pool.nslots and pool.largest_free() == pool.capacity  # one run again


def test_a_fragmented_pool_evicts_until_a_long_run_is_free():
    with _pooled(64 << 10) as s:
        pool = s.tier("host").backend.pool
        small = {"x": torch.zeros(1000, dtype=torch.uint8)}  # 1024 bytes charged
        for i in range(64):
            assert s.put(key_of(i), small)
        s.delete([key_of(i) for i in range(0, 64, 2)])  # half the pool free, in 1 KiB holes
        assert pool.largest_free() == 1024
        big = {"x": torch.arange(8000, dtype=torch.int32)}  # 32000 bytes: needs a long run
        assert s.put(key_of(100), big)
        assert torch.equal(s.get(key_of(100))["x"], big["x"])
        st = s.stats()["tiers"]["host"]
        assert st["used_bytes"] <= st["capacity_bytes"]
        for i in range(1, 64, 2):  # survivors are intact or evicted, never overwritten
            got = s.get(key_of(i))
            assert got is None or not got["x"].any()


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0] if "[" in text else "never"


@pytest.mark.skipif(_thp_mode() == "never" or not sys.platform.startswith("linux"),
                    reason="no transparent huge pages here")
def test_an_unpinned_pool_is_eligible_for_huge_pages():
    """A private unpinned pool lives in a mapping advised MADV_HUGEPAGE: its first use faults 2 MiB pages, not
    4 KiB ones (a fresh-pool save_from of 512 MiB of KV measured ~1.5x faster). Checked in /proc/self/smaps."""
    pool = SlotPool(64 << 20)
    addr = pool.buffer.data_ptr()
    eligible = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "THPeligible:":
                eligible = line.split()[1]
                break
    assert eligible == "1"
