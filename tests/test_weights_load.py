"""tierstore.weights: bit-exact loads against safetensors' reference reader, subsets, shards, load_into."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import tierstore.weights as tw
from tierstore.errors import InvalidInputError, InvalidTypeError, MissingKeyError, TierstoreError
from tierstore.weights.checkpoint import HEADER_PROBE
from tierstore.weights.header import DTYPES
from tierstore.weights.sources import LocalFileSource
from tierstore.weights.synth import random_tensor, write_checkpoint

SAFETENSORS_DTYPES = sorted({dt for code, (dt, _) in DTYPES.items()
                             if code in __import__("safetensors.torch", fromlist=["_TYPES"])._TYPES},
                            key=str)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype, k
        assert got[k].shape == ref[k].shape, k
        assert raw(got[k]) == raw(ref[k]), k


def test_every_safetensors_dtype_is_known():
    from safetensors.torch import _TYPES
    assert {c for c in _TYPES if _TYPES[c] is not None} <= set(DTYPES)


@pytest.mark.parametrize("block_size", [64, 4096, 16 << 20])
def test_all_dtypes_bit_exact(tmp_path, block_size):
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i, dt in enumerate(SAFETENSORS_DTYPES):
        for j, shape in enumerate([(), (0,), (3,), (7, 13), (2, 0, 5), (33, 65)]):
            tensors[f"t{i}.{j}"] = random_tensor(shape, dt, g)
    path = str(tmp_path / "all.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    ref = load_file(path)
    assert_same(tw.load(path, block_size=block_size, concurrency=3), ref)
    names = [n for n, _ in tw.iter_tensors(path, block_size=block_size)]
    assert sorted(names) == sorted(ref) and len(names) == len(set(names))


_dtypes = st.sampled_from(SAFETENSORS_DTYPES)
_shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.dictionaries(st.text("abcxyz.0123", min_size=1, max_size=8), st.tuples(_dtypes, _shapes),
                            min_size=1, max_size=8),
       block_size=st.integers(16, 5000), concurrency=st.integers(1, 6), memory_limit=st.integers(0, 20000),
       seed=st.integers(0, 2**16))
def test_random_checkpoints_bit_exact(tmp_path, spec, block_size, concurrency, memory_limit, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {n: random_tensor(shape, dt, g) for n, (dt, shape) in spec.items()}
    path = str(tmp_path / "r.safetensors")
    save_file(tensors, path)
    ref = load_file(path)
    opts = dict(block_size=block_size, concurrency=concurrency, memory_limit=memory_limit)
    assert_same(tw.load(path, **opts), ref)
    params = {n: torch.zeros_like(t) for n, t in ref.items()}
    assert sorted(tw.load_into(params, path, **opts)) == sorted(ref)
    assert_same(params, ref)


@pytest.fixture
def sharded(tmp_path):
    g = torch.Generator().manual_seed(2)
    tensors = {f"model.layers.{i}.w{j}": random_tensor((64, 48), torch.bfloat16, g)
               for i in range(6) for j in range(3)}
    tensors["model.norm.weight"] = random_tensor((48,), torch.float32, g)
    paths = write_checkpoint(str(tmp_path / "ckpt"), tensors, shard_size=40_000)
    assert len(paths) > 2
    return str(tmp_path / "ckpt"), paths, tensors


def test_sharded_with_index(sharded):
    directory, paths, tensors = sharded
    assert_same(tw.load(directory), tensors)
    assert_same(tw.load(os.path.join(directory, "model.safetensors.index.json")), tensors)
    assert_same(tw.load("file://" + directory, block_size=1000), tensors)
    one = tw.load(paths[0])
    assert_same(one, load_file(paths[0]))


def test_directory_without_index_loads_every_file(sharded):
    directory, paths, tensors = sharded
    os.unlink(os.path.join(directory, "model.safetensors.index.json"))
    assert_same(tw.load(directory), tensors)


def test_subset_reads_only_what_it_needs(sharded, tmp_path):
    directory, _, tensors = sharded
    g = torch.Generator().manual_seed(3)
    big = {f"w{i}": random_tensor((512, 256), torch.float32, g) for i in range(8)}
    path = str(tmp_path / "big.safetensors")
    save_file(big, path)
    stats = {}
    got = tw.load(path, names=["w2", "w6"], stats=stats)
    assert_same(got, {n: big[n] for n in ["w2", "w6"]})
    assert stats["source_bytes"] <= stats["bytes"] + HEADER_PROBE  # the two tensors and one header read
    want = ["model.layers.3.w1", "model.norm.weight"]
    assert_same(tw.load(directory, names=want), {n: tensors[n] for n in want})
    pred = tw.load(directory, names=lambda n: n.startswith("model.layers.5."))
    assert_same(pred, {n: t for n, t in tensors.items() if n.startswith("model.layers.5.")})
    with pytest.raises(MissingKeyError, match="nope"):
        tw.load(directory, names=["nope"])


def test_dtype_cast_only_floats(tmp_path):
    t = {"w": torch.randn(4, 4, dtype=torch.float32), "ids": torch.arange(5),
         "q": torch.ones(3).to(torch.float8_e4m3fn)}
    path = str(tmp_path / "c.safetensors")
    save_file(t, path)
    got = tw.load(path, dtype=torch.bfloat16)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], t["w"].to(torch.bfloat16))
    assert got["ids"].dtype == torch.int64 and got["q"].dtype == torch.float8_e4m3fn
    with pytest.raises(InvalidInputError):
        tw.load(path, dtype=torch.int8)


def test_unaligned_offsets_still_load(tmp_path):
    # a writer that does not pad the header: the data region starts at an odd offset
    a, b = torch.arange(5, dtype=torch.float64), torch.tensor([1, 2, 3], dtype=torch.int16)
    text = json.dumps({"b": {"dtype": "I16", "shape": [3], "data_offsets": [0, 6]},
                       "a": {"dtype": "F64", "shape": [5], "data_offsets": [6, 46]}}).encode()
    if (8 + len(text)) % 2 == 0:
        text += b" "
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw(b) + raw(a))
    got = tw.load(str(path))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_load_into_fills_in_place(sharded):
    directory, _, tensors = sharded
    params = {n: torch.zeros_like(t) for n, t in tensors.items() if not n.endswith("w2")}
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    stats = {}
    filled = tw.load_into(params, directory, block_size=10_000, stats=stats)
    assert sorted(filled) == sorted(params)
    assert_same(params, {n: tensors[n] for n in params})
    assert {n: p.data_ptr() for n, p in params.items()} == ptrs
    expected = sum(tensors[n].numel() * tensors[n].element_size() for n in params)
    assert stats["bytes"] == stats["bytes_planned"] == expected


def test_load_into_casts_and_restrides(sharded):
    directory, _, tensors = sharded
    name = "model.layers.0.w0"
    f32 = torch.zeros(64, 48, dtype=torch.float32)
    backing = torch.zeros(48, 64, dtype=torch.bfloat16)
    transposed = backing.t()  # non-contiguous destination
    other = "model.layers.1.w0"
    tw.load_into({name: f32, other: transposed}, directory)
    assert torch.equal(f32, tensors[name].float())
    assert torch.equal(transposed, tensors[other])


def test_load_into_parameters_of_a_module(sharded):
    directory, _, tensors = sharded
    mod = torch.nn.Module()
    mod.w = torch.nn.Parameter(torch.zeros(64, 48, dtype=torch.bfloat16))
    tw.load_into({"model.layers.2.w2": mod.w}, directory)
    assert mod.w.requires_grad and torch.equal(mod.w.detach(), tensors["model.layers.2.w2"])


def test_load_into_missing_and_mismatch(sharded):
    directory, _, tensors = sharded
    params = {"model.layers.0.w0": torch.zeros(64, 48, dtype=torch.bfloat16), "extra.weight": torch.zeros(2)}
    with pytest.raises(MissingKeyError, match="extra.weight") as ei:
        tw.load_into(params, directory)
    assert isinstance(ei.value, (KeyError, TierstoreError))
    assert not params["model.layers.0.w0"].any()  # nothing was read before the check
    assert tw.load_into(params, directory, strict=False) == ["model.layers.0.w0"]
    assert not params["extra.weight"].any()
    with pytest.raises(InvalidInputError, match="model.layers.0.w0"):
        tw.load_into({"model.layers.0.w0": torch.zeros(48, 64, dtype=torch.bfloat16)}, directory)
    with pytest.raises(InvalidTypeError):
        tw.load_into({"model.layers.0.w0": [1, 2]}, directory)
    with pytest.raises(InvalidInputError):
        tw.load_into({}, directory, names=["x"])


def test_iter_tensors_streams_and_can_stop_early(sharded, monkeypatch):
    directory, _, tensors = sharded
    opened: list[LocalFileSource] = []  # also keeps every source alive: only close() releases its file
    real_init, real_read = LocalFileSource.__init__, LocalFileSource._read

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        opened.append(self)

    def slow_read(self, offset, bufs):
        time.sleep(0.05)  # reads are still in flight when the consumer stops
        real_read(self, offset, bufs)

    monkeypatch.setattr(LocalFileSource, "__init__", recording_init)
    monkeypatch.setattr(LocalFileSource, "_read", slow_read)
    it = tw.iter_tensors(directory, block_size=5000, memory_limit=50_000, concurrency=2)
    first = next(it)
    assert first[0] in tensors
    it.close()  # stopping early shuts the pipeline down cleanly: reader threads joined, shard files closed
    assert not [t for t in threading.enumerate() if t.name.startswith("tierstore-weights")]
    assert opened and all(s._fd < 0 for s in opened)  # closed
    monkeypatch.undo()
    seen = dict(tw.iter_tensors(directory, block_size=5000, memory_limit=1))
    assert_same(seen, tensors)


def test_bad_options(sharded):
    directory, _, _ = sharded
    with pytest.raises(InvalidInputError, match="unknown option"):
        tw.load(directory, chunk=3)
    with pytest.raises(TierstoreError):
        tw.load(directory, block_size="lots")
    with pytest.raises(InvalidInputError):
        tw.load(directory, concurrency=0)
    with pytest.raises(InvalidTypeError):
        tw.load(12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda(sharded):
    with pytest.raises(InvalidInputError, match="CUDA"):
        tw.load(sharded[0], device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paths(sharded):
    directory, _, tensors = sharded
    got = tw.load(directory, device="cuda", block_size=10_000, concurrency=4, memory_limit=30_000)
    assert all(t.is_cuda for t in got.values())
    assert_same({n: t.cpu() for n, t in got.items()}, tensors)
    params = {n: torch.zeros_like(t, device="cuda") for n, t in tensors.items()}
    params["model.norm.weight"] = torch.zeros(48, dtype=torch.float16, device="cuda")  # cast on device
    tw.load_into(params, directory, block_size=10_000)
    for n, p in params.items():
        assert torch.equal(p.cpu(), tensors[n].to(p.dtype)), n
