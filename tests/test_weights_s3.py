"""tierstore.weights against a real S3 protocol server (moto) behind a counting proxy, with the store.

Remote reads are counted on the wire: every request passes through tierstore.bench.s3shim, which counts
object GETs per path; nothing is mocked.
"""

from __future__ import annotations

import pytest
import torch

import tierstore
import tierstore.weights as tw
from tierstore.weights import CheckpointError
from tierstore.weights.synth import random_tensor, write_checkpoint


@pytest.fixture
def remote(s3_server, s3_bucket, shim, tmp_path):
    """A 3-shard checkpoint uploaded to s3://bucket/ck/ ; returns (url, storage_options, reference)."""
    g = torch.Generator().manual_seed(5)
    tensors = {f"model.layers.{i}.{w}": random_tensor((96, 64), dt, g)
               for i in range(4) for w, dt in [("q", torch.bfloat16), ("k", torch.float32), ("n", torch.float16)]}
    tensors["model.embed.weight"] = random_tensor((300, 64), torch.bfloat16, g)
    local = tmp_path / "ck"
    write_checkpoint(str(local), tensors, shard_size=60_000)
    s3_server.filesystem().put(str(local) + "/", f"{s3_bucket}/ck/", recursive=True)
    opts = shim.storage_options(s3_server.storage_options)
    return f"s3://{s3_bucket}/ck", opts, tensors


def assert_same(got, ref):
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)), k


def s3fs_of(opts):
    import s3fs
    return s3fs.S3FileSystem(**opts)


def data_gets(shim) -> int:
    return sum(shim.stats()["gets"].values())


def open_store(path):
    return tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB"},
                                     {"kind": "disk", "path": str(path), "capacity": "256MiB"}]})


def test_s3_prefix_index_and_single_file(remote, shim):
    url, opts, tensors = remote
    shim.reset()
    assert_same(tw.load(url + "/", storage_options=opts, block_size=20_000), tensors)
    assert data_gets(shim) > 3  # index + headers + ranged data reads
    assert_same(tw.load(url + "/model.safetensors.index.json", storage_options=opts), tensors)
    first = "s3://" + sorted(f for f in s3fs_of(opts).ls(url) if f.endswith(".safetensors"))[0]
    one = tw.load(first, storage_options=opts)
    assert set(one) < set(tensors) and all(torch.equal(one[k], tensors[k]) for k in one)
    params = {k: torch.zeros_like(v) for k, v in tensors.items()}
    tw.load_into(params, url, storage_options=opts, block_size=20_000)
    assert_same(params, tensors)


def test_second_load_through_store_makes_no_remote_reads(remote, shim, tmp_path):
    url, opts, tensors = remote
    with open_store(tmp_path / "cache") as store:
        shim.reset()
        stats = {}
        assert_same(tw.load(url, storage_options=opts, store=store, block_size=30_000, stats=stats), tensors)
        first = data_gets(shim)
        assert first > 0 and stats["cache_misses"] > 0 and stats["source_reads"] > 0
        store.flush()
        shim.reset()
        stats = {}
        assert_same(tw.load(url, storage_options=opts, store=store, block_size=30_000, stats=stats), tensors)
        assert data_gets(shim) == 0, shim.stats()["gets"]
        assert stats["source_reads"] == 0 and stats["cache_misses"] == 0 and stats["cache_hits"] > 0
        # a subset and load_into reuse the same ranges
        sub = tw.load(url, storage_options=opts, store=store, block_size=30_000, names=["model.layers.2.k"])
        params = {k: torch.zeros_like(v) for k, v in tensors.items()}
        tw.load_into(params, url, storage_options=opts, store=store, block_size=30_000)
        assert_same(params, tensors) and torch.equal(sub["model.layers.2.k"], tensors["model.layers.2.k"])
        assert data_gets(shim) == 0
    with open_store(tmp_path / "cache") as store:  # after a restart: served by the disk tier
        shim.reset()
        assert_same(tw.load(url, storage_options=opts, store=store, block_size=30_000), tensors)
        assert data_gets(shim) == 0
        assert store.stats()["tiers"]["disk"]["hits"] > 0


def test_changed_object_is_never_served_stale(remote, shim, s3_server, tmp_path):
    url, opts, tensors = remote
    with open_store(tmp_path / "cache") as store:
        tw.load(url, storage_options=opts, store=store)
        store.flush()
        changed = {k: (v + 1 if v.dtype.is_floating_point else v) for k, v in tensors.items()}
        write_checkpoint(str(tmp_path / "new"), changed, shard_size=60_000)
        s3_server.filesystem().put(str(tmp_path / "new") + "/", url[len("s3://"):] + "/", recursive=True)
        shim.reset()
        assert_same(tw.load(url, storage_options=opts, store=store), changed)
        assert data_gets(shim) > 0


