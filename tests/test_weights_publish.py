"""tierstore.weights.publish: content-addressed layout, identical tensor groups stored once, bit-exact."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tierstore
import tierstore.weights as tw
from tierstore.weights import CheckpointError
from tierstore.weights.publish import object_group
from tierstore.weights.synth import random_tensor, write_checkpoint


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": random_tensor((1024, 300), torch.bfloat16, g)}
    for i in range(3):
        t[f"model.layers.{i}.mlp.up_proj.weight"] = random_tensor((600, 1024), torch.float16, g)
        t[f"model.layers.{i}.input_layernorm.weight"] = random_tensor((300,), torch.float32, g)
        t[f"model.layers.{i}.self_attn.q_proj.bias"] = random_tensor((300,), torch.bfloat16, g)
    t["model.norm.weight"] = random_tensor((300,), torch.float32, g)
    return t


def same(a, b):
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)


def test_object_groups():
    assert object_group("model.layers.7.input_layernorm.weight", 10) == "small:model.layers.7"
    assert object_group("model.norm.weight", 10) == "small:model.norm"
    assert object_group("model.layers.7.mlp.up_proj.weight", 1 << 21) == "model.layers.7.mlp.up_proj.weight"


def test_publish_roundtrip_and_sharing(tmp_path):
    base = model()
    write_checkpoint(str(tmp_path / "base"), base, shard_size=1 << 20)
    tuned = dict(base)
    tuned["model.layers.1.mlp.up_proj.weight"] = base["model.layers.1.mlp.up_proj.weight"] + 1
    tuned["model.layers.2.input_layernorm.weight"] = base["model.layers.2.input_layernorm.weight"] * 3
    write_checkpoint(str(tmp_path / "tuned"), tuned, shard_size=1 << 20)

    objs = str(tmp_path / "objects")
    r1 = tw.publish(str(tmp_path / "base"), str(tmp_path / "pub" / "base"), objects_url=objs, block_size="256KiB")
    r2 = tw.publish(str(tmp_path / "tuned"), str(tmp_path / "pub" / "tuned"), objects_url=objs)
    # 4 large tensors + 4 small-tensor groups (three layers and the final norm)
    assert r1["objects"] == r1["objects_written"] == 8 and r1["tensors"] == len(base)
    assert r2["objects_written"] == 2 and r2["objects_reused"] == 6
    assert len(os.listdir(objs)) == 10
    for f in os.listdir(objs):  # every object is a plain safetensors file named by its digest
        load_file(os.path.join(objs, f))
    index = json.loads(Path(r2["index"]).read_text())
    assert index["metadata"]["format"] == "tierstore-cas/1"
    with pytest.raises(CheckpointError, match="outside the checkpoint"):  # shared objects must be allowed
        tw.load(str(tmp_path / "pub" / "base"))
    assert same(tw.load(str(tmp_path / "pub" / "base"), objects_url=objs), base)
    assert same(tw.load(str(tmp_path / "pub" / "tuned"), objects_url=[objs]), tuned)

    # a published checkpoint is itself a source: its shards are found under src_objects_url
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        tw.publish(str(tmp_path / "pub" / "tuned"), str(tmp_path / "again"))
    r3 = tw.publish(str(tmp_path / "pub" / "tuned"), str(tmp_path / "again"), src_objects_url=objs)
    assert r3["tensors"] == len(tuned) and r3["objects_written"] == 8
    assert same(tw.load(str(tmp_path / "again")), tuned)

    # objects shared by the two checkpoints share range-cache chunks too
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB"}]}) as store:
        tw.load(str(tmp_path / "pub" / "base"), store=store, objects_url=objs)
        stats = {}
        assert same(tw.load(str(tmp_path / "pub" / "tuned"), store=store, stats=stats, objects_url=objs), tuned)
        assert stats["cache_hits"] > 0 and 0 < stats["cache_misses"] < stats["cache_hits"]


def test_publish_default_objects_dir_dedupes_within(tmp_path):
    t = model(1)
    write_checkpoint(str(tmp_path / "src"), t)
    r = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert os.path.isdir(tmp_path / "dst" / "objects") and r["objects_written"] == r["objects"]
    again = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert again["objects_written"] == 0 and again["bytes_written"] == 0
    assert same(tw.load(str(tmp_path / "dst")), t)


def test_an_altered_copy_of_a_published_checkpoint_never_serves_the_intact_one(tmp_path):
    # the same object names in two places, one object changed in one of them: the range cache must key the
    # bytes by the file they came from, not by the object's name (probe 7.5)
    t = model(3)
    write_checkpoint(str(tmp_path / "src"), t)
    tw.publish(str(tmp_path / "src"), str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    victim = max((tmp_path / "b" / "objects").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor's data
    victim.write_bytes(bytes(data))
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB"}]}) as store:
        altered = tw.load(str(tmp_path / "b"), store=store)
        assert not same(altered, t)  # (what the altered copy holds, as the file says)
        stats = {}
        assert same(tw.load(str(tmp_path / "a"), store=store, stats=stats), t)
        assert stats["cache_hits"] == 0  # other files, other cache keys
        assert same(tw.load(str(tmp_path / "a"), store=store, stats=stats), t) and stats["cache_hits"] > 0


def test_publishing_again_repairs_an_object_changed_in_place_and_removes_stale_temp_files(tmp_path):
    t = model(4)
    write_checkpoint(str(tmp_path / "src"), t)
    first = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    objects = tmp_path / "dst" / "objects"
    victim = max(objects.iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert not same(tw.load(str(tmp_path / "dst")), t)
    stale, fresh = objects / ".publish-killed", objects / ".publish-running"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    again = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert again["objects_written"] == 1 and again["objects_reused"] == first["objects"] - 1
    assert again["stale_temp_removed"] == 1 and not stale.exists() and fresh.exists()
    assert same(tw.load(str(tmp_path / "dst")), t)
