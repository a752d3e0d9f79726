"""KVCacheStore.load_into / save_from: bit-exact between paged caches of every layout and the store,
per-layer-group objects, windows of staging, layer-wise ordering, vanished chunks, bad input."""

import threading
import time

import pytest
import torch

import tierstore
from tierstore import InvalidInputError, InvalidTypeError, KVCacheStore, KVNamespace, MissingKeyError
from tierstore.kv import PagedLayout, gather_layers, rows, scatter_layers, transfer
from tierstore.store import Loan

H, D, LAT, LAYERS, C, BS = 2, 4, 6, 3, 16, 5  # chunk size and block size deliberately unaligned


@pytest.fixture
def store(tmp_path):
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False},
                                   {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}]}) as s:
        yield s


def make_caches(layout: PagedLayout, blocks: int, fill=torch.randn, seed=0, BS=BS):
    torch.manual_seed(seed)
    shape = {PagedLayout.VLLM: (2, blocks, BS, H, D), PagedLayout.FLASHINFER: (blocks, 2, BS, H, D),
             PagedLayout.VLLM_CPU: (blocks, H, BS, 2 * D), PagedLayout.MLA: (blocks, BS, LAT),
             PagedLayout.SGLANG_PAGE_FIRST: (2, blocks * BS, LAYERS, H, D),
             PagedLayout.SGLANG_PAGE_FIRST_DIRECT: (2, blocks, LAYERS, BS, H, D),
             PagedLayout.SGLANG_MLA_PAGE_FIRST: (blocks * BS, LAYERS, 1, LAT)}[layout]
    if layout.multi_layer:
        return fill(shape)
    return [fill(shape) for _ in range(LAYERS)]


def kw(layout, BS=BS):
    return {"block_size": BS} if layout in (PagedLayout.SGLANG_PAGE_FIRST, PagedLayout.SGLANG_MLA_PAGE_FIRST) else {}


def kv_for(store, layout, layers_per_object=None, **extra):
    ns = KVNamespace(model="m", dtype="float32", layout="mla" if layout.is_mla else "mha")
    return KVCacheStore(store, ns, chunk_tokens=C, layers_per_object=layers_per_object,
                        num_layers=LAYERS if layers_per_object else None, **extra)


