"""TierstoreHiCacheStorage against SGLang 0.5.23's real code: the ``dynamic`` storage factory, real CPU host
KV pools, and the cache controller's own backup/prefetch methods; plus the contract the fakes in
``tests/adapters`` copy (signatures, config fields, pool shapes)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang_real import PAGE, Controller, create_backend, host_pool, page_bytes, storage_config
from tierstore_sglang import TierstoreHiCacheStorage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))
import sglang_fakes  # noqa: E402

PROMPT = list(range(500, 500 + 6 * PAGE + 5))  # 6 full pages and a partial one
MHA = ["layer_first", "page_first", "page_first_direct"]
CASES = [(False, x) for x in MHA] + [(True, x) for x in MHA]


def disk(path) -> dict:
    return {"config": {"tiers": [{"kind": "disk", "path": str(path), "capacity": "64MiB"}]}}


def test_backend_matches_the_installed_hicache_storage_api():
    assert TierstoreHiCacheStorage.__abstractmethods__ == frozenset()
    assert issubclass(TierstoreHiCacheStorage, HiCacheStorage)
    for name in ("get", "batch_get", "set", "batch_set", "exists", "batch_exists", "batch_get_v1", "batch_set_v1",
                 "register_mem_pool_host", "clear", "get_stats"):
        theirs = inspect.signature(getattr(HiCacheStorage, name)).parameters
        ours = inspect.signature(getattr(TierstoreHiCacheStorage, name)).parameters
        assert list(ours) == list(theirs), name
        assert [p.default is inspect.Parameter.empty for p in ours.values()] == \
               [p.default is inspect.Parameter.empty for p in theirs.values()], name


def test_fakes_copy_the_installed_config_and_pools():
    real = {f.name: f.default for f in dataclasses.fields(HiCacheStorageConfig)}
    fake = {f.name: f.default for f in dataclasses.fields(sglang_fakes.HiCacheStorageConfig)}
    assert fake == real
    for mla, layout in CASES:
        host = host_pool(mla, layout)
        kind = sglang_fakes.MLATokenToKVPoolHost if mla else sglang_fakes.MHATokenToKVPoolHost
        dims = {"kv_cache_dim": host.kv_cache_dim} if mla else {"heads": host.head_num, "dim": host.head_dim}
        fake = kind(host.size, host.page_size, layout, layers=host.layer_num, **dims)
        assert fake.kv_buffer.shape == host.kv_buffer.shape, (mla, layout)
        for i in (0, 3 * PAGE):
            assert fake.get_data_page(i, flat=False).shape == host.get_data_page(i, flat=False).shape
            assert fake.get_data_page(i, flat=False).stride() == host.get_data_page(i, flat=False).stride()
        assert fake.get_dummy_flat_data_page().shape == host.get_dummy_flat_data_page().shape


@pytest.mark.parametrize(("mla", "layout"), CASES)
def test_dynamic_backend_round_trips_pages_bit_exact(tmp_path, mla, layout):
    a_host = host_pool(mla, layout, seed=1)
    a = create_backend(storage_config(disk(tmp_path / "kv"), mla=mla, layout=layout), a_host)
    assert isinstance(a, TierstoreHiCacheStorage)
    try:
        slots = a_host.alloc(6 * PAGE)
        assert Controller(a, a_host).backup(slots, PROMPT) == 6 * PAGE
        want = page_bytes(a_host, slots)
    finally:
        a.close()
    b_host = host_pool(mla, layout)
    b_host.alloc(2 * PAGE)  # another request holds the first pages
    b = create_backend(storage_config(disk(tmp_path / "kv"), mla=mla, layout=layout), b_host)
    try:
        pages, got = Controller(b, b_host).prefetch(PROMPT)
        assert pages == 6 and not torch.equal(got, slots)
        assert torch.equal(page_bytes(b_host, got), want)
        metrics = b.get_stats()
        assert metrics.prefetch_pgs == [6] and metrics.backup_pgs == []
    finally:
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_generic_path_pages_are_the_v1_pages(tmp_path, layout):
    """SGLang without ``interface_v1`` backs up ``get_data_page`` tensors and loads flat pages."""
    a_host = host_pool(False, layout, seed=2)
    a = create_backend(storage_config(disk(tmp_path / "kv"), mla=False, layout=layout), a_host)
    try:
        slots = a_host.alloc(6 * PAGE)
        assert Controller(a, a_host, zero_copy=False).backup(slots, PROMPT) == 6 * PAGE
        want = page_bytes(a_host, slots)
        for zero_copy in (True, False):
            pages, got = Controller(a, a_host, zero_copy=zero_copy).prefetch(PROMPT)
            assert pages == 6 and torch.equal(page_bytes(a_host, got), want)
    finally:
        a.close()


def test_mla_tp_ranks_read_the_one_copy_rank0_writes(tmp_path):
    hosts = [host_pool(True, "page_first", seed=3), host_pool(True, "page_first")]
    ranks = [create_backend(storage_config(disk(tmp_path / "kv"), mla=True, layout="page_first", tp_rank=r,
                                           tp_size=2), hosts[r]) for r in range(2)]
    try:
        slots = hosts[0].alloc(6 * PAGE)
        Controller(ranks[0], hosts[0]).backup(slots, PROMPT)
        pages, got = Controller(ranks[1], hosts[1]).prefetch(PROMPT)
        assert pages == 6 and torch.equal(page_bytes(hosts[1], got), page_bytes(hosts[0], slots))
    finally:
        for r in ranks:
            r.close()
