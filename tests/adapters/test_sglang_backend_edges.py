"""TierstoreHiCacheStorage's engine-free half at its edges: SGLang's legacy flat-page path, per-page
failures, bad input, concurrent prefetch and backup, metrics."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from sglang_fakes import PAGE, PROMPT, Instance, MHATokenToKVPoolHost, disk, kv_bytes, page_hashes, storage_config
from tierstore_sglang.backend import HiCacheBackend
from tierstore_sglang.options import BackendOptions

from tierstore.errors import ConfigError, InvalidInputError, InvalidTypeError

KEYS = page_hashes(PROMPT, PAGE)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_legacy_flat_pages_and_v1_pages_are_the_same_chunks(tmp_path, layout):
    """SGLang without interface_v1 stores ``get_data_page(i)`` and loads into ``get_dummy_flat_data_page()``."""
    with Instance(disk(tmp_path / "kv"), layout=layout, seed=4) as a:
        slots = a.pool.alloc(10 * PAGE)
        starts = slots[::PAGE].tolist()
        assert a.backend.batch_set(KEYS[:5], [a.pool.get_data_page(s) for s in starts[:5]])  # legacy backup
        assert a.backend.batch_set_v1(KEYS[5:], slots[5 * PAGE:]) == [True] * 5            # v1 backup
        assert a.backend.set(KEYS[0], a.pool.get_data_page(starts[0])), "storing a page twice is fine"
        want = kv_bytes(a.pool, slots)
    with Instance(disk(tmp_path / "kv"), layout=layout) as b:
        assert b.backend.exists(KEYS[9]) and b.backend.batch_exists(KEYS) == 10
        host = b.pool.alloc(10 * PAGE)
        assert b.backend.batch_get_v1(KEYS[:5], host[:5 * PAGE]) == [True] * 5  # legacy-written, v1-read
        flats = b.backend.batch_get(KEYS[5:], [b.pool.get_dummy_flat_data_page() for _ in range(5)])
        for start, flat in zip(host[5 * PAGE::PAGE].tolist(), flats, strict=True):
            b.pool.set_from_flat_data_page(start, flat)  # what _generic_page_get does
        assert torch.equal(kv_bytes(b.pool, host), want)
        single = b.backend.get(KEYS[3])
        assert torch.equal(single, b.pool.get_data_page(int(host[3 * PAGE])))
        assert b.backend.get("f" * 64) is None and b.backend.batch_get(["f" * 64]) == [None]


def test_a_damaged_page_fails_alone_and_the_prefetch_stops_before_it(tmp_path):
    with Instance(disk(tmp_path / "kv"), seed=8) as a:
        a.ctl.backup(a.pool.alloc(10 * PAGE), PROMPT)
        damaged = a.backend.chunk_keys([KEYS[2]])[0]
    path = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "kv") for f in fs if damaged.hex() in f)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with Instance(disk(tmp_path / "kv")) as b:
        host = b.pool.alloc(10 * PAGE)
        assert b.backend.batch_get_v1(KEYS, host) == [True, True, False] + [True] * 7
        assert b.backend.store.stats()["tiers"]["disk"]["corrupt"] == 1
        loaded, _ = b.ctl.prefetch(PROMPT)  # the controller counts the leading pages only
        assert loaded == 2


def test_a_page_no_tier_takes_is_reported_alone(tmp_path, monkeypatch):
    with Instance(disk(tmp_path / "kv"), seed=9) as a:
        refused = a.backend.chunk_keys([KEYS[1]])[0]
        disk_backend = a.backend.store.tier("disk").backend
        write = disk_backend._store

        def refuse_one(key, payload):
            if key == refused:
                raise OSError("injected: no room")
            return write(key, payload)

        monkeypatch.setattr(disk_backend, "_store", refuse_one)
        assert a.backend.batch_set_v1(KEYS[:4], a.pool.alloc(4 * PAGE)) == [True, False, True, True]
        assert a.backend.counters["pages_not_written"] == 1
        assert a.backend.batch_exists(KEYS[:4]) == 1


def test_bad_calls_raise_before_any_io_and_lose_nothing(tmp_path):
    with Instance(disk(tmp_path / "kv"), seed=11) as a:
        slots = a.pool.alloc(4 * PAGE)
        assert all(a.backend.batch_set_v1(KEYS[:4], slots))
        before = kv_bytes(a.pool, slots).clone()
        with pytest.raises(InvalidInputError, match="need 16 token slots"):
            a.backend.batch_get_v1(KEYS[:4], slots[:-1])
        with pytest.raises(InvalidInputError, match="whole pages"):
            a.backend.batch_get_v1(KEYS[:4], slots + 1)  # not page-aligned
        with pytest.raises(InvalidInputError, match="whole pages"):
            a.backend.batch_set_v1(KEYS[:1], torch.arange(a.pool.size, a.pool.size + PAGE))  # past the pool
        with pytest.raises(InvalidTypeError):
            a.backend.batch_get_v1(KEYS[:4], slots.float())
        with pytest.raises(InvalidTypeError, match="non-empty str"):
            a.backend.batch_exists([KEYS[0], 7])
        with pytest.raises(InvalidTypeError):
            a.backend.batch_exists(KEYS[0])  # one str, not a list
        with pytest.raises(InvalidInputError, match="a page of this pool"):
            a.backend.set(KEYS[5], torch.zeros(3, dtype=torch.bfloat16))
        with pytest.raises(InvalidInputError, match="a page of this pool"):
            a.backend.get(KEYS[0], torch.zeros(a.backend.geometry.numel, dtype=torch.float32))
        with pytest.raises(InvalidInputError, match="contiguous"):
            a.backend.get(KEYS[0], torch.zeros(2 * a.backend.geometry.numel, dtype=torch.bfloat16)[::2])
        assert torch.equal(kv_bytes(a.pool, slots), before)
        assert a.backend.batch_exists(KEYS) == 4 and not a.backend.exists(KEYS[5])
        fresh = a.pool.alloc(4 * PAGE)
        assert all(a.backend.batch_get_v1(KEYS[:4], fresh)) and torch.equal(kv_bytes(a.pool, fresh), before)


def test_bad_configuration_is_refused_at_construction(tmp_path):
    extra = disk(tmp_path / "kv")
    with pytest.raises(ConfigError, match="model_id"):
        HiCacheBackend(storage_config(extra, model=None), {})
    with pytest.raises(ConfigError, match="not both"):
        HiCacheBackend(storage_config({**extra, "remote": "s3://b/kv"}), {})
    with pytest.raises(ConfigError, match="dcp_size"):
        HiCacheBackend(storage_config(extra, dcp_size=2), {})
    with pytest.raises(ConfigError, match="tenant must be"):
        BackendOptions.parse({"tenant": 3})
    with pytest.raises(ConfigError, match="cannot be read"):
        BackendOptions.parse({"config": str(tmp_path / "missing.yaml")})
    backend = HiCacheBackend(storage_config(extra), {})
    try:
        with pytest.raises(InvalidInputError, match="register_mem_pool_host"):
            backend.batch_exists(KEYS)
        with pytest.raises(InvalidTypeError, match="register_mem_pool_host"):
            backend.register_mem_pool_host(None)
        odd = MHATokenToKVPoolHost(64, PAGE, "page_first")
        odd.layout = "page_unified"
        with pytest.raises(ConfigError, match="--hicache-mem-layout"):
            backend.register_mem_pool_host(odd)
        copied = MHATokenToKVPoolHost(64, PAGE, "page_first")
        copied.get_data_page = lambda i, flat=True: torch.zeros(2, PAGE, 2, 2, 8, dtype=torch.bfloat16)
        with pytest.raises(ConfigError, match="view of kv_buffer"):
            backend.register_mem_pool_host(copied)
    finally:
        backend.close()


def test_another_page_size_never_reads_these_pages(tmp_path):
    with Instance(disk(tmp_path / "kv"), seed=12) as a:
        a.ctl.backup(a.pool.alloc(10 * PAGE), PROMPT)
    with Instance(disk(tmp_path / "kv"), page=2 * PAGE) as b:
        assert b.ctl.prefetch(PROMPT)[0] == 0
        assert b.backend.batch_exists(KEYS) == 0, "same SGLang key strings, other page size: other keys"


def test_default_config_is_a_per_rank_disk_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    options = BackendOptions.parse({"backend_name": "tierstore", "interface_v1": 1})
    assert [t["kind"] for t in options.config["tiers"]] == ["disk"]
    with Instance({}, tp_rank=1, tp_size=2) as r:
        assert r.backend.store.tier("disk").backend.path == str(tmp_path / ".cache/tierstore/sglang/disk/tp1of2-pp0of1")
        r.backend.clear()  # SGLang's /flush_cache keeps what is stored
        slots = r.pool.alloc(PAGE)
        assert r.backend.batch_set_v1(KEYS[:1], slots) == [True]
        r.backend.clear()
        assert r.backend.exists(KEYS[0])


def test_concurrent_prefetch_and_backup_get_exact_pages(tmp_path, monkeypatch):
    """SGLang's prefetch and backup threads call the backend at once: every page read is the page stored."""
    prompts = [[p * 100_000 + i for i in range(6 * PAGE)] for p in range(8)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []
    try:
        with Instance(disk(tmp_path / "kv"), seed=13, size=1024) as a:
            slots = {p: a.pool.alloc(6 * PAGE) for p in range(8)}
            want = {p: kv_bytes(a.pool, slots[p]) for p in range(8)}
            lock = threading.Lock()  # the fake pool's allocator is not thread-safe (SGLang's has a lock)
            disk_backend = a.backend.store.tier("disk").backend
            write = disk_backend._store

            def slow_put(key, payload):  # pages of one batch become visible one by one, mid-prefetch
                time.sleep(0.002)
                return write(key, payload)

            monkeypatch.setattr(disk_backend, "_store", slow_put)

            def backup(p: int) -> None:
                try:
                    a.backend.batch_set_v1(page_hashes(prompts[p], PAGE), slots[p])
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            def prefetch(p: int) -> None:
                try:
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline:
                        keys = page_hashes(prompts[p], PAGE)
                        n = a.backend.batch_exists(keys)
                        with lock:
                            host = a.pool.alloc(n * PAGE)
                        ok = a.backend.batch_get_v1(keys[:n], host)
                        assert ok == [True] * n, "a page that exists reads"
                        assert torch.equal(kv_bytes(a.pool, host), want[p][:n * PAGE])
                        with lock:
                            a.pool.free(host)
                        if n == 6:
                            return
                    raise AssertionError("never saw all pages")
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=f, args=(p,)) for p in range(8) for f in (prefetch, backup)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[0]


def test_storage_metrics_report_pages_and_bandwidth(tmp_path):
    with Instance(disk(tmp_path / "kv"), seed=14, metrics=True) as a:
        a.ctl.backup(a.pool.alloc(10 * PAGE), PROMPT)
        a.ctl.prefetch(PROMPT)
        prefetch, backup = a.backend.take_metrics()
        assert [p for p, _ in prefetch] == [10] and [p for p, _ in backup] == [10]
        assert all(gbps > 0 for _, gbps in prefetch + backup)
        assert a.backend.take_metrics() == ([], [])
        counters = a.backend.stats()["backend"]
        assert counters["pages_written"] == 10 and counters["pages_hit"] == 10 and counters["exists_hit"] == 10
