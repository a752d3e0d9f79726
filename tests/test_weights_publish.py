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


def largest_object(root: Path) -> Path:
    return max((root / "objects").iterdir(), key=lambda p: p.stat().st_size)


def alter_largest_object(root: Path, where: int = -1) -> Path:
    """Flip one data byte of the largest object under ``root/objects`` (its name no longer matches)."""
    victim = largest_object(root)
    data = bytearray(victim.read_bytes())
    data[where] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim


def test_a_published_object_with_one_changed_byte_fails_the_load(tmp_path):
    # probe 7.3: the name is the object's digest, so a changed byte is an error, never a wrong tensor
    t = model(5)
    write_checkpoint(str(tmp_path / "src"), t)
    tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    victim = alter_largest_object(tmp_path / "dst")
    in_victim = set(load_file(str(victim)))
    dst = str(tmp_path / "dst")
    for kwargs in ({}, {"block_size": 64 * 1024, "concurrency": 1}, {"block_size": 4096, "concurrency": 8}):
        with pytest.raises(CheckpointError, match="does not match its name"):
            tw.load(dst, **kwargs)
    with pytest.raises(CheckpointError, match="does not match its name"):
        tw.load_into({k: torch.empty_like(v) for k, v in t.items()}, dst)
    with pytest.raises(CheckpointError, match="does not match its name"):  # a subset reads its objects whole
        tw.load(dst, names=sorted(in_victim)[:1])
    others = sorted(set(t) - in_victim)
    stats = {}
    assert same(tw.load(dst, names=others, stats=stats), {k: t[k] for k in others})
    assert stats["digests_checked"] == len(os.listdir(tmp_path / "dst" / "objects")) - 1
    # the opt-out reads what the file holds
    assert not same(tw.load(dst, verify=False), t)
    with pytest.raises(tierstore.InvalidInputError, match="verify"):
        tw.load(dst, verify="yes")


def test_objects_published_under_blake2b_names_are_checked_too(tmp_path):
    # before BLAKE3 names, objects were named <blake2b-256 hex>.safetensors; those are still checked
    import hashlib

    t = model(9)
    write_checkpoint(str(tmp_path / "src"), t)
    r = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    objects = tmp_path / "dst" / "objects"
    assert all(p.name.startswith("blake3-") for p in objects.iterdir())
    index = json.loads(Path(r["index"]).read_text())
    renamed = {}
    for p in objects.iterdir():
        legacy = hashlib.blake2b(p.read_bytes(), digest_size=32).hexdigest() + ".safetensors"
        p.rename(objects / legacy)
        renamed[p.name] = legacy
    index["weight_map"] = {k: "objects/" + renamed[v.split("/")[-1]] for k, v in index["weight_map"].items()}
    Path(r["index"]).write_text(json.dumps(index))
    stats = {}
    assert same(tw.load(str(tmp_path / "dst"), stats=stats), t) and stats["digests_checked"] == len(renamed)
    alter_largest_object(tmp_path / "dst")
    with pytest.raises(CheckpointError, match="blake2b digest .* the name says"):
        tw.load(str(tmp_path / "dst"))


def test_a_changed_header_byte_fails_the_load_too(tmp_path):
    t = model(6)
    write_checkpoint(str(tmp_path / "src"), t)
    tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    victim = largest_object(tmp_path / "dst")
    data = victim.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n]
    assert b'"F16"' in header  # the largest object is an up_proj (float16): read it as int16 instead
    victim.write_bytes(data[:8] + header.replace(b'"F16"', b'"I16"', 1) + data[8 + n:])
    with pytest.raises(CheckpointError, match="does not match its name"):
        tw.load(str(tmp_path / "dst"))