def test_broken_store_degrades_to_the_source(remote, tmp_path):
    url, opts, tensors = remote
    store = open_store(tmp_path / "cache")
    store.close()  # every get/put now raises ClosedError
    stats = {}
    assert_same(tw.load(url, storage_options=opts, store=store, stats=stats), tensors)
    assert stats["cache_errors"] > 0 and stats["source_reads"] > 0


def test_publish_to_s3_shares_objects_between_fine_tunes(remote, shim, s3_bucket, tmp_path):
    url, opts, tensors = remote
    objects = f"s3://{s3_bucket}/objects"
    r1 = tw.publish(url, f"s3://{s3_bucket}/pub/base", storage_options=opts, dst_storage_options=opts,
                    objects_url=objects)
    tuned = dict(tensors)
    tuned["model.layers.3.q"] = tensors["model.layers.3.q"] * 2
    write_checkpoint(str(tmp_path / "ft"), tuned, shard_size=60_000)
    r2 = tw.publish(str(tmp_path / "ft"), f"s3://{s3_bucket}/pub/ft", dst_storage_options=opts,
                    objects_url=objects)
    assert r1["objects_written"] == r1["objects"] and r2["objects_reused"] == r2["objects"] - 1
    assert r2["objects_written"] == 1
    assert_same(tw.load(f"s3://{s3_bucket}/pub/base", storage_options=opts, objects_url=objects), tensors)
    with open_store(tmp_path / "cache") as store:
        assert_same(tw.load(f"s3://{s3_bucket}/pub/base/", storage_options=opts, store=store,
                            objects_url=objects), tensors)
        store.flush()
        shim.reset()
        assert_same(tw.load(f"s3://{s3_bucket}/pub/ft/", storage_options=opts, store=store,
                            objects_url=objects), tuned)
        gets = shim.stats()["gets"]
        # only the new index and the one changed object come from S3; shared objects hit the store
        assert len(gets) == 2 and any(p.endswith("model.safetensors.index.json") for p in gets), gets


@pytest.mark.parametrize("cached", [False, True])
def test_object_replaced_during_a_load_is_detected(remote, tmp_path, cached):
    url, opts, tensors = remote
    fs = s3fs_of(opts)
    shard = sorted(p for p in fs.ls(url[len("s3://"):]) if p.endswith(".safetensors"))[0]
    store = open_store(tmp_path / "cache") if cached else None
    try:
        it = tw.iter_tensors(f"s3://{shard}", storage_options=opts, store=store, block_size=4096,
                             concurrency=1, memory_limit=1)
        next(it)
        data = bytearray(fs.cat_file(shard))
        data[-64:] = bytes(64) if any(data[-64:]) else b"\x01" * 64  # same size, other bytes
        fs.pipe_file(shard, bytes(data))
        with pytest.raises(CheckpointError, match="replaced while being loaded"):
            list(it)
        if store is not None:  # nothing of the new version was cached under the old one's identity
            fresh = tw.load(f"s3://{shard}", storage_options=opts, store=store)
            direct = tw.load(f"s3://{shard}", storage_options=opts)
            assert_same(fresh, direct)
    finally:
        if store is not None:
            store.close()


def test_a_published_object_changed_on_s3_fails_the_load(remote, s3_bucket, tmp_path):
    url, opts, tensors = remote
    pub = f"s3://{s3_bucket}/pub/checked"
    tw.publish(url, pub, storage_options=opts, dst_storage_options=opts)
    fs = s3fs_of(opts)
    victim = max((p for p in fs.ls(f"{s3_bucket}/pub/checked/objects")), key=lambda p: fs.info(p)["size"])
    data = bytearray(fs.cat_file(victim))
    data[-1] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    with open_store(tmp_path / "cache") as store:
        for s in (None, store, store):
            with pytest.raises(CheckpointError, match="does not match its name"):
                tw.load(pub, storage_options=opts, store=s)
        tw.publish(url, pub, storage_options=opts, dst_storage_options=opts)  # repairs it
        stats = {}
        assert_same(tw.load(pub, storage_options=opts, store=store, stats=stats), tensors)
        assert stats["digests_checked"] == len(fs.ls(f"{s3_bucket}/pub/checked/objects"))
