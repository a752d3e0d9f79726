"""KVCacheStore over a real tiered store (host + disk in tmp dirs): save, lookup, load, exactness."""

from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import InvalidInputError, InvalidTypeError, KVCacheStore, KVNamespace, MissingKeyError
from tierstore.kv import gather_layers, scatter_layers
from tierstore.models import TinyConfig, TinyDecoder

CFG = TinyConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, seed=3)
C = 16  # chunk tokens


def config(tmp_path, host="64MiB", disk="256MiB"):
    return {"tiers": [{"kind": "host", "capacity": host},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": disk}],
            "write_policy": "write_back"}


@pytest.fixture
def store(tmp_path):
    with tierstore.open(config(tmp_path)) as s:
        yield s


def ns_for(model, **kw):
    return KVNamespace(**model.namespace_fields(), **kw)


def random_kv(n, layers=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, 2, 8, generator=g).to(dtype) for _ in range(layers)]


def ids(n, seed=0):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_bit_exact(store, dtype):
    kv = KVCacheStore(store, KVNamespace(model="m", dtype=dtype), chunk_tokens=C)
    toks, layers = ids(3 * C + 5), random_kv(3 * C + 5, dtype=dtype)
    assert kv.lookup(toks) == 0 and kv.load(toks) is None
    assert kv.save(toks, layers) == 3 * C  # the trailing partial chunk is not stored
    assert kv.lookup(toks) == 3 * C
    got = kv.load(toks)
    assert len(got) == 3 and all(torch.equal(g, ref[:, :3 * C]) for g, ref in zip(got, layers, strict=True))
    assert kv.save(toks, layers) == 0  # already there
    # a longer request with the same prefix hits the same chunks; n_tokens need not be chunk-aligned
    longer = torch.cat([toks, ids(40, seed=9)])
    assert kv.lookup(longer) == 3 * C
    part = kv.load(longer, n_tokens=C + 3)
    assert all(torch.equal(g, ref[:, :C + 3]) for g, ref in zip(part, layers, strict=True))
    assert kv.load(longer, n_tokens=0) is None
    s = kv.stats()
    assert s["saved_chunks"] == 3 and s["skipped_chunks"] == 3 and s["loaded_chunks"] == 5


