"""Paged gather/scatter against a per-token reference, for every engine layout."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import InvalidInputError, InvalidTypeError
from tierstore.kv import PagedLayout, gather, gather_layers, scatter, scatter_layers

H, D, LAT = 2, 3, 5


def make_cache(layout: PagedLayout, blocks: int, bs: int, layers: int = 3, dtype=torch.float32):
    shape = {
        PagedLayout.VLLM: (2, blocks, bs, H, D),
        PagedLayout.FLASHINFER: (blocks, 2, bs, H, D),
        PagedLayout.VLLM_CPU: (blocks, H, bs, 2 * D),
        PagedLayout.MLA: (blocks, bs, LAT),
        PagedLayout.SGLANG_PAGE_FIRST: (2, blocks * bs, layers, H, D),
        PagedLayout.SGLANG_PAGE_FIRST_DIRECT: (2, blocks, layers, bs, H, D),
        PagedLayout.SGLANG_MLA_PAGE_FIRST: (blocks * bs, layers, 1, LAT),
    }[layout]
    return torch.randn(shape).to(dtype)


def reference(cache, layout, table, start, end, bs, layer=0):
    """Per-token gather written the slow, obvious way."""
    if layout is PagedLayout.VLLM_CPU:  # as vLLM's CPU backend reads it: view (B, H, 2N, D), chunk(2, dim=2)
        k_cache, v_cache = cache.view(cache.shape[0], H, 2 * bs, D).chunk(2, dim=2)

    def token(b, o):
        return {
            PagedLayout.VLLM: lambda: cache[:, b, o],
            PagedLayout.FLASHINFER: lambda: cache[b, :, o],
            PagedLayout.VLLM_CPU: lambda: torch.stack([k_cache[b, :, o], v_cache[b, :, o]]),
            PagedLayout.MLA: lambda: cache[b, o],
            PagedLayout.SGLANG_PAGE_FIRST: lambda: cache[:, b * bs + o, layer],
            PagedLayout.SGLANG_PAGE_FIRST_DIRECT: lambda: cache[:, b, layer, o],
            PagedLayout.SGLANG_MLA_PAGE_FIRST: lambda: cache[b * bs + o, layer, 0],
        }[layout]()

    rows = [token(table[t // bs], t % bs) for t in range(start, end)]
    if layout.is_mla:
        return torch.stack(rows) if rows else torch.empty(0, LAT, dtype=cache.dtype)
    return torch.stack(rows, dim=1) if rows else torch.empty(2, 0, H, D, dtype=cache.dtype)


@st.composite
def paged_case(draw):
    layout = draw(st.sampled_from(list(PagedLayout)))
    bs = draw(st.integers(1, 5))
    blocks = draw(st.integers(1, 12))
    end = draw(st.integers(0, blocks * bs))
    start = draw(st.integers(0, end))
    needed = -(-end // bs)
    table = draw(st.permutations(range(blocks)))[:needed]
    return layout, bs, blocks, table, start, end


def _kwargs(layout, bs):
    return {"block_size": bs} if layout in (PagedLayout.SGLANG_PAGE_FIRST,
                                            PagedLayout.SGLANG_MLA_PAGE_FIRST) else {}


@settings(max_examples=120, deadline=None)
@given(paged_case())
def test_gather_matches_reference_and_scatter_round_trips(case):
    layout, bs, blocks, table, start, end = case
    kw = _kwargs(layout, bs)
    cache = make_cache(layout, blocks, bs)
    layers = 3 if layout.multi_layer else 1
    for layer in range(layers):
        lk = {"layer": layer} if layout.multi_layer else {}
        got = gather(cache, layout, table, start, end, **kw, **lk)
        assert torch.equal(got, reference(cache, layout, table, start, end, bs, layer))

    # scatter fresh values into a zero cache through the same table, read them back, nothing else moved
    target = torch.zeros_like(cache)
    values = [reference(cache, layout, table, start, end, bs, layer) for layer in range(layers)]
    if layout.multi_layer:
        scatter_layers(target, layout, table, values, start, **kw)
        back = gather_layers(target, layout, table, start, end, **kw)
    else:
        scatter(target, layout, table, values[0], start)
        back = [gather(target, layout, table, start, end)]
    assert all(torch.equal(a, b) for a, b in zip(back, values, strict=True))
    written = sum(v.numel() for v in values)
    assert int((target != 0).sum()) == int(sum((v != 0).sum() for v in values)) <= written


@pytest.mark.parametrize("layout", [PagedLayout.VLLM, PagedLayout.FLASHINFER, PagedLayout.MLA])
def test_gather_layers_per_layer_lists(layout):
    caches = [make_cache(layout, 6, 4) for _ in range(3)]
    table = [5, 0, 3]
    got = gather_layers(caches, layout, table, 1, 11)
    assert len(got) == 3
    for c, g in zip(caches, got, strict=True):
        assert torch.equal(g, reference(c, layout, table, 1, 11, 4))
    fresh = [torch.zeros_like(c) for c in caches]
    scatter_layers(fresh, layout, [2, 4, 1], got, 1)
    assert all(torch.equal(a, b) for a, b in zip(gather_layers(fresh, layout, [2, 4, 1], 1, 11), got, strict=True))


def test_vllm_hnd_strides_use_the_fallback_path():
    """vLLM can allocate (2, blocks, heads, block_size, dim) and expose it permuted: no flat view."""
    physical = torch.randn(2, 6, H, 4, D)
    cache = physical.permute(0, 1, 3, 2, 4)  # logical (2, blocks, block_size, heads, dim)
    with pytest.raises(RuntimeError):
        cache.view(-1, H, D)
    table = [3, 1, 4]
    got = gather(cache, "vllm", table, 2, 10)
    assert torch.equal(got, reference(cache, PagedLayout.VLLM, table, 2, 10, 4))
    out = torch.empty_like(got)
    assert gather(cache, "vllm", table, 2, 10, out=out) is out and torch.equal(out, got)
    target = torch.zeros_like(physical).permute(0, 1, 3, 2, 4)
    scatter(target, "vllm", [0, 5, 2], got, 2)
    assert torch.equal(gather(target, "vllm", [0, 5, 2], 2, 10), got)


def test_gather_into_out_buffer_and_bfloat16():
    cache = make_cache(PagedLayout.FLASHINFER, 8, 16, dtype=torch.bfloat16)
    out = torch.empty(2, 40, H, D, dtype=torch.bfloat16)
    res = gather(cache, "flashinfer", [7, 2, 6], 3, 43, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out, reference(cache, PagedLayout.FLASHINFER, [7, 2, 6], 3, 43, 16))


def test_chunk_tokens_independent_of_block_size():
    """Save a 3-chunk prefix of 7-token chunks out of 4-token blocks, restore it into other blocks."""
    cache = make_cache(PagedLayout.VLLM, 10, 4)
    table = torch.tensor([9, 2, 7, 0, 5, 3], dtype=torch.int32)
    chunks = [gather(cache, "vllm", table, s, s + 7) for s in (0, 7, 14)]
    new = torch.zeros_like(cache)
    new_table = [1, 4, 6, 8, 3, 0]
    for i, c in enumerate(chunks):
        scatter(new, "vllm", new_table, c, 7 * i)
    assert torch.equal(gather(new, "vllm", new_table, 0, 21), torch.cat(chunks, dim=1))
    assert torch.equal(gather(new, "vllm", new_table, 0, 21), gather(cache, "vllm", table, 0, 21))


def test_bad_input_is_rejected_clearly():
    cache = make_cache(PagedLayout.VLLM, 4, 4)
    with pytest.raises(InvalidInputError, match="unknown paged layout"):
        gather(cache, "nope", [0], 0, 1)
    with pytest.raises(InvalidInputError, match="5 dims"):
        gather(cache[0], "vllm", [0], 0, 1)
    with pytest.raises(InvalidInputError, match="need 2 blocks"):
        gather(cache, "vllm", [0], 0, 5)
    with pytest.raises(InvalidInputError, match=r"\[0, 4\)"):
        gather(cache, "vllm", [0, 4], 0, 5)
    with pytest.raises(InvalidInputError, match="twice"):
        scatter(cache, "vllm", [1, 1], torch.zeros(2, 6, H, D), 0)
    with pytest.raises(InvalidInputError, match="start <= end"):
        gather(cache, "vllm", [0, 1], 5, 2)
    with pytest.raises(InvalidTypeError):
        gather(cache, "vllm", [0.5], 0, 1)
    with pytest.raises(InvalidInputError, match="block_size=8 disagrees"):
        gather(cache, "vllm", [0], 0, 1, block_size=8)
    with pytest.raises(InvalidInputError, match="shape"):
        scatter(cache, "vllm", [0, 1], torch.zeros(2, 5, H, D + 1), 0)
    with pytest.raises(InvalidInputError, match="dtype"):
        scatter(cache, "vllm", [0, 1], torch.zeros(2, 5, H, D, dtype=torch.float16), 0)
    pool = make_cache(PagedLayout.SGLANG_PAGE_FIRST, 4, 4)
    with pytest.raises(InvalidInputError, match="block_size"):
        gather(pool, "sglang_page_first", [0], 0, 1, layer=0)
    with pytest.raises(InvalidInputError, match="layer"):
        gather(pool, "sglang_page_first", [0], 0, 1, block_size=4)
    with pytest.raises(InvalidInputError, match="layer must be"):
        gather(pool, "sglang_page_first", [0], 0, 1, block_size=4, layer=3)


BAD_BLOCK_IDS = [
    [0, 2**63], [0, -(2**63) - 1], [0, 10**30], [0, -(10**30)],  # Python ints no int64 holds
    [0, np.uint64(2**63)], [0, np.float64(1.0)], [0, np.bool_(True)], [0, "1"], [0, None], [0, [1]],
    np.array([0, 2**63], dtype=np.uint64), np.array([0, 2**64 - 1], dtype=np.uint64),
    np.array([0, -1]), np.array([0, 9]), np.array([0.0, 1.0]), np.array([[0, 1]]), np.array([True, False]),
    torch.tensor([0, 2**63], dtype=torch.uint64), torch.tensor([0, -(2**63)]), torch.tensor([0, 2**62]),
    [0, 2**63 - 1], [0, -(2**63)], [0, np.int64(-1)],  # int64, but no block of the cache
]


@pytest.mark.parametrize("block_ids", BAD_BLOCK_IDS, ids=lambda b: f"{type(b).__name__}:{b!r}"[:60])
def test_every_bad_block_id_raises_our_error_before_anything_is_written(block_ids):
    cache = make_cache(PagedLayout.VLLM, 4, 4)
    before = cache.clone()
    with pytest.raises((InvalidInputError, InvalidTypeError)):
        scatter(cache, "vllm", block_ids, torch.zeros(2, 8, H, D), 0)
    with pytest.raises((InvalidInputError, InvalidTypeError)):
        scatter_layers([cache], "vllm", block_ids, [torch.zeros(2, 8, H, D)], 0)
    with pytest.raises((InvalidInputError, InvalidTypeError)):
        gather(cache, "vllm", block_ids, 0, 8)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("block_ids", [np.array([3, 1], dtype=np.int32), np.array([3, 1], dtype=np.uint64),
                                       [np.int64(3), np.uint8(1)], torch.tensor([3, 1], dtype=torch.uint64)])
def test_numpy_and_unsigned_block_tables_are_accepted(block_ids):
    cache = make_cache(PagedLayout.VLLM, 4, 4)
    assert torch.equal(gather(cache, "vllm", block_ids, 0, 8), gather(cache, "vllm", [3, 1], 0, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", list(PagedLayout))
def test_same_code_on_cuda(layout):
    kw = _kwargs(layout, 4)
    cache = make_cache(layout, 8, 4)
    lk = {"layer": 1} if layout.multi_layer else {}
    cpu = gather(cache, layout, [6, 1, 3], 2, 11, **kw, **lk)
    gpu = gather(cache.cuda(), layout, torch.tensor([6, 1, 3], device="cuda"), 2, 11, **kw, **lk)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    target = torch.zeros_like(cache).cuda()
    scatter(target, layout, [0, 2, 5], gpu, 2, **kw, **lk)
    assert torch.equal(gather(target, layout, [0, 2, 5], 2, 11, **kw, **lk).cpu(), cpu)
