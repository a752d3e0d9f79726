"""The CUDA code paths, value for value against the same operations on CPU: the pinned host pool and
non-blocking copies, ``device`` tiers (the backend contract, and a store with host and disk tiers below),
KV ``save_from`` / ``load_into`` of every paged layout with CUDA caches (whole and layer-wise, many staging
windows, a chunk that vanishes mid-load), weights loaded to CUDA (pinned ring, copy streams, ``load_into``
CUDA parameters, through a store), and the node server's copies into CUDA tensors (through the socket,
straight from its pool, across server restarts).

Every test needs CUDA; their names carry ``cuda`` so that ``pytest -k cuda`` selects them.
``TIERSTORE_CUDA_TESTS_ON_CPU=1`` runs them on CPU instead: a dry run of the tests' own logic on a machine
without a GPU (what is CUDA-specific — pinning, streams, device placement — is then not checked).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import time

import pytest
import torch
from test_kv_paged_io import BS, LAYERS, C, kv_for, kw, make_caches, saved_with_a_chunk_that_vanishes
from test_serve import node_config, url_of

import tierstore
from tierstore.backends import Hit
from tierstore.backends.memory import DeviceBackend, HostBackend
from tierstore.kv import KVCacheStore, KVNamespace, PagedLayout, gather_layers, scatter_layers, transfer
from tierstore.pool import SlotPool
from tierstore.serve import places
from tierstore.serve.server import NodeServer
from tierstore.testing.backends import BackendTests
from tierstore.testing.data import assert_same, chunk, key_of

CUDA = torch.cuda.is_available()
DRY_RUN = os.environ.get("TIERSTORE_CUDA_TESTS_ON_CPU") == "1"
DEVICE = torch.device("cuda:0") if CUDA else torch.device("cpu")

pytestmark = pytest.mark.skipif(not (CUDA or DRY_RUN), reason="needs CUDA")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def on_device(caches):
    return caches.to(DEVICE) if isinstance(caches, torch.Tensor) else [c.to(DEVICE) for c in caches]


def as_list(caches) -> list[torch.Tensor]:
    return [caches] if isinstance(caches, torch.Tensor) else list(caches)


def same_caches(got, want) -> bool:
    """Every element of ``got`` (any device) equals ``want`` (CPU), whole caches: nothing else moved."""
    return all(torch.equal(g.cpu(), w) for g, w in zip(as_list(got), as_list(want), strict=True))


def layer_of(caches, layout: PagedLayout, i: int) -> torch.Tensor:
    """Layer ``i`` of per-layer caches or of a multi-layer pool."""
    if not layout.multi_layer:
        return caches[i]
    return caches[:, i] if layout is PagedLayout.SGLANG_MLA_PAGE_FIRST else caches[:, :, i]


# ---------------------------------------------------------------------- the pinned host pool
def test_cuda_pinned_pools_are_pinned_and_non_blocking_round_trips_are_exact():
    pool = SlotPool(8 << 20, pinned=True)
    assert pool.pinned == CUDA and pool.buffer.is_pinned() == CUDA
    host = HostBackend(capacity=64 << 20, pinned=True)  # pooled (>= POOL_MIN)
    plain = HostBackend(capacity=8 << 20, pinned=True, pool=False)
    try:
        assert host.pool is not None and host.pool.pinned == CUDA and host.pool.buffer.is_pinned() == CUDA
        assert host.stats()["pinned"] == CUDA and plain.stats()["pinned"] == CUDA
        assert transfer.Staging().acquire(1000, pinned=CUDA).is_pinned() == CUDA

        # raw non-blocking H2D / D2H through pool memory, at unaligned offsets and odd lengths
        g = torch.Generator().manual_seed(0)
        n = 3 << 20
        src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=g)
        a, b = pool.view(pool.alloc(n + 64)), pool.view(pool.alloc(n + 64))
        for off, length in ((0, n), (1, n - 1), (63, n - 100), (8, 4093)):
            a[off:off + length].copy_(src[:length])
            dev = torch.empty(length, dtype=torch.uint8, device=DEVICE)
            dev.copy_(a[off:off + length], non_blocking=True)
            b.zero_()
            b[off:off + length].copy_(dev, non_blocking=True)
            sync()
            assert torch.equal(b[off:off + length], src[:length]), (off, length)
        # typed views of the pool: bf16 / f32 rows
        x = torch.randn(1024, 257, generator=g).to(torch.bfloat16)
        view = a[:x.nbytes].view(torch.bfloat16).view(x.shape)
        view.copy_(x)
        y = view.to(DEVICE, non_blocking=True).float().to(torch.bfloat16)
        sync()
        assert torch.equal(y.cpu(), x)

        # the host backends: a write out of CUDA tensors (D2H into pinned memory, waited for) and reads back
        # onto CUDA (copy_tensors / fill_out, non-blocking from pinned memory, waited for), many times over
        # so that a missing wait shows as zeros or stale bytes
        for backend in (host, plain):
            for i in range(8):
                value = chunk(i, 4 << 20)
                backend.write(key_of(i), {n_: t.to(DEVICE) for n_, t in value.items()})
                assert_same(backend.read(key_of(i)), value)
                got = backend.read(key_of(i), device=DEVICE)
                assert all(t.device == DEVICE for t in got.values())
                assert_same({n_: t.cpu() for n_, t in got.items()}, value)
                outs = {n_: torch.full_like(t, 7.0, device=DEVICE) for n_, t in value.items()}
                (hit,) = backend.read_into_many([key_of(i)], [outs])
                assert isinstance(hit, Hit)
                assert_same({n_: t.cpu() for n_, t in outs.items()}, value)
    finally:
        host.close()
        plain.close()


# ---------------------------------------------------------------------- device tiers
class TestCudaDeviceBackend(BackendTests):
    """The whole backend contract on a ``device`` tier living on the GPU."""

    def make_backend(self, capacity):
        return DeviceBackend(device=str(DEVICE))

    def test_borrow_lends_a_readable_chunk(self):  # what it lends lives on the GPU
        b = self.backend()
        b.write(key_of(8), chunk(8))
        with b.borrow(key_of(8)) as lent:
            assert all(t.device == DEVICE for t in lent.values())
            assert_same({n: t.cpu() for n, t in lent.items()}, chunk(8))
        with b.borrow(key_of(9)) as missing:
            assert missing is None


class TestCudaPinnedHostPoolBackend(BackendTests):
    """The backend contract on a pinned host pool (what KV and weights stage through)."""

    def make_backend(self, capacity):
        return HostBackend(capacity=capacity or 64 << 20, pinned=True, pool=True)


CHUNK = 256 << 10


@pytest.mark.parametrize("host_pool", [True, False], ids=["host-pool", "host-plain"])
def test_cuda_device_tier_over_host_and_disk_round_trips_exactly(tmp_path, host_pool):
    """A store [device (GPU), host (pinned), disk]: puts from CPU and from CUDA tensors, eviction from the
    device tier down, reads from each tier onto CPU and CUDA, into CPU, CUDA, mixed and strided ``out``."""
    config = {"tiers": [{"kind": "device", "device": str(DEVICE), "capacity": 4 * CHUNK + 4096},
                        {"kind": "host", "capacity": 8 * CHUNK + (64 << 10), "pinned": True, "pool": host_pool},
                        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}
    n = 16
    keys = [key_of(i) for i in range(n)]
    values = [chunk(i, CHUNK) for i in range(n)]
    with tierstore.open(config) as s:
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            assert s.put(k, v if i % 2 else {name: t.to(DEVICE) for name, t in v.items()})
        s.flush()
        st = s.stats()["tiers"]
        assert st["device"]["evictions"] > 0 and st["device"]["used_bytes"] <= st["device"]["capacity_bytes"]
        assert s.where(keys[-1]) == "device"
        assert all("disk" in s.holders(k) for k in keys)  # write-back reached the bottom

        def check_all():
            for k, v in zip(keys, values, strict=True):
                assert_same(s.get(k), v)
                got = s.get(k, device=DEVICE)
                assert all(t.device == DEVICE for t in got.values())
                assert_same({name: t.cpu() for name, t in got.items()}, v)
            outs = [{name: torch.zeros_like(t, device=DEVICE) for name, t in v.items()} for v in values]
            got = s.get_many(keys, out=outs)
            for g, o, v in zip(got, outs, values, strict=True):
                assert g is not None and all(g[name] is o[name] for name in o)
                assert_same({name: t.cpu() for name, t in o.items()}, v)
            cpu_outs = [{name: torch.zeros_like(t) for name, t in v.items()} for v in values]
            for g, v in zip(s.get_many(keys, out=cpu_outs), values, strict=True):
                assert_same(g, v)
            # one chunk's tensors on both devices; a strided CUDA view
            mixed = [{"k": torch.zeros_like(v["k"], device=DEVICE),
                      "v": torch.zeros(2 * v["v"].numel(), device=DEVICE)[::2]} for v in values]
            for g, v in zip(s.get_many(keys, out=mixed), values, strict=True):
                assert g is not None
                assert_same({name: t.cpu().contiguous() for name, t in g.items()}, v)

        check_all()  # from wherever each chunk is now (reads promote under retain)
        s.flush()
        assert s.evict(keys, "device") > 0
        s.evict(keys, "host")
        assert {s.where(k) for k in keys} == {"disk"}
        check_all()  # every first read from the disk tier, into CUDA
        s.flush()


@pytest.mark.parametrize("verify", ["always", "once"])
def test_cuda_disk_reads_into_cuda_outs_are_staged_verified_and_ordered_after_the_callers_work(tmp_path, verify):
    """The disk tier fills CUDA ``out`` tensors through pinned staging: first reads (careful), repeated reads
    (planned), a damaged object (a miss, its ``out`` untouched), an ``out`` that does not fit (refused), and
    copies that follow work the caller queued on its own stream."""
    from tierstore.backends import file_reads

    disk = tmp_path / "disk"
    config = {"tiers": [{"kind": "disk", "path": str(disk), "capacity": "64MiB", "verify_reads": verify}]}
    n = 12
    keys = [key_of(i) for i in range(n)]
    values = [{**chunk(i, CHUNK), "ids": torch.arange(i, i + 1000, dtype=torch.int64)} for i in range(n)]
    with tierstore.open(config) as s:
        assert all(s.put_many(list(zip(keys, values, strict=True))))
        s.flush()
        for _ in range(3):  # careful, then planned (verify once: trusted) reads into CUDA tensors
            outs = [{name: torch.zeros_like(t, device=DEVICE) for name, t in v.items()} for v in values]
            got = s.get_many(keys, out=outs)
            for g, o, v in zip(got, outs, values, strict=True):
                assert g is not None and all(g[name] is o[name] for name in o)
                assert_same({name: t.cpu() for name, t in o.items()}, v)
        if CUDA:
            assert file_reads._staging.buffer.is_pinned()  # the caller's thread staged some of them

        # work the caller queued on a side stream lands before the copies into the same tensors
        side = torch.cuda.Stream() if CUDA else None
        outs = [{name: torch.empty_like(t, device=DEVICE) for name, t in v.items()} for v in values]
        with torch.cuda.stream(side) if CUDA else contextlib.nullcontext():
            if CUDA:
                torch.cuda._sleep(100_000_000)
            for o in outs:
                for t in o.values():
                    t.fill_(7)
            got = s.get_many(keys, out=outs)
        sync()
        for o, v in zip(outs, values, strict=True):
            assert_same({name: t.cpu() for name, t in o.items()}, v)

        # an out that does not fit is refused; a damaged object is a miss and its out is left alone
        wrong = [{name: torch.zeros(t.numel() + 1, dtype=t.dtype, device=DEVICE) for name, t in values[0].items()}]
        assert s.get_many(keys[:1], out=wrong) == [None]
        path = s.tier("disk").backend.object_path(keys[3])
        with open(path, "r+b") as f:
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        outs = [{name: torch.zeros_like(t, device=DEVICE) for name, t in v.items()} for v in values]
        got = s.get_many(keys, out=outs)
        assert got[3] is None  # (verify once too: the write moved the file's ctime, so it is verified again)
        if CUDA:  # staged: checked before anything reaches the device (a CPU out holds unspecified bytes)
            assert all(not t.any() for t in outs[3].values())
        for i, (g, o, v) in enumerate(zip(got, outs, values, strict=True)):
            if i != 3:
                assert g is not None
                assert_same({name: t.cpu() for name, t in o.items()}, v)


# ---------------------------------------------------------------------- KV caches
@pytest.fixture
def kv_store(tmp_path):
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": True},
                                   {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}]}) as s:
        yield s


def load(kv, tokens, caches, layout, table, start, end, layerwise, on_layer=None):
    """``load_into``; layer-wise, ``on_layer(i)`` runs as soon as ``wait_for_layer(i)`` returns."""
    got = kv.load_into(tokens, caches, layout, table, start=start, n_tokens=end, layerwise=layerwise,
                       **kw(layout))
    if not layerwise:
        return got
    for i in range(got.num_layers):
        got.wait_for_layer(i, timeout=30)
        if on_layer is not None:
            on_layer(i)
    return got.result(30)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("layers_per_object", [None, 1], ids=["all-layers", "per-layer"])
@pytest.mark.parametrize("layout", list(PagedLayout), ids=lambda layout: layout.value)
def test_cuda_kv_save_from_and_load_into_match_the_cpu_cache(kv_store, layout, layers_per_object, layerwise):
    kv = kv_for(kv_store, layout, layers_per_object)
    n, blocks = 4 * C + 7, 40
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[:-(-n // BS)].tolist()
    src = make_caches(layout, blocks)
    tokens = list(range(100, 100 + n))
    assert kv.save_from(tokens, on_device(src), layout, table, **kw(layout)) == 4 * C  # out of a CUDA cache
    expected = gather_layers(src, layout, table, 0, 4 * C, **kw(layout))
    assert all(torch.equal(a, b) for a, b in zip(kv.load(tokens), expected, strict=True))  # what the CPU cache holds

    table2 = torch.randperm(blocks, generator=torch.Generator().manual_seed(2))[:-(-n // BS)].tolist()
    for start, end in ((0, None), (C + 3, None), (0, 4 * C - 5), (C + 3, 3 * C + 1)):
        want = make_caches(layout, blocks, fill=torch.zeros)
        stop = load(kv, tokens, want, layout, table2, start, end, layerwise=False)
        gpu = on_device(make_caches(layout, blocks, fill=torch.zeros))
        ready = []

        def on_layer(i, gpu=gpu, want=want, ready=ready):  # layer i is complete the moment its future resolves
            ready.append(torch.equal(layer_of(gpu, layout, i).cpu(), layer_of(want, layout, i)))

        assert load(kv, tokens, gpu, layout, table2, start, end, layerwise, on_layer) == stop
        assert stop == (4 * C if end is None else end)
        assert all(ready) and same_caches(gpu, want), (start, end)


@pytest.mark.parametrize("layout", [PagedLayout.VLLM, PagedLayout.SGLANG_PAGE_FIRST], ids=lambda layout: layout.value)
def test_cuda_kv_load_into_through_many_staging_windows_is_exact(tmp_path, monkeypatch, layout):
    """Larger KV (bf16, 8 heads of 128) in 2 MiB staging windows: two pinned buffers take turns for dozens of
    tasks, each scattered with non-blocking copies; a buffer reused before its copies finished would show."""
    monkeypatch.setattr(transfer, "STAGING_BYTES", 2 << 20)
    layers, heads, dim, bs, ct, n = 8, 8, 128, 16, 64, 2048
    ns = KVNamespace(model="m", dtype="bfloat16", layout="mha")
    g = torch.Generator().manual_seed(3)
    blocks = n // bs + 8
    table = torch.randperm(blocks, generator=g)[:n // bs].tolist()
    unused = sorted(set(range(blocks)) - set(table))  # zero in the source: a load leaves them as they are
    if layout is PagedLayout.VLLM:
        src = [torch.randn(2, blocks, bs, heads, dim, generator=g).to(torch.bfloat16) for _ in range(layers)]
        for c in src:
            c[:, unused] = 0
        extra = {}
    else:
        src = torch.randn(2, blocks * bs, layers, heads, dim, generator=g).to(torch.bfloat16)
        src.view(2, blocks, bs, layers, heads, dim)[:, unused] = 0
        extra = {"block_size": bs}
    tokens = list(range(n))
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "256MiB", "pinned": True},
                                   {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "512MiB"}]}) as s:
        kv = KVCacheStore(s, ns, chunk_tokens=ct, layers_per_object=1, num_layers=layers)
        assert kv.save_from(tokens, on_device(src), layout, table, **extra) == n
        for layerwise in (False, True):
            for _ in range(3):
                dst = on_device(src.clone().zero_() if isinstance(src, torch.Tensor)
                                else [torch.zeros_like(c) for c in src])
                got = kv.load_into(tokens, dst, layout, table, layerwise=layerwise, **extra)
                assert (got.result(30) if layerwise else got) == n
                assert same_caches(dst, src)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_cuda_kv_a_chunk_vanishing_mid_load_writes_what_the_cpu_load_writes(kv_store, monkeypatch, layerwise):
    """A failed chunk read (chunk 3, layer 2's object) shortens the load exactly as on CPU: the CUDA cache ends
    up identical to the CPU one, nothing written past the vanished chunk in that layer."""
    layout = PagedLayout.VLLM
    kv, tokens, table, src = saved_with_a_chunk_that_vanishes(kv_store, monkeypatch, on_device)
    n = len(tokens)
    results = []
    for caches in (make_caches(layout, len(table), fill=torch.zeros),
                   on_device(make_caches(layout, len(table), fill=torch.zeros))):
        got = kv.load_into(tokens, caches, layout, table, layerwise=layerwise)
        if layerwise:
            assert [got.wait_for_layer(i, 30) for i in range(LAYERS)] == [n, n, 3 * C]
            got = got.result(30)
        results.append((got, caches))
    (cpu_n, cpu), (gpu_n, gpu) = results
    assert cpu_n == gpu_n == 3 * C
    assert same_caches(gpu, cpu)
    want = gather_layers(src, layout, table, 0, n)
    loaded = gather_layers([c.cpu() for c in gpu], layout, table, 0, n)
    assert torch.equal(loaded[2][:, :3 * C], want[2][:, :3 * C]) and not loaded[2][:, 3 * C:].any()
    assert all(torch.equal(loaded[i], want[i]) for i in (0, 1))


@pytest.mark.parametrize("layout", [PagedLayout.VLLM, PagedLayout.VLLM_CPU, PagedLayout.SGLANG_PAGE_FIRST],
                         ids=lambda layout: layout.value)
def test_cuda_kv_one_copy_each_way_between_cuda_blocks_and_the_pinned_pool(kv_store, monkeypatch, layout):
    """``save_from`` a CUDA cache gathers into pinned pool memory reserved for the chunks (no staging: one
    non-blocking D2H copy per piece, synchronized before the commit); ``load_into`` a CUDA cache scatters from
    the pool memory the host tier lends (no read into staging), whole and layer-wise, and gives every loan
    back. The CUDA cache ends up as the same load into a CPU cache leaves it."""
    pool = kv_store.tiers[0].backend.pool
    assert pool is not None and pool.pinned == CUDA
    staged, reads = [], []
    acquire, get_many_async = transfer.Staging.acquire, type(kv_store).get_many_async
    monkeypatch.setattr(transfer.Staging, "acquire", lambda self, *a: staged.append(a) or acquire(self, *a))
    monkeypatch.setattr(type(kv_store), "get_many_async",
                        lambda self, keys, **kw: reads.append(keys) or get_many_async(self, keys, **kw))
    kv = kv_for(kv_store, layout)
    n, blocks = 4 * C, 40
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(4))[:-(-n // BS)].tolist()
    src = make_caches(layout, blocks)
    tokens = list(range(300, 300 + n))
    assert kv.save_from(tokens, on_device(src), layout, table, **kw(layout)) == n
    assert staged == [] and kv.where(tokens) == ["host"] * 4
    expected = gather_layers(src, layout, table, 0, n, **kw(layout))
    assert all(torch.equal(a, b) for a, b in zip(kv.load(tokens), expected, strict=True))
    for layerwise in (False, True):
        want = make_caches(layout, blocks, fill=torch.zeros)
        assert load(kv, tokens, want, layout, table, 0, None, layerwise=False) == n
        gpu = on_device(make_caches(layout, blocks, fill=torch.zeros))
        assert load(kv, tokens, gpu, layout, table, 0, None, layerwise) == n
        sync()
        assert same_caches(gpu, want)
    assert staged == [] and reads == []
    assert kv_store.tiers[0].backend._lent == {}  # every loan given back


@pytest.mark.parametrize("layout", [PagedLayout.VLLM, PagedLayout.VLLM_CPU, PagedLayout.SGLANG_PAGE_FIRST],
                         ids=lambda layout: layout.value)
def test_cuda_kv_gather_and_scatter_never_wait_on_the_device(layout):
    """Block-table checks and indexes are computed on the host (review_turn4 #14): gathering a request's KV out
    of CUDA blocks and scattering it back, as the vLLM worker does per layer on the forward thread, makes no
    synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")`` raises on any)."""
    blocks, n = 40, 4 * C + 3
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(6))[:-(-n // BS)].tolist()
    src = on_device(make_caches(layout, blocks))
    dst = on_device(make_caches(layout, blocks, fill=torch.zeros))
    sync()
    guard = contextlib.nullcontext()
    if CUDA:
        @contextlib.contextmanager
        def guard_syncs():
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        guard = guard_syncs()
    with guard:
        layers = gather_layers(src, layout, table, 3, n, **kw(layout))
        scatter_layers(dst, layout, table, layers, 3, **kw(layout))
    sync()
    assert all(torch.equal(a, b) for a, b in zip(gather_layers(dst, layout, table, 3, n, **kw(layout)),
                                                 gather_layers(src, layout, table, 3, n, **kw(layout)), strict=True))


def test_cuda_kv_a_device_tier_lends_to_a_cpu_cache_and_takes_saves_by_put(tmp_path):
    """A ``device`` tier on top lends CUDA tensors: a load into a CPU cache copies them to the host before the
    CPU scatter reads them (never an asynchronous copy a CPU op would outrun); a save into it (no pool to
    reserve) goes through a put. Both as exact as the host tier."""
    layout = PagedLayout.VLLM
    with tierstore.open({"tiers": [{"kind": "device", "device": str(DEVICE), "capacity": "64MiB"},
                                   {"kind": "host", "capacity": "64MiB", "pinned": True}]}) as store:
        kv = kv_for(store, layout)
        n, blocks = 4 * C, 40
        table = torch.randperm(blocks, generator=torch.Generator().manual_seed(7))[:-(-n // BS)].tolist()
        src = make_caches(layout, blocks)
        tokens = list(range(500, 500 + n))
        assert kv.save_from(tokens, src, layout, table) == n
        assert kv.where(tokens) == ["device"] * 4
        for _ in range(3):
            dst = make_caches(layout, blocks, fill=torch.zeros)
            assert kv.load_into(tokens, dst, layout, table) == n
            assert all(torch.equal(a, b) for a, b in zip(gather_layers(dst, layout, table, 0, n),
                                                         gather_layers(src, layout, table, 0, n), strict=True))


def test_cuda_kv_canonical_save_and_load_on_the_device(kv_store):
    kv = kv_for(kv_store, PagedLayout.VLLM)
    g = torch.Generator().manual_seed(4)
    layers = [torch.randn(2, 3 * C, 2, 4, generator=g) for _ in range(LAYERS)]
    tokens = list(range(3 * C))
    assert kv.save(tokens, on_device(layers)) == 3 * C
    got = kv.load(tokens, device=DEVICE)
    assert all(t.device == DEVICE for t in got)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, layers, strict=True))


# ---------------------------------------------------------------------- weights
def weights():
    pytest.importorskip("blake3", reason="tierstore.weights needs blake3 (a tierstore dependency)")
    import tierstore.weights as tw

    return tw


@pytest.fixture
def checkpoint(tmp_path):
    """Safetensors shards and an index on local disk: floats of every width, int8 of odd sizes (so later
    tensors sit at unaligned offsets), one tensor larger than the read size, an empty one."""
    weights()
    from tierstore.weights.synth import random_tensor, write_checkpoint

    g = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(4):
        tensors[f"layers.{i}.w"] = random_tensor((96, 80), torch.bfloat16, g)
        tensors[f"layers.{i}.odd"] = random_tensor((37 + i,), torch.int8, g)
        tensors[f"layers.{i}.h"] = random_tensor((33, 17), torch.float16, g)
        tensors[f"layers.{i}.norm"] = random_tensor((80,), torch.float32, g)
    tensors["embed"] = random_tensor((600, 512), torch.float32, g)  # 1.2 MB: several reads
    tensors["empty"] = random_tensor((0, 4), torch.float32, g)
    tensors["steps"] = random_tensor((5,), torch.int64, g)
    directory = str(tmp_path / "ckpt")
    assert len(write_checkpoint(directory, tensors, shard_size=700_000)) > 1
    return directory, tensors


def test_cuda_weights_load_to_cuda_is_exact_through_a_pinned_ring_and_copy_streams(checkpoint, monkeypatch):
    tw = weights()
    from safetensors.torch import load_file

    from tierstore import tensors as helpers
    from tierstore.weights import loader

    directory, tensors = checkpoint
    rings, streams = [], []
    get_ring, stream = loader.get_ring, helpers._stream
    monkeypatch.setattr(loader, "get_ring", lambda *a: rings.append(get_ring(*a)) or rings[-1])
    monkeypatch.setattr(helpers, "_stream", lambda d: streams.append(d) or stream(d))
    for device in (DEVICE, str(DEVICE), DEVICE.type):
        got = tw.load(directory, device=device, block_size=64 << 10, concurrency=4, memory_limit=256 << 10)
        assert sorted(got) == sorted(tensors)
        for name, t in got.items():
            assert t.device == DEVICE, name
        assert_same({n: t.cpu() for n, t in got.items()}, tensors)
    assert all(r.pinned == CUDA and r.buffer.is_pinned() == CUDA for r in rings)
    assert (bool(rings) and set(streams) == {DEVICE}) if CUDA else not streams

    # streamed, and cast on the way (the same rounding as on CPU)
    seen = dict(tw.iter_tensors(directory, device=DEVICE, dtype=torch.float16, block_size=100_000))
    for name, t in tensors.items():
        want = t.to(torch.float16) if t.dtype.is_floating_point else t
        assert torch.equal(seen[name].cpu(), want), name
    # safetensors' own reader onto the same device agrees
    shard = next(p for p in sorted(os.listdir(directory)) if p.endswith(".safetensors"))
    ref = load_file(os.path.join(directory, shard), device=str(DEVICE))
    direct = tw.load(os.path.join(directory, shard), device=DEVICE)
    assert sorted(ref) == sorted(direct) and all(torch.equal(ref[n], direct[n]) for n in ref)


def test_cuda_weights_load_into_cuda_parameters(checkpoint):
    tw = weights()
    directory, tensors = checkpoint
    params = {n: torch.full_like(t, 3, device=DEVICE) if t.numel() else torch.empty_like(t, device=DEVICE)
              for n, t in tensors.items()}
    params["layers.0.norm"] = torch.zeros(80, dtype=torch.bfloat16, device=DEVICE)  # cast to another dtype
    params["layers.1.w"] = torch.zeros(80, 96, dtype=torch.bfloat16, device=DEVICE).t()  # not contiguous
    params["embed"] = torch.zeros(600, 512, device=DEVICE)
    filled = tw.load_into(params, directory, block_size=64 << 10, concurrency=4)
    assert sorted(filled) == sorted(tensors)
    for n, p in params.items():
        assert p.device == DEVICE
        assert torch.equal(p.cpu(), tensors[n].to(p.dtype)), n
    # a module's CUDA parameters, through its state_dict
    module = torch.nn.Linear(80, 96, bias=False, dtype=torch.bfloat16, device=DEVICE)
    assert tw.load_into({"layers.2.w": module.weight}, directory) == ["layers.2.w"]
    assert torch.equal(module.weight.detach().cpu(), tensors["layers.2.w"])


@pytest.mark.skipif(not CUDA, reason="streams exist on CUDA only")
@pytest.mark.parametrize("side_stream", [False, True], ids=["current-stream", "side-stream"])
def test_cuda_weights_load_into_lands_after_work_queued_on_the_callers_stream(checkpoint, side_stream):
    """``load_into`` copies on its own streams after the work the caller queued (tierstore/weights/staging.py
    says so): parameters initialised by a slow kernel just before the load hold the checkpoint's values."""
    tw = weights()
    directory, tensors = checkpoint
    params = {n: torch.empty_like(t, device=DEVICE) for n, t in tensors.items() if t.numel()}
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the initialisation lands
        for p in params.values():
            p.fill_(1)
        tw.load_into(params, directory, block_size=64 << 10)
    torch.cuda.synchronize()
    for n, p in params.items():
        assert torch.equal(p.cpu(), tensors[n]), n


def test_cuda_weights_load_through_a_store_is_exact_the_second_time(checkpoint, tmp_path):
    tw = weights()
    directory, tensors = checkpoint
    config = {"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": True},
                        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}]}
    with tierstore.open(config) as store:
        for _ in range(2):
            stats: dict = {}
            got = tw.load(directory, device=DEVICE, store=store, block_size=64 << 10, stats=stats)
            assert all(t.device == DEVICE for t in got.values())
            assert_same({n: t.cpu() for n, t in got.items()}, tensors)
            store.flush()
        assert stats["cache_hits"] and not stats["cache_bytes_missed"]  # the second load came from the store