def test_an_altered_copy_fails_through_a_store_and_never_serves_the_intact_one(tmp_path):
    # the same object names in two places, one object changed in one of them: the altered copy fails
    # every time (its cached ranges never pass as checked), and the intact one is served whole (probe 7.5)
    t = model(3)
    write_checkpoint(str(tmp_path / "src"), t)
    tw.publish(str(tmp_path / "src"), str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    alter_largest_object(tmp_path / "b")
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB"}]}) as store:
        for _ in range(2):
            with pytest.raises(CheckpointError, match="does not match its name"):
                tw.load(str(tmp_path / "b"), store=store)
        assert not same(tw.load(str(tmp_path / "b"), store=store, verify=False), t)
        stats = {}
        assert same(tw.load(str(tmp_path / "a"), store=store, stats=stats), t)
        assert stats["cache_hits"] == 0 and stats["digests_checked"] == len(os.listdir(tmp_path / "a" / "objects"))
        stats = {}  # a version that passed is not hashed again by this store
        assert same(tw.load(str(tmp_path / "a"), store=store, stats=stats), t)
        assert stats["cache_hits"] > 0 and stats["digests_checked"] == 0
        with pytest.raises(CheckpointError, match="does not match its name"):
            tw.load(str(tmp_path / "b"), store=store)


def test_a_checked_object_rewritten_in_place_with_its_old_mtime_is_checked_again(tmp_path):
    t = model(7)
    write_checkpoint(str(tmp_path / "src"), t)
    tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB"}]}) as store:
        assert same(tw.load(str(tmp_path / "dst"), store=store), t)
        victim = largest_object(tmp_path / "dst")
        st = victim.stat()
        with open(victim, "r+b") as f:  # same inode, same size, mtime set back: only ctime tells
            f.seek(st.st_size - 1)
            last = f.read(1)
            f.seek(st.st_size - 1)
            f.write(bytes([last[0] ^ 0xFF]))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(CheckpointError, match="does not match its name"):
            tw.load(str(tmp_path / "dst"), store=store, cache_writes=False)


def test_an_abandoned_load_of_a_published_checkpoint_does_not_hang(tmp_path):
    t = model(8)
    write_checkpoint(str(tmp_path / "src"), t)
    tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    for _ in range(5):
        it = tw.iter_tensors(str(tmp_path / "dst"), block_size=4096, concurrency=8, memory_limit=1 << 20)
        next(it)
        it.close()  # pieces waiting for their turn at the digest are released
    alter_largest_object(tmp_path / "dst", where=-4096 * 20)  # a byte well before the end
    with pytest.raises(CheckpointError, match="does not match its name"):
        tw.load(str(tmp_path / "dst"), block_size=4096, concurrency=8)


def test_publishing_again_repairs_an_object_changed_in_place_and_removes_stale_temp_files(tmp_path):
    t = model(4)
    write_checkpoint(str(tmp_path / "src"), t)
    first = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    objects = tmp_path / "dst" / "objects"
    alter_largest_object(tmp_path / "dst")
    with pytest.raises(CheckpointError, match="does not match its name"):
        tw.load(str(tmp_path / "dst"))
    stale, fresh = objects / ".publish-killed", objects / ".publish-running"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    again = tw.publish(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert again["objects_written"] == 1 and again["objects_reused"] == first["objects"] - 1
    assert again["stale_temp_removed"] == 1 and not stale.exists() and fresh.exists()
    assert same(tw.load(str(tmp_path / "dst")), t)


FORK_AFTER_HASHING = r"""
import os, sys
from tierstore.weights.digest import DigestCheck, object_name
data = os.urandom(64 << 20)  # large enough for BLAKE3 to hash on its thread pool
name = object_name([data])
pid = os.fork()
if pid == 0:
    again = object_name([data])  # the pool's threads are not in the child
    check = DigestCheck("x", "blake3:" + name[7:71], len(data), b"")
    check.feed(0, [memoryview(data)])
    check.final()
    os._exit(0 if again == name else 1)
print("child", os.waitpid(pid, 0)[1], flush=True)
"""


def test_hashing_works_in_a_child_forked_after_the_parent_hashed():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FORK_AFTER_HASHING], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["child", "0"], proc.stderr[-2000:]