def test_save_from_start_extends_a_saved_prefix_without_its_kv(store):
    """A conversation's decoded tokens: the prompt was saved; later only the KV from ``start`` on is at hand."""
    kv = KVCacheStore(store, KVNamespace(model="m", dtype=torch.float32), chunk_tokens=C)
    toks, layers = ids(4 * C + 3), random_kv(4 * C + 3)
    assert kv.save(toks[:2 * C], [t[:, :2 * C] for t in layers]) == 2 * C
    tail = [t[:, 2 * C:] for t in layers]
    assert kv.save(toks, tail, start=2 * C) == 2 * C  # chunks 2 and 3 (the last partial one is not stored)
    got = kv.load(toks)
    assert all(torch.equal(g, ref[:, :4 * C]) for g, ref in zip(got, layers, strict=True))
    assert kv.save(toks, tail, start=2 * C) == 0  # held already
    assert kv.save(toks, [t[:, 4 * C:] for t in layers], start=4 * C) == 0  # only a partial chunk past start
    for bad in (C // 2, -C, 5 * C, 2.0 * C):
        with pytest.raises(InvalidInputError, match="start"):
            kv.save(toks, tail, start=bad)
    with pytest.raises(InvalidInputError, match="tokens"):
        kv.save(toks, layers, start=2 * C)  # the layers must hold exactly the tokens from start
    assert kv.load(toks) is not None and kv.lookup(toks) == 4 * C  # nothing stored was harmed


def test_mla_layout(store):
    kv = KVCacheStore(store, KVNamespace(model="m", layout="mla", dtype="float16"), chunk_tokens=C)
    toks = ids(2 * C)
    layers = [torch.randn(2 * C, 12).half() for _ in range(4)]
    kv.save(toks, layers)
    got = kv.load(toks)
    assert all(torch.equal(g, ref) for g, ref in zip(got, layers, strict=True))
    with pytest.raises(InvalidInputError, match="latent"):
        kv.save(toks, random_kv(2 * C, dtype=torch.float16))


def test_partial_chunks_policy(store):
    ns = KVNamespace(model="m", dtype="float32")
    kv = KVCacheStore(store, ns, chunk_tokens=C, partial_chunks=True)
    toks, layers = ids(2 * C + 5), random_kv(2 * C + 5)
    assert kv.save(toks, layers) == 2 * C + 5
    assert kv.lookup(toks) == 2 * C + 5  # the resent prompt hits entirely
    assert all(torch.equal(g, ref) for g, ref in zip(kv.load(toks), layers, strict=True))
    assert kv.lookup(toks[:-1]) == 2 * C  # the partial key names exactly those 5 tokens
    assert kv.lookup(torch.cat([toks, ids(3, seed=4)])) == 2 * C
    # the default store (no partial chunks) shares the full chunks
    assert KVCacheStore(store, ns, chunk_tokens=C).lookup(toks) == 2 * C


def test_other_namespaces_get_zero_hits(store):
    base = KVNamespace(model="m", revision="r1", dtype="float32")
    toks = ids(4 * C)
    KVCacheStore(store, base, chunk_tokens=C).save(toks, random_kv(4 * C))
    assert KVCacheStore(store, base, chunk_tokens=C).lookup(toks) == 4 * C
    for other in (base.replace(model="m2"), base.replace(revision="r2"), base.replace(dtype="bfloat16"),
                  base.replace(tp_rank=1, tp_size=2), base.replace(tenant="t"), base.replace(layout="mha:x")):
        assert KVCacheStore(store, other, chunk_tokens=C).lookup(toks) == 0, other
    assert KVCacheStore(store, base, chunk_tokens=2 * C).lookup(toks) == 0


def test_load_errors_and_limits(store):
    kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
    toks = ids(3 * C + 2)
    kv.save(toks[:2 * C], random_kv(2 * C))
    with pytest.raises(MissingKeyError, match="only 32 of the requested 40"):
        kv.load(toks, n_tokens=40)
    with pytest.raises(KeyError):
        kv.load(toks, n_tokens=3 * C)
    with pytest.raises(InvalidInputError, match="outside"):
        kv.load(toks, n_tokens=len(toks) + 1)
    with pytest.raises(InvalidInputError, match="full chunks"):
        kv.load(toks, n_tokens=3 * C + 1)
    with pytest.raises(InvalidTypeError):
        kv.load(toks, n_tokens=2.0)


@pytest.mark.parametrize("layers,match", [
    (lambda: random_kv(2 * C, dtype=torch.bfloat16), "dtype"),
    (lambda: random_kv(2 * C + 1), "33 tokens"),
    (lambda: random_kv(2 * C)[:1] + [torch.randn(2, 2 * C, 3, 8)], "layers\\[1\\]"),
    (lambda: [torch.randn(3, 2 * C, 2, 8)], "\\(2, n_tokens"),
    (lambda: [], "empty"),
])
def test_save_rejects_bad_layers(store, layers, match):
    kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
    with pytest.raises(InvalidInputError, match=match):
        kv.save(ids(2 * C), layers())


def test_save_and_constructor_type_errors(store):
    kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
    with pytest.raises(InvalidTypeError):
        kv.save(ids(C), torch.randn(2, C, 2, 8))
    with pytest.raises(InvalidTypeError):
        kv.save(ids(C), [torch.randn(2, C, 2, 8).numpy()])
    with pytest.raises(InvalidTypeError):
        kv.save([0.5] * C, random_kv(C))
    with pytest.raises(InvalidTypeError):
        KVCacheStore(store, {"model": "m"})
    with pytest.raises(InvalidTypeError):
        KVCacheStore(object(), KVNamespace(model="m"))
    with pytest.raises(InvalidInputError, match="contradicts"):
        KVCacheStore(store, KVNamespace(model="m", chunk_tokens=8), chunk_tokens=16)
    assert KVCacheStore(store, KVNamespace(model="m", chunk_tokens=8)).chunk_tokens == 8
    assert KVCacheStore(store, KVNamespace(model="m")).chunk_tokens == 256


def test_model_continues_bit_identically_from_loaded_kv(store):
    """Prefill a prefix, save, load, continue: logits equal the no-store split and ≈ a full recompute."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        model = TinyDecoder(CFG, dtype=dtype)
        kv = KVCacheStore(store, ns_for(model), chunk_tokens=C)
        prompt = ids(5 * C + 7, seed=1)
        first = model.prefill(prompt[:3 * C + 4])
        kv.save(prompt[:3 * C + 4], first.kv)
        hit = kv.lookup(prompt)
        assert hit == 3 * C
        loaded = kv.load(prompt, hit)
        with_store = model.prefill(prompt[hit:], loaded).logits
        without_store = model.prefill(prompt[hit:], [t[:, :hit] for t in first.kv]).logits
        assert torch.equal(with_store, without_store)
        full = model.prefill(prompt).logits[hit:]
        assert (with_store - full).abs().max().item() <= tol


def test_hits_survive_host_eviction_and_come_from_disk(tmp_path):
    chunk_bytes = 3 * 2 * C * 2 * 8 * 4
    with tierstore.open(config(tmp_path, host=3 * chunk_bytes + 4096)) as store:
        kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
        toks, layers = ids(8 * C), random_kv(8 * C)
        kv.save(toks, layers)
        store.flush()
        tiers = kv.where(toks)
        assert "disk" in tiers and set(tiers) <= {"host", "disk"}
        assert all(torch.equal(g, ref) for g, ref in zip(kv.load(toks), layers, strict=True))
    # a restarted engine (same disk dir, empty host) still hits everything, from disk
    with tierstore.open(config(tmp_path)) as store:
        kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
        assert kv.where(toks) == ["disk"] * 8
        assert kv.prefetch(toks).result(timeout=30) == 8
        assert kv.where(toks) == ["host"] * 8
        assert all(torch.equal(g, ref) for g, ref in zip(kv.load(toks), layers, strict=True))


def test_corrupt_chunk_is_a_miss_never_data(tmp_path):
    cfg = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}
    with tierstore.open(cfg) as store:
        kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
        toks, layers = ids(3 * C), random_kv(3 * C)
        kv.save(toks, layers)

        def corrupt(index):
            victim = kv.keys(toks)[index].hex()
            path = next(Path(tmp_path / "disk").rglob(f"{victim}*"))
            raw = bytearray(path.read_bytes())
            raw[-5] ^= 0xFF
            path.write_bytes(bytes(raw))

        corrupt(2)
        assert kv.lookup(toks) == 3 * C  # the index still lists it
        got = kv.load(toks)  # the read finds the bad checksum: the result stops before chunk 2
        assert got[0].shape[1] == 2 * C
        assert all(torch.equal(g, ref[:, :2 * C]) for g, ref in zip(got, layers, strict=True))
        corrupt(1)
        with pytest.raises(MissingKeyError, match="vanished"):
            kv.load(toks, n_tokens=2 * C)
        assert kv.lookup(toks) == C
        assert kv.stats()["load_misses"] >= 1


@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_paged_engine_round_trip(store, layout):
    """Gather a request's KV out of paged blocks, save, load, scatter into newly allocated blocks."""
    model = TinyDecoder(CFG)
    kv = KVCacheStore(store, ns_for(model, layout=f"mha:{layout}"), chunk_tokens=C)
    bs, prompt = 8, ids(4 * C, seed=2)
    computed = model.prefill(prompt).kv
    shape = ((2, 20, bs, 2, 16) if layout == "vllm" else (20, 2, bs, 2, 16))
    caches = [torch.zeros(shape) for _ in computed]
    table = [19, 3, 11, 7, 0, 15, 2, 9]
    scatter_layers(caches, layout, table, computed)
    kv.save(prompt, gather_layers(caches, layout, table, 0, len(prompt)))
    fresh = [torch.zeros(shape) for _ in computed]
    new_table = [1, 4, 5, 6, 8, 10, 12, 13]
    scatter_layers(fresh, layout, new_table, kv.load(prompt))
    got = gather_layers(fresh, layout, new_table, 0, len(prompt))
    assert all(torch.equal(a, b) for a, b in zip(got, computed, strict=True))


def test_foreign_chunk_with_wrong_layout_is_a_miss(store):
    """A chunk under our key but with another shape/dtype (a buggy writer) is never handed out."""
    kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=C)
    toks, layers = ids(3 * C), random_kv(3 * C)
    keys = kv.keys(toks)
    store.put(keys[0], {f"layer.{j}": t[:, :C] for j, t in enumerate(layers)})
    store.put(keys[1], {f"layer.{j}": t[:, C:2 * C].half() for j, t in enumerate(layers)})  # wrong dtype
    store.put(keys[2], {"layer.0": layers[0][:, 2 * C:]})  # layers missing
    got = kv.load(toks)
    assert got[0].shape[1] == C and kv.stats()["bad_chunks"] == 1
    with pytest.raises(MissingKeyError):
        kv.load(toks, n_tokens=2 * C)
    assert kv.stats()["bad_chunks"] == 2