@pytest.mark.parametrize("layers_per_object", [None, 1, 2])
@pytest.mark.parametrize("layout", list(PagedLayout))
def test_save_from_then_load_into_is_bit_exact_and_touches_only_its_blocks(store, layout, layers_per_object):
    kv = kv_for(store, layout, layers_per_object)
    n = 4 * C + 7  # four full chunks and a partial one (not stored)
    blocks = 40
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[:-(-n // BS)].tolist()
    src = make_caches(layout, blocks)
    tokens = list(range(100, 100 + n))
    assert kv.save_from(tokens, src, layout, table, **kw(layout)) == 4 * C
    assert kv.lookup(tokens) == 4 * C
    assert kv.save_from(tokens, src, layout, table, **kw(layout)) == 0  # already held
    expected = gather_layers(src, layout, table, 0, 4 * C, **kw(layout))

    # into another cache, through a different block table, from token 0 and from an unaligned start, to the
    # end or to a token inside the last chunk (whole chunks and partial ones in one window)
    table2 = torch.randperm(blocks, generator=torch.Generator().manual_seed(2))[:-(-n // BS)].tolist()
    for start, end in ((0, None), (C + 3, None), (0, 4 * C - 5), (C + 3, 3 * C + 1)):
        dst = make_caches(layout, blocks, fill=torch.zeros)
        stop = 4 * C if end is None else end
        assert kv.load_into(tokens, dst, layout, table2, start=start, n_tokens=end, **kw(layout)) == stop
        got = gather_layers(dst, layout, table2, start, stop, **kw(layout))
        tail = [e[start:stop] if layout.is_mla else e[:, start:stop] for e in expected]
        assert all(torch.equal(g, e) for g, e in zip(got, tail, strict=True))
        # nothing else moved: clearing the loaded tokens leaves an all-zero cache
        zeros = [torch.zeros_like(t) for t in got]
        scatter_layers(dst, layout, table2, zeros, start, **kw(layout))
        assert all(not t.any() for t in ([dst] if layout.multi_layer else dst))

    # the canonical API reads what the paged one wrote, and the other way round
    assert all(torch.equal(a, b) for a, b in zip(kv.load(tokens), expected, strict=True))


@pytest.mark.parametrize("layers_per_object", [None, 1])
def test_save_and_load_into_interoperate_and_windows_split(store, monkeypatch, layers_per_object):
    monkeypatch.setattr(transfer, "STAGING_BYTES", 3 * C * 2 * H * D * 4)  # about three chunks per window
    layout = PagedLayout.VLLM_CPU
    kv = kv_for(store, layout, layers_per_object)
    n = 9 * C
    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(2, n, H, D, generator=g) for _ in range(LAYERS)]
    tokens = list(range(n))
    assert kv.save(tokens, layers) == n
    table = list(range(-(-n // BS)))[::-1]
    dst = make_caches(layout, len(table), fill=torch.zeros)
    assert kv.load_into(tokens, dst, layout, table) == n
    assert all(torch.equal(a, b) for a, b in zip(gather_layers(dst, layout, table, 0, n), layers, strict=True))
    assert kv.stats()["load_misses"] == 0


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_block_aligned_chunks_move_whole_blocks_exactly(store, layout, monkeypatch):
    bs, n = 8, 3 * C  # chunks of 16 tokens are two whole blocks each
    coarse = []
    original = rows._coarsen

    def spy(flat, index, run):
        got = original(flat, index, run)
        coarse.append(got[1] is not index)
        return got

    monkeypatch.setattr(rows, "_coarsen", spy)
    kv = kv_for(store, layout, layers_per_object=2)
    table = torch.randperm(12, generator=torch.Generator().manual_seed(3))[:n // bs].tolist()
    src = make_caches(layout, 12, BS=bs)
    tokens = list(range(7, 7 + n))
    assert kv.save_from(tokens, src, layout, table, **kw(layout, bs)) == n
    dst = make_caches(layout, 12, fill=torch.zeros, BS=bs)
    assert kv.load_into(tokens, dst, layout, table, **kw(layout, bs)) == n
    got = gather_layers(dst, layout, table, 0, n, **kw(layout, bs))
    want = gather_layers(src, layout, table, 0, n, **kw(layout, bs))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if layout in (PagedLayout.VLLM, PagedLayout.FLASHINFER, PagedLayout.MLA):
        assert coarse and all(coarse)  # whole blocks, not single rows


def test_layerwise_layers_complete_in_order_before_later_layers_are_read(store, monkeypatch):
    layers, layout = 6, PagedLayout.VLLM
    ns = KVNamespace(model="m", dtype="float32")
    kv = KVCacheStore(store, ns, chunk_tokens=C, layers_per_object=1, num_layers=layers)
    n = 4 * C
    table = list(range(-(-n // BS)))
    src = [torch.randn(2, len(table), BS, H, D) for _ in range(layers)]
    tokens = list(range(n))
    kv.save_from(tokens, src, layout, table)
    group_of = {}
    for key in kv.keys(tokens):
        for j, obj in enumerate(kv._object_keys(key, kv._groups(None))):
            group_of[obj] = j

    events, lock = [], threading.Lock()
    original = type(store).get_many

    def slow_get_many(self, keys, out=None, device="cpu"):
        groups = {group_of[k] for k in keys}
        with lock:
            events.append(("start", *sorted(groups)))
        time.sleep(0.03)  # a slow tier: each layer's read takes a while
        result = original(self, keys, out=out, device=device)
        with lock:
            events.append(("read", *sorted(groups)))
        return result

    monkeypatch.setattr(type(store), "get_many", slow_get_many)
    monkeypatch.setattr(type(store), "lend", lambda self, keys: Loan([None] * len(keys)))  # read, not lent
    dst = [torch.zeros_like(c) for c in src]
    handle = kv.load_into(tokens, dst, layout, table, layerwise=True)

    def ready(i):  # runs on the loading thread the moment layer i is handed out (its reads take 30 ms)
        with lock:
            events.append(("ready", i))

    for i in range(layers):
        handle.layer(i).add_done_callback(lambda f, i=i: ready(i))
    seen = []
    for i in range(layers):
        assert handle.wait_for_layer(i, timeout=10) == n
        # layer i is usable now and holds exactly the saved KV
        seen.append(torch.equal(gather_layers([dst[i]], layout, table, 0, n)[0],
                                gather_layers([src[i]], layout, table, 0, n)[0]))
    assert handle.result(10) == n and all(seen)
    at = {(e[0], e[1]): k for k, e in enumerate(events)}
    assert sorted(e[1:] for e in events if e[0] == "start") == [(i,) for i in range(layers)]  # one read per layer
    assert [e[1] for e in events if e[0] == "start"] == list(range(layers))  # started in layer order
    for i in range(layers):
        assert at[("read", i)] < at[("ready", i)]
        if i + 2 < layers:  # at most one layer ahead is read while layer i is handed out
            assert at[("ready", i)] < at[("start", i + 2)]


def saved_with_a_chunk_that_vanishes(store, monkeypatch, place=lambda caches: caches):
    """5 chunks of vLLM-layout KV saved one object per layer (from ``place(src)``), then every read of chunk 3's
    layer-2 object misses; returns ``(kv, tokens, table, src)``."""
    layout = PagedLayout.VLLM
    kv = kv_for(store, layout, layers_per_object=1)
    n = 5 * C
    table = list(range(-(-n // BS)))
    src = make_caches(layout, len(table))
    tokens = list(range(n))
    kv.save_from(tokens, place(src), layout, table)
    victim = kv._object_keys(kv.keys(tokens)[3], kv._groups(None))[2]  # chunk 3, layer 2
    original = type(store).get_many

    def lossy(self, keys, out=None, device="cpu"):
        result = original(self, keys, out=out, device=device)
        return [None if k == victim else r for k, r in zip(keys, result, strict=True)]

    lend = type(store).lend

    def lossy_lend(self, keys):  # a chunk the host tier no longer lends either
        loan = lend(self, keys)
        loan.tensors = [None if k == victim else t for k, t in zip(keys, loan.tensors, strict=True)]
        return loan

    monkeypatch.setattr(type(store), "get_many", lossy)
    monkeypatch.setattr(type(store), "lend", lossy_lend)
    return kv, tokens, table, src


def test_a_chunk_vanishing_mid_load_shortens_the_result_and_writes_nothing_past_it(store, monkeypatch):
    layout = PagedLayout.VLLM
    kv, tokens, table, src = saved_with_a_chunk_that_vanishes(store, monkeypatch)
    n = len(tokens)
    dst = make_caches(layout, len(table), fill=torch.zeros)
    handle = kv.load_into(tokens, dst, layout, table, layerwise=True)
    assert handle.result(10) == 3 * C
    assert [handle.wait_for_layer(i) for i in range(LAYERS)] == [n, n, 3 * C]
    got = gather_layers(dst, layout, table, 0, n)
    want = gather_layers(src, layout, table, 0, n)
    assert torch.equal(got[2][:, :3 * C], want[2][:, :3 * C]) and not got[2][:, 3 * C:].any()
    assert kv.stats()["load_misses"] == 1


def test_bad_input_raises_before_anything_is_read(store):
    layout = PagedLayout.VLLM
    kv = kv_for(store, layout)
    tokens = list(range(2 * C))
    table = list(range(-(-2 * C // BS)))
    src = make_caches(layout, len(table))
    kv.save_from(tokens, src, layout, table)
    with pytest.raises(InvalidInputError):  # block table too short for the tokens
        kv.load_into(tokens, make_caches(layout, len(table)), layout, table[:2])
    with pytest.raises(InvalidInputError):  # dtype differs from the namespace
        kv.load_into(tokens, [c.half() for c in src], layout, table)
    with pytest.raises(InvalidInputError):  # layers of different shapes
        kv.load_into(tokens, [src[0], src[1][:, :3]], layout, table)
    with pytest.raises(InvalidTypeError):
        kv.load_into(tokens, src[0], layout, table)
    with pytest.raises(InvalidInputError):  # an MLA layout under an MHA namespace
        kv.load_into(tokens, make_caches(PagedLayout.MLA, len(table)), "mla", table)
    with pytest.raises(MissingKeyError):
        kv.load_into(list(range(50, 50 + 2 * C)), src, layout, table, n_tokens=C)
    with pytest.raises(InvalidInputError):
        KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C, layers_per_object=2)
    grouped = kv_for(store, layout, layers_per_object=1)
    with pytest.raises(InvalidInputError):  # 2 layers given, the store was set up for 3
        grouped.save_from(tokens, src[:2], layout, table)
    assert store.stats()["gets"] == 0
