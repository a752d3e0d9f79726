"""TierstoreHiCacheStorage's engine-free half driven the way SGLang's HiCache controller drives it, on
host pools with SGLang's real shapes (``sglang_fakes``): every layout, MHA and MLA, TP ranks, two
instances sharing a prefix through a real S3 protocol (moto) or a shared directory."""

from __future__ import annotations

import os

import pytest
import torch
from sglang_fakes import MHA_LAYOUTS, MLA_LAYOUTS, PAGE, PROMPT, Instance, disk, kv_bytes, page_hashes


@pytest.mark.parametrize(("mla", "layout"), [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_fresh_instance_prefetches_what_another_backed_up_bit_exact(tmp_path, mla, layout):
    with Instance(disk(tmp_path / "kv"), mla=mla, layout=layout, seed=1) as a:
        slots = a.pool.alloc(10 * PAGE)
        assert a.ctl.backup(slots, PROMPT) == 10
        want = kv_bytes(a.pool, slots)
    with Instance(disk(tmp_path / "kv"), mla=mla, layout=layout) as b:  # a restarted engine, zeroed pool
        b.pool.alloc(3 * PAGE)  # busy with another request
        loaded, got_slots = b.ctl.prefetch(PROMPT)
        assert loaded == 10
        assert not torch.equal(got_slots, slots), "pages land wherever the new pool allocates them"
        assert torch.equal(kv_bytes(b.pool, got_slots), want)
        assert b.ctl.calls == [("batch_exists", 10), ("batch_get_v1", 10)]
        untouched = torch.tensor([i for i in range(b.pool.size) if i not in set(got_slots.tolist())])
        assert not kv_bytes(b.pool, untouched).any(), "only the loaded pages were written"


@pytest.mark.parametrize("mla", [False, True])
def test_instances_on_one_node_server_share_what_they_back_up(tmp_path, mla):
    """Issue 18: with a node server in the config, a second instance (every rank) prefetches the first's pages
    from the server's host tier."""
    from tierstore.serve.server import NodeServer

    node = {"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False}],
            "serve": {"socket": str(tmp_path / "run" / "ts.sock")}}
    with NodeServer(node).start() as server:
        config = {"config": {"server": f"unix://{server.config.socket}"}}
        layout = (MLA_LAYOUTS if mla else MHA_LAYOUTS)[0]
        with Instance(config, mla=mla, layout=layout, seed=1) as a:
            slots = a.pool.alloc(10 * PAGE)
            assert a.ctl.backup(slots, PROMPT) == 10
            want = kv_bytes(a.pool, slots)
        with Instance(config, mla=mla, layout=layout) as b:
            loaded, got_slots = b.ctl.prefetch(PROMPT)
            assert loaded == 10 and torch.equal(kv_bytes(b.pool, got_slots), want)
        assert server.store.stats()["tiers"]["host"]["objects"] >= 10


def test_controller_works_in_batches_of_128_pages(tmp_path):
    tokens = list(range(300 * 2 + 1))
    with Instance(disk(tmp_path / "kv"), seed=2, page=2, size=700) as a:
        slots = a.pool.alloc(300 * 2)
        assert a.ctl.backup(slots, tokens) == 300
        assert a.ctl.calls == [("batch_set_v1", 128), ("batch_set_v1", 128), ("batch_set_v1", 44)]
        want = kv_bytes(a.pool, slots)
    with Instance(disk(tmp_path / "kv"), page=2, size=700) as b:
        loaded, got = b.ctl.prefetch(tokens)
        assert loaded == 300 and torch.equal(kv_bytes(b.pool, got), want)
        assert b.ctl.calls == [("batch_exists", 128), ("batch_exists", 128), ("batch_exists", 44),
                               ("batch_get_v1", 128), ("batch_get_v1", 128), ("batch_get_v1", 44)]


def test_a_shared_prefix_hits_up_to_where_the_prompts_diverge(tmp_path):
    other = PROMPT[:3 * PAGE] + [7] * (7 * PAGE)  # same first 3 pages
    with Instance(disk(tmp_path / "kv"), seed=3) as a:
        a.ctl.backup(a.pool.alloc(10 * PAGE), PROMPT)
        assert a.backend.batch_exists(page_hashes(other, PAGE)) == 3
        first_differs = [9] * PAGE + PROMPT[PAGE:]
        assert a.backend.batch_exists(page_hashes(first_differs, PAGE)) == 0, "keys are chained over the prefix"
        loaded, _ = a.ctl.prefetch(other)
        assert loaded == 3
        counters = a.backend.store.stats()["counters"]  # the token hit rate per tier (tierstore_kv_* metrics)
        assert counters["kv_lookup_tokens"][""] == 3 * 10 * PAGE  # three exists queries of 10 pages
        assert counters["kv_hit_tokens"] == {"disk": (3 + 0 + 3) * PAGE}


def test_tp_ranks_keep_their_own_heads(tmp_path):
    shared = {"kind": "remote", "url": f"file://{tmp_path / 'shared'}"}
    extra = {"config": {"tiers": [{"kind": "disk", "path": str(tmp_path / "a"), "capacity": "64MiB"}, shared]}}
    ranks = [Instance(extra, seed=10 + r, tp_rank=r, tp_size=2) for r in range(2)]
    try:
        want = []
        for r in ranks:
            slots = r.pool.alloc(10 * PAGE)
            r.ctl.backup(slots, PROMPT)
            want.append(kv_bytes(r.pool, slots))
        assert sorted(os.listdir(tmp_path / "a")) == ["tp0of2-pp0of1", "tp1of2-pp0of1"]
    finally:
        for r in ranks:
            r.backend.close()
    assert not torch.equal(want[0], want[1])
    remote_only = {"config": {"tiers": [shared]}}
    for r in range(2):  # a fresh node: only the shared tier, which holds both ranks' pages
        with Instance(remote_only, tp_rank=r, tp_size=2) as b:
            loaded, got = b.ctl.prefetch(PROMPT)
            assert loaded == 10 and torch.equal(kv_bytes(b.pool, got), want[r])
    with Instance(remote_only, tp_rank=0, tp_size=4) as other_tp:
        assert other_tp.ctl.prefetch(PROMPT)[0] == 0, "another TP size has other heads per rank: no hit"


def test_mla_ranks_share_one_copy(tmp_path):
    extra = disk(tmp_path / "kv")
    writer = Instance(extra, mla=True, seed=5, tp_rank=0, tp_size=2)
    reader = Instance(extra, mla=True, tp_rank=1, tp_size=2)  # runs beside the writer
    try:
        slots = writer.pool.alloc(10 * PAGE)
        assert writer.ctl.backup(slots, PROMPT) == 10
        assert reader.ctl.backup(reader.pool.alloc(10 * PAGE), PROMPT) == 0, "SGLang skips non-writer backups"
        assert reader.ctl.calls == []
        loaded, got = reader.ctl.prefetch(PROMPT)
        assert loaded == 10 and torch.equal(kv_bytes(reader.pool, got), kv_bytes(writer.pool, slots))
        assert [n for n in os.listdir(tmp_path / "kv") if not n.startswith(".")] == ["mla-pp0of1"]  # + the note
        assert reader.backend.store.stats()["tiers"]["disk"]["read_only"]
    finally:
        reader.backend.close()
        writer.backend.close()


def test_two_instances_share_a_prefix_through_s3(tmp_path, monkeypatch, s3_server, s3_bucket):
    def node(name: str, **more) -> Instance:  # the default config (disk under ~) plus the shared bucket
        monkeypatch.setenv("HOME", str(tmp_path / name))
        return Instance({"remote": f"s3://{s3_bucket}/kv", "storage_options": s3_server.storage_options, **more},
                        seed=6 if name == "a" else None)

    with node("a") as a:
        slots = a.pool.alloc(10 * PAGE)
        a.ctl.backup(slots, PROMPT)
        want = kv_bytes(a.pool, slots)
        assert (tmp_path / "a/.cache/tierstore/sglang/disk/tp0of1-pp0of1").is_dir()
    assert len(s3_server.filesystem().find(f"{s3_bucket}/kv")) == 10, "close() flushed write-back to S3"
    with node("b") as b:
        loaded, got = b.ctl.prefetch(PROMPT)
        assert loaded == 10 and torch.equal(kv_bytes(b.pool, got), want)
        keys = b.backend.chunk_keys(page_hashes(PROMPT, PAGE))
        b.backend.store.flush()  # promotion is a background job; a flush waits for it
        assert {b.backend.store.where(k) for k in keys} == {"disk"}, "retain: hits are promoted to local disk"
    with node("c", model_id="other/model") as c:
        assert c.ctl.prefetch(PROMPT)[0] == 0, "another model never reads these pages"
    with node("d", tenant="t1") as d:
        assert d.ctl.prefetch(PROMPT)[0] == 0, "another tenant never reads these pages"
