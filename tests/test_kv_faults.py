"""KVCacheStore paged transfers under faults: a failed transfer never hands another request its KV
through the shared staging buffers; a layer-wise load does no I/O on the caller's thread; a bad block id
is our error, raised before anything moves."""

import threading
import time

import numpy as np
import pytest
import torch

import tierstore
from tierstore import InvalidInputError, InvalidTypeError, KVCacheStore, KVNamespace, MissingKeyError
from tierstore.kv import PagedLayout, gather_layers
from tierstore.kv.rows import PagedTransfer
from tierstore.store import Loan

H, D, LAYERS, C, BS = 2, 4, 3, 16, 5
NS = KVNamespace(model="m", dtype="float32")
HANDSHAKE_S = 0.5  # how long an injected read waits for the race the old code allowed (the fixed code: always)


def kv_layers(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, H, D, generator=g) for _ in range(LAYERS)]


def vllm_caches(blocks: int, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(2, blocks, BS, H, D, device=device) for _ in range(LAYERS)]


def storage(out) -> int:
    return next(iter(out[0].values())).untyped_storage().data_ptr()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])  # CUDA: pinned staging, non-blocking scatters
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_failed_load_never_leaves_a_read_filling_staging_another_load_uses(tmp_path, monkeypatch, layerwise, device):
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": device == "cuda"},
                                   {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C, layers_per_object=1, num_layers=LAYERS)  # a task per layer
        n = 3 * C
        a_tokens, b_tokens = list(range(n)), list(range(1000, 1000 + n))
        a_kv, b_kv = kv_layers(n, 1), kv_layers(n, 2)
        assert kv.save(a_tokens, a_kv) == n and kv.save(b_tokens, b_kv) == n  # no staging used
        a_keys = {o for k in kv.keys(a_tokens) for o in kv._object_keys(k, kv._groups(None))}

        a_reads, stale_buffer = [], []
        a_pending, b_filled, a_written = threading.Event(), threading.Event(), threading.Event()
        get_many, scatter = type(store).get_many, PagedTransfer.scatter

        # the race made deterministic: A's read still pending when its first scatter fails waits until a
        # read of B has filled the same staging buffer, then writes A's KV there before B scatters it
        def reads(self, keys, out=None, device="cpu"):
            if keys[0] in a_keys:
                a_reads.append(keys)
                if len(a_reads) == 2:  # A's next task, read while its first one is scattered (and fails)
                    stale_buffer.append(storage(out))
                    a_pending.set()
                    b_filled.wait(HANDSHAKE_S)  # lands after B's own read into this buffer, if B gets it
                    try:
                        return get_many(self, keys, out=out, device=device)
                    finally:
                        a_written.set()
            got = get_many(self, keys, out=out, device=device)
            if stale_buffer and out is not None and storage(out) == stale_buffer[0]:
                b_filled.set()
                a_written.wait(5)
            return got

        failed = []

        def fail_first_scatter(self, layer, pieces, staged):
            if not failed:
                failed.append(True)
                assert a_pending.wait(5)  # A's next read is under way
                raise RuntimeError("injected scatter failure")
            return scatter(self, layer, pieces, staged)

        monkeypatch.setattr(type(store), "get_many", reads)
        monkeypatch.setattr(type(store), "lend", lambda self, keys: Loan([None] * len(keys)))  # staged reads
        monkeypatch.setattr(PagedTransfer, "scatter", fail_first_scatter)
        table = list(range(-(-n // BS)))
        with pytest.raises(RuntimeError, match="injected"):
            got = kv.load_into(a_tokens, vllm_caches(len(table), device), "vllm", table, layerwise=layerwise)
            if layerwise:
                got.result(10)
        assert failed

        dst = vllm_caches(len(table), device)
        got = kv.load_into(b_tokens, dst, "vllm", table, layerwise=layerwise)
        assert (got.result(10) if layerwise else got) == n
        loaded = gather_layers(dst, PagedLayout.VLLM, table, 0, n)
        assert all(torch.equal(g.cpu(), b) for g, b in zip(loaded, b_kv, strict=True))  # B's KV, never A's


def test_a_failed_save_never_lets_a_late_put_store_another_requests_kv(tmp_path, monkeypatch):
    # a disk top tier stores a batch on its I/O pool: when one chunk's write fails, put_many must not return
    # while the other chunk's write is still reading the staging buffer (the next save refills it)
    with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB",
                                    "io_threads": 4}]}) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        n = 2 * C
        a_tokens, b_tokens = list(range(n)), list(range(1000, 1000 + n))
        table = list(range(-(-n // BS)))
        a_src, b_src = vllm_caches(len(table)), vllm_caches(len(table))
        for caches, seed in ((a_src, 1), (b_src, 2)):
            g = torch.Generator().manual_seed(seed)
            for c in caches:
                c.copy_(torch.randn(c.shape, generator=g))
        a_keys = kv.keys(a_tokens)
        b_gathered, a_stored = threading.Event(), threading.Event()
        disk = store.tier("disk").backend
        write = disk._store

        def write_then_race(key, payload):  # a write reads the staging buffer (writev of its views) as it runs
            if key == a_keys[0]:
                raise OSError("injected put failure")
            if key == a_keys[1]:  # still running when the other item of put_many has failed
                b_gathered.wait(HANDSHAKE_S)
                try:
                    return write(key, payload)
                finally:
                    a_stored.set()
            b_gathered.set()
            a_stored.wait(5)
            return write(key, payload)

        monkeypatch.setattr(disk, "_store", write_then_race)
        assert kv.save_from(a_tokens, a_src, "vllm", table) == C  # its first chunk was refused
        assert kv.save_from(b_tokens, b_src, "vllm", table) == n
        assert a_stored.wait(5)
        store.flush()
        late = store.get(a_keys[1])  # A's second chunk: A's KV, not the bytes B's save gathered meanwhile
        want = gather_layers(a_src, PagedLayout.VLLM, table, C, n)
        assert late is not None and all(torch.equal(late[f"layer.{j}"], want[j]) for j in range(LAYERS))


def test_layerwise_load_into_does_no_io_on_the_callers_thread(tmp_path, monkeypatch):
    url = (tmp_path / "remote").as_uri()
    tiers = [{"kind": "host", "capacity": "64MiB", "pinned": False}, {"kind": "remote", "url": url}]
    n = 4 * C
    tokens, layers = list(range(n)), kv_layers(n, 3)
    with tierstore.open({"tiers": tiers}) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        assert kv.save(tokens[:2 * C], [t[:, :2 * C] for t in layers]) == 2 * C
        store.flush()
        # another engine publishes the rest: only the shared tier holds chunks 2 and 3, this store's
        # indexes do not list them
        with tierstore.open({"tiers": [{"kind": "remote", "url": url}]}) as other:
            assert KVCacheStore(other, NS, chunk_tokens=C).save(tokens, layers) == 2 * C
        remote = store.tier("remote").backend
        stat = remote._stat

        def slow_stat(key):  # a HEAD that takes a second
            time.sleep(1.0)
            return stat(key)

        monkeypatch.setattr(remote, "_stat", slow_stat)
        table = list(range(-(-n // BS)))

        def load(**kw):
            dst = vllm_caches(len(table))
            t0 = time.perf_counter()
            handle = kv.load_into(tokens, dst, "vllm", table, layerwise=True, **kw)
            return handle, dst, time.perf_counter() - t0

        for kw in ({}, {"n_tokens": 2 * C}, {"n_tokens": C + 3, "start": 5}):
            handle, dst, took = load(**kw)
            assert took < 0.2, took
            stop = kw.get("n_tokens", 2 * C)  # what the indexes know
            assert handle.result(10) == stop
            start = kw.get("start", 0)
            got = gather_layers(dst, PagedLayout.VLLM, table, start, stop)
            assert all(torch.equal(g, t[:, start:stop]) for g, t in zip(got, layers, strict=True))
        t0 = time.perf_counter()
        with pytest.raises(MissingKeyError):  # the indexes say fewer: raised as before, still without I/O
            kv.load_into(tokens, vllm_caches(len(table)), "vllm", table, n_tokens=n, layerwise=True)
        assert time.perf_counter() - t0 < 0.2
        with pytest.raises(InvalidInputError):  # bad arguments still raise on the caller's thread
            kv.load_into(tokens, vllm_caches(len(table)), "vllm", table[:2], layerwise=True)

        assert kv.lookup(tokens) == n  # a probing lookup finds the shared chunks; then they load layer-wise
        handle, dst, took = load()
        assert took < 0.2 and handle.result(10) == n
        got = gather_layers(dst, PagedLayout.VLLM, table, 0, n)
        assert all(torch.equal(g, t) for g, t in zip(got, layers, strict=True))


@pytest.mark.parametrize("block_ids", [[0, 2**63], [0, -(2**63) - 1], [0, 10**30], [np.uint64(2**63)],
                                       np.array([0, 2**63], dtype=np.uint64), np.array([0.0, 1.0])])
@pytest.mark.parametrize("op", ["load_into", "save_from"])
def test_a_huge_block_id_is_our_error_before_anything_moves(tmp_path, block_ids, op):
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False}]}) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        tokens = list(range(C))
        kv.save(tokens, kv_layers(C, 4))
        caches, before = vllm_caches(8), store.stats()
        with pytest.raises((InvalidInputError, InvalidTypeError)):
            getattr(kv, op)(tokens, caches, "vllm", block_ids)
        assert all(store.stats()[k] == before[k] for k in ("gets", "puts"))
        assert not any(c.any() for c in caches)