# ---------------------------------------------------------------------- the node server
def pinned_node_config(tmp_path, host="8MiB"):
    config = node_config(tmp_path, host=host)
    config["tiers"][0]["pinned"] = True  # the shared pool registered for DMA (cudaHostRegister)
    return config


def cuda_outs(value):
    return {n: torch.zeros_like(t, device=DEVICE) for n, t in value.items()}


def in_a_process_of_its_own(body: str, tmp_path) -> None:
    """Run ``body(tmp_path)`` of this module in a fresh interpreter: the node server's pools are registered
    with ``cudaHostRegister``, and should a registration be left behind, its pages and any CUDA error it
    causes stay in that process, not in the one running the other tests."""
    code = (f"import pathlib, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_cuda_paths as m; "
            f"m.{body}(pathlib.Path({str(tmp_path)!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, f"{body} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"


def serve_gets(tmp_path) -> None:
    with NodeServer(pinned_node_config(tmp_path)).start() as server, \
            tierstore.open({"server": url_of(server)}) as store:
        values = [chunk(i, 100_000) for i in range(6)]
        for i, v in enumerate(values):
            assert store.put(key_of(i), v if i % 2 else {n: t.to(DEVICE) for n, t in v.items()})
        for _ in range(4):  # first through the socket (non-blocking copies, waited for), then from the pool
            outs = [cuda_outs(v) for v in values]
            got = store.get_many([key_of(i) for i in range(6)], out=outs)
            for g, o, v in zip(got, outs, values, strict=True):
                assert g is not None and all(g[n] is o[n] for n in o)
                assert_same({n: t.cpu() for n, t in o.items()}, v)
            for i, v in enumerate(values):
                out = cuda_outs(v)
                assert_same({n: t.cpu() for n, t in store.get(key_of(i), out=out).items()}, v)
                fresh = store.get(key_of(i), device=DEVICE)  # no out: fresh CUDA tensors
                assert all(t.device == DEVICE for t in fresh.values())
                assert_same({n: t.cpu() for n, t in fresh.items()}, v)
        if places.DIRECT:
            assert store.stats()["client"]["direct_hits"] > 0
        assert server.store.tier("host").backend.pool.pinned == CUDA  # cudaHostRegister of the shared pool worked


def serve_restarts(tmp_path) -> None:
    config = pinned_node_config(tmp_path)
    for version in range(4):
        value = chunk(100 + version, 100_000)
        with NodeServer(config).start() as server, tierstore.open({"server": url_of(server)}) as store:
            assert store.put(key_of(1), value)
            for _ in range(3):  # through the socket, then straight from the pool
                out = cuda_outs(value)
                assert store.get(key_of(1), out=out) is not None
                assert_same({n: t.cpu() for n, t in out.items()}, value)
            del out
            assert server.store.tier("host").backend.pool.pinned == CUDA  # registered, wherever the mapping landed
        del server, store
        gc.collect()  # the old mappings go now, as a long-running client's would over time
        torch.ones(1, device=DEVICE).add_(1)  # a kernel launch: no CUDA error left over from the restart
        sync()


def serve_restarts_under_one_client(tmp_path) -> None:
    """The same, with one client that outlives the servers: it maps each new server's pool on reconnecting and
    drops the old one."""
    config = pinned_node_config(tmp_path)
    client = None
    try:
        for version in range(4):
            value = chunk(200 + version, 100_000)
            with NodeServer(config).start() as server:
                client = client or tierstore.open({"server": url_of(server)})
                deadline = time.monotonic() + 20
                while not client.put(key_of(1), value):  # until it has reconnected to this server
                    assert time.monotonic() < deadline, "the client never reconnected"
                    time.sleep(0.1)
                for _ in range(3):
                    out = cuda_outs(value)
                    assert client.get(key_of(1), out=out) is not None
                    assert_same({n: t.cpu() for n, t in out.items()}, value)
                del out
            del server
            gc.collect()
            torch.ones(1, device=DEVICE).add_(1)
            sync()
    finally:
        if client is not None:
            client.close()


def test_cuda_gets_through_the_node_server_into_cuda_tensors_are_exact(tmp_path):
    """Through the socket (non-blocking copies out of the registered pool, waited for), then straight from the
    pool (``tierstore.serve.places``), into CUDA ``out`` tensors and fresh CUDA tensors."""
    in_a_process_of_its_own("serve_gets", tmp_path)


def test_cuda_reads_after_node_server_restarts_are_the_new_servers_values(tmp_path):
    """Each restart maps a new pool (registered for DMA) where an old one may have been: a CUDA copy out of
    the new mapping must read the new server's bytes, never the old pages, and leave no CUDA error behind."""
    in_a_process_of_its_own("serve_restarts", tmp_path)


def test_cuda_reads_of_a_client_that_outlives_node_server_restarts_are_the_new_servers_values(tmp_path):
    in_a_process_of_its_own("serve_restarts_under_one_client", tmp_path)
