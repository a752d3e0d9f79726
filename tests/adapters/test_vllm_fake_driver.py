"""TierstoreConnector's scheduler and worker halves driven like vLLM drives them, without vLLM: the
parts the CPU engine cannot show (TP = 2 ranks, FlashAttention layout, slow remote lookups, races)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from tierstore_vllm.layouts import paged_view
from tierstore_vllm.options import ConnectorOptions
from tierstore_vllm.worker import WorkerSide
from vllm_fakes import (
    BLOCK,
    CHUNK,
    DIM,
    HEADS,
    LAYER_NAMES,
    CachedRequestData,
    Engine,
    NewRequestData,
    Request,
    SchedulerOutput,
)

from tierstore.errors import ConfigError
from tierstore.kv import PagedLayout, gather
from tierstore.kv.rows import PagedTransfer

PROMPT = list(range(100, 180))  # 80 tokens: two full 32-token chunks may hit (never the whole prompt)
HIT = 64
A_BLOCKS = [3, 7, 1, 9, 12]
B_BLOCKS = [20, 21, 22, 23, 24]


def tiers(root, name="node-a", pool: bool = False) -> list[dict]:
    """A small host tier (no pool unless ``pool``: a pooled one saves in place) over a disk tier."""
    return [{"kind": "host", "capacity": "16MiB", "pool": pool},
            {"kind": "disk", "path": str(root / name), "capacity": "64MiB"}]


def kv_of(engine: Engine, rank: int, blocks: list[int], end: int = HIT) -> list[torch.Tensor]:
    return [gather(engine.caches[rank][n], PagedLayout.VLLM, blocks, 0, end) for n in LAYER_NAMES]


@pytest.fixture
def saved(tmp_path):
    """Engine A (TP=2, random caches) served PROMPT and shut down; returns A's KV per rank."""
    a = Engine(tmp_path, tiers(tmp_path), caches_seed=1)
    try:
        assert a.serve(Request("a", PROMPT), A_BLOCKS) == 0
        return [kv_of(a, r, A_BLOCKS) for r in range(2)]
    finally:
        a.close()


def test_fresh_engine_loads_every_rank_bit_exact(tmp_path, saved):
    assert not torch.equal(saved[0][0], saved[1][0]), "ranks hold different heads"
    b = Engine(tmp_path, tiers(tmp_path))
    try:
        assert b.serve(Request("b", PROMPT), B_BLOCKS) == HIT
        for rank in range(2):
            for got, want in zip(kv_of(b, rank, B_BLOCKS), saved[rank], strict=True):
                assert torch.equal(got, want)
            untouched = gather(b.caches[rank][LAYER_NAMES[0]], PagedLayout.VLLM, B_BLOCKS, HIT, len(PROMPT))
            assert not untouched.any(), "only the hit's tokens are written"
        assert b.workers[0].counters["loaded_tokens"] == HIT
        for rank in range(2):  # the ranks of one engine never share a disk directory
            assert list((tmp_path / "node-a" / f"tp{rank}-pp0").rglob("*.tso"))
    finally:
        b.close()


def test_each_layer_wait_returns_once_that_layer_is_in_the_cache(tmp_path, saved, monkeypatch):
    """wait_for_layer_load(layer i) waits for the load's future of layer i (the last layer's write is
    delayed here), and the load writes layers in order."""
    last = len(LAYER_NAMES) - 1
    scattered, seen = [], []
    scatter, wait = PagedTransfer.scatter, WorkerSide.wait_for_layer

    def slow_scatter(self, layer, pieces, staged):
        if layer == last:
            time.sleep(0.2)
        scatter(self, layer, pieces, staged)
        scattered.append(layer)

    def observed(self, name):
        wait(self, name)
        seen.append((LAYER_NAMES.index(name), list(scattered)))

    monkeypatch.setattr(PagedTransfer, "scatter", slow_scatter)
    monkeypatch.setattr(WorkerSide, "wait_for_layer", observed)
    b = Engine(tmp_path, tiers(tmp_path))
    try:
        assert b.serve(Request("b", PROMPT), B_BLOCKS) == HIT
        assert len(seen) == 2 * len(LAYER_NAMES)  # two ranks
        for layer, written in seen:
            assert layer in written, f"the wait for layer {layer} returned before it was written"
        assert scattered[:len(LAYER_NAMES)] == list(range(len(LAYER_NAMES))), "layers are written in order"
        for rank in range(2):
            assert all(torch.equal(g, w) for g, w in zip(kv_of(b, rank, B_BLOCKS), saved[rank], strict=True))
    finally:
        b.close()


def test_hit_is_what_every_rank_holds(tmp_path, saved):
    b = Engine(tmp_path, tiers(tmp_path))
    try:
        rank1 = b.workers[1]
        second = rank1.kv(None).keys(PROMPT)[1]
        rank1.store.delete(second)
        assert b.matched(Request("b", PROMPT)) == CHUNK
    finally:
        b.close()


def test_slow_lookup_asks_again_without_side_effects(tmp_path, saved, monkeypatch):
    answer = WorkerSide.answer

    def slow(self, request):
        time.sleep(0.3)
        return answer(self, request)

    monkeypatch.setattr(WorkerSide, "answer", slow)
    b = Engine(tmp_path, tiers(tmp_path), lookup_timeout_s=0.01)
    try:
        req = Request("b", PROMPT)
        assert b.scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
        assert b.scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
        assert b.matched(req) == HIT
        assert b.matched(req) == HIT
        assert b.matched(req, num_computed=CHUNK) == HIT - CHUNK
        assert b.scheduler.counters["lookups"] == 1, "asking again reuses the one lookup in flight"
    finally:
        b.close()


def test_chunk_vanished_before_load_is_reported_as_failed_blocks(tmp_path, saved):
    b = Engine(tmp_path, tiers(tmp_path))
    try:
        req = Request("b", PROMPT)
        assert b.matched(req) == HIT
        b.scheduler.update_state_after_alloc(req, B_BLOCKS, HIT)
        rank0 = b.workers[0]
        second = rank0.kv(None).keys(PROMPT)[1]
        rank0.store.delete(second)
        b.step(SchedulerOutput([NewRequestData("b", PROMPT, (B_BLOCKS,), HIT)], num_scheduled_tokens={"b": 16}))
        assert rank0.take_failed_blocks() == set(B_BLOCKS[CHUNK // BLOCK:HIT // BLOCK])
        assert b.workers[1].take_failed_blocks() == set()
        assert torch.equal(kv_of(b, 0, B_BLOCKS, CHUNK)[0], saved[0][0][:, :CHUNK]), "the first chunk still loads"
    finally:
        b.close()


def test_remote_only_chunks_are_promoted_before_they_count(tmp_path):
    shared = {"kind": "remote", "url": f"file://{tmp_path / 'shared'}"}
    a = Engine(tmp_path, [*tiers(tmp_path, "node-a"), shared], engine_id="a", caches_seed=1)
    a.serve(Request("a", PROMPT), A_BLOCKS)
    want = kv_of(a, 1, A_BLOCKS)
    a.close()  # flushes the write-back to the shared tier
    b = Engine(tmp_path, [*tiers(tmp_path, "node-b"), shared], engine_id="b", lookup_timeout_s=0.5)
    try:
        req = Request("b", PROMPT)
        first, _ = b.scheduler.get_num_new_matched_tokens(req, 0)
        assert first is None, "chunks only on the remote tier are promoted first: ask again"
        assert b.matched(req) == HIT
        assert all(w.store.where(k) != "remote" for w in b.workers for k in w.kv(None).keys(PROMPT[:HIT]))
        b.scheduler.update_state_after_alloc(req, B_BLOCKS, HIT)
        b.step(SchedulerOutput([NewRequestData("b", PROMPT, (B_BLOCKS,), HIT)], num_scheduled_tokens={"b": 16}))
        for got, exp in zip(kv_of(b, 1, B_BLOCKS), want, strict=True):
            assert torch.equal(got, exp)
    finally:
        b.close()


def test_tenants_never_share(tmp_path):
    e = Engine(tmp_path, tiers(tmp_path), caches_seed=1)
    try:
        e.serve(Request("alice-1", PROMPT, cache_salt="alice"), A_BLOCKS)
        assert e.matched(Request("bob", PROMPT, cache_salt="bob")) == 0
        assert e.matched(Request("anyone", PROMPT)) == 0
        assert e.matched(Request("alice-2", PROMPT, cache_salt="alice")) == HIT
    finally:
        e.close()


def test_chunked_prefill_saves_once_the_prompt_is_complete(tmp_path):
    e = Engine(tmp_path, tiers(tmp_path), caches_seed=1)
    try:
        req = Request("r", PROMPT)
        assert e.matched(req) == 0
        first = SchedulerOutput([NewRequestData("r", PROMPT, (A_BLOCKS[:3],), 0)], num_scheduled_tokens={"r": 48})
        assert e.scheduler.build_plan(first).saves == []
        second = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r"], set(), [(A_BLOCKS[3:],)], [48]),
                                 num_scheduled_tokens={"r": 32})
        plan = e.scheduler.build_plan(second)
        assert [(s.req_id, len(s.token_ids), s.block_ids) for s in plan.saves] == [("r", HIT, A_BLOCKS[:4])]
        assert e.scheduler.build_plan(SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["r"], set(), [None], [80]),
            num_scheduled_tokens={"r": 1})).saves == [], "a prompt is saved once"
    finally:
        e.close()


@pytest.mark.parametrize("pool", [False, True], ids=["copies", "in-place"])
def test_decoded_tokens_are_saved_by_chunk_from_where_the_prompt_left_off(tmp_path, pool):
    """A multi-round chat's next prompt holds this round's answer: each chunk the decoded tokens fill is saved
    (only the new part copied out of the paged cache), and another engine hits prompt and answer alike; the same
    through copies put in the background and saved in place into a host pool."""
    a = Engine(tmp_path, tiers(tmp_path, pool=pool), caches_seed=1)
    blocks = [*A_BLOCKS, 30, 31]  # 7 blocks of 16: 112 tokens
    req = Request("r", PROMPT)
    try:
        assert a.serve(req, blocks[:5]) == 0  # the prompt (80 tokens): its two full chunks are saved
        saves = []
        for computed in range(len(PROMPT), 112):  # decode one token a step; a new block at 80 and at 96
            req.output_token_ids.append(500 + computed)
            new = (blocks[computed // BLOCK:computed // BLOCK + 1],) if computed % BLOCK == 0 else None
            plan = a.step(SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r"], set(), [new], [computed]),
                                          num_scheduled_tokens={"r": 1}))
            saves += [(computed + 1, s.start, len(s.token_ids), s.block_ids) for s in plan.saves]
        assert saves == [(96, 64, 96, blocks[:6])], "once, when the third chunk is full, from the second's end"
        assert a.workers[0].counters["saved_tokens"] == 96
        conversation = req.all_token_ids[:96]
        want = [kv_of(a, rank, blocks, 96) for rank in range(2)]
    finally:
        a.close()
    b = Engine(tmp_path, tiers(tmp_path))
    try:
        nxt = Request("next", [*conversation, 7, 8, 9])  # the next round: this answer and a new question
        assert b.serve(nxt, B_BLOCKS + [25, 26]) == 96
        for rank in range(2):
            got = kv_of(b, rank, B_BLOCKS + [25, 26], 96)
            assert all(torch.equal(g, w) for g, w in zip(got, want[rank], strict=True))
    finally:
        b.close()


def test_each_save_notes_its_blocks_by_vllms_own_hashes_for_kv_events(tmp_path):
    """With KV events on, every save (prompt chunks, then chunks of decoded tokens) is noted once with the
    request's block hashes, the hash of the block before and the tokens: what vLLM publishes to routers."""
    a = Engine(tmp_path, tiers(tmp_path))
    a.scheduler.events = True
    blocks = [*A_BLOCKS, 30, 31]
    req = Request("r", PROMPT)
    try:
        a.serve(req, blocks[:5])  # the prompt's two full chunks: blocks 0-3
        for computed in range(len(PROMPT), 112):  # decoding fills the third chunk (blocks 4-5) at 96
            req.output_token_ids.append(500 + computed)
            new = (blocks[computed // BLOCK:computed // BLOCK + 1],) if computed % BLOCK == 0 else None
            a.step(SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r"], set(), [new], [computed]),
                                   num_scheduled_tokens={"r": 1}))
        hashes, tokens = req.block_hashes, req.all_token_ids
        stored = a.scheduler.take_stored()
        assert [(s.block_hashes, s.parent, s.token_ids) for s in stored] == [
            (hashes[0:4], None, tokens[0:64]), (hashes[4:6], hashes[3], tokens[64:96])]
        assert a.scheduler.take_stored() == []
        salted = Request("s", [t + 1 for t in PROMPT], cache_salt="tenant-a")
        a.serve(salted, blocks[:5])
        assert a.workers[0].counters["saved_tokens"] == 96 + 64 and a.scheduler.take_stored() == []
        a.scheduler.events = False
        a.serve(Request("q", [t + 2 for t in PROMPT]), blocks[:5])
        assert a.scheduler.take_stored() == []
    finally:
        a.close()


def test_concurrent_lookups_and_steps(tmp_path, saved):
    """Lookups answered on the server threads while steps load and save on the main thread."""
    sys.setswitchinterval(1e-6)
    b = Engine(tmp_path, tiers(tmp_path))
    errors: list[BaseException] = []
    stop = threading.Event()

    def lookups(i: int) -> None:
        try:
            while not stop.is_set():
                replies = b.client.ask({"tokens": PROMPT[:HIT], "tenant": None}) if i == 0 else \
                    [w.answer({"tokens": PROMPT[:HIT], "tenant": None}) for w in b.workers]
                assert all(r["ready"] == HIT for r in replies)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lookups, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for i in range(5):
            blocks = [30 + 5 * i + j for j in range(5)]
            assert b.serve(Request(f"b{i}", PROMPT), blocks) == HIT
            assert torch.equal(kv_of(b, 0, blocks)[1], saved[0][1])
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        sys.setswitchinterval(0.005)
        b.close()
    assert not errors


def test_cpu_backend_layout_is_read_as_the_backend_reads_it():
    """vLLM's CPU cache (blocks, heads, block_size, 2*dim) holds per block and head all K, then all V."""
    blocks = 4
    raw = torch.randn(blocks, HEADS, BLOCK, 2 * DIM).to(torch.bfloat16)
    view, layout = paged_view(raw, BLOCK, HEADS, DIM)
    k, v = raw.view(blocks, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)  # what the CPU attention backend does
    kv = gather(view, layout, [2, 0], 0, 2 * BLOCK)
    assert torch.equal(kv[0, :BLOCK], k[2].transpose(0, 1)) and torch.equal(kv[1, BLOCK:], v[0].transpose(0, 1))
    assert paged_view(torch.zeros(4, 2, BLOCK, HEADS, DIM), BLOCK, HEADS, DIM)[1] is PagedLayout.FLASHINFER
    with pytest.raises(ValueError):
        paged_view(torch.zeros(4, BLOCK, 576), BLOCK, HEADS, DIM)


def test_queued_saves_are_bounded_by_bytes_not_by_count(tmp_path, monkeypatch):
    # review #5: a count of 64 queued saves is ~64 GiB at 8k-token prompts of an 8B model; the copies a
    # worker holds for queued writes are bounded by save_memory bytes instead
    import tierstore_vllm.worker as worker_mod

    gate = threading.Event()
    real = worker_mod.save_prefix
    monkeypatch.setattr(worker_mod, "save_prefix", lambda kv, spec, layers: (gate.wait(30), real(kv, spec, layers))[1])
    probe = Engine(tmp_path, tiers(tmp_path, "probe"), tp=1, engine_id="probe", caches_seed=1)
    one_save = sum(t.numel() * t.element_size() for t in kv_of(probe, 0, A_BLOCKS))
    probe.close()
    e = Engine(tmp_path, tiers(tmp_path), tp=1, caches_seed=1, save_memory=one_save * 3 // 2)
    (w,) = e.workers

    def prefill(rid: str, prompt: list[int]) -> None:  # one step, the saver left to run in the background
        plan = e.step(SchedulerOutput([NewRequestData(rid, prompt, (A_BLOCKS,), 0)],
                                      num_scheduled_tokens={rid: len(prompt)}), drain=False)
        assert len(plan.saves) == 1

    try:
        for i in range(3):
            prefill(f"r{i}", [i * 1000 + t for t in PROMPT])
        assert w.counters["saves_dropped"] == 2  # the first is queued; the next two would go over the budget
        gate.set()
        w.drain(timeout=30)
        assert w.counters["saved_tokens"] == HIT
        prefill("r3", [3000 + t for t in PROMPT])  # room again
        w.drain(timeout=30)
        assert w.counters["saves_dropped"] == 2 and w.counters["saved_tokens"] == 2 * HIT
    finally:
        gate.set()
        e.close()
    tiny = Engine(tmp_path, tiers(tmp_path, "tiny"), tp=1, engine_id="tiny", caches_seed=1, save_memory=1)
    try:  # a save larger than the whole budget still goes when nothing else is queued
        assert tiny.serve(Request("big", PROMPT), A_BLOCKS) == 0
        assert tiny.workers[0].counters["saved_tokens"] == HIT and tiny.workers[0].counters["saves_dropped"] == 0
    finally:
        tiny.close()


def test_a_host_pool_on_top_saves_in_place(tmp_path, monkeypatch):
    """A store whose top tier is a host pool (write_back): wait_for_save gathers each save's chunks straight into
    pool memory reserved for them and commits them, so they are in the host tier when it returns; nothing goes
    through the copies put in the background (held up here: the old path stored nothing by then), none is
    queued, and another engine loads the bytes exactly."""
    import tierstore_vllm.worker as worker_mod

    gate = threading.Event()
    real = worker_mod.save_prefix
    monkeypatch.setattr(worker_mod, "save_prefix", lambda kv, spec, layers: (gate.wait(30), real(kv, spec, layers))[1])
    a = Engine(tmp_path, tiers(tmp_path, pool=True), tp=1, caches_seed=1, save_memory=1)
    (w,) = a.workers
    try:
        plan = a.step(SchedulerOutput([NewRequestData("r", PROMPT, (A_BLOCKS,), 0)],
                                      num_scheduled_tokens={"r": len(PROMPT)}), drain=False)
        assert len(plan.saves) == 1
        assert w.counters["saved_tokens"] == HIT and w.counters["saves_dropped"] == 0
        assert w.kv(None).where(PROMPT[:HIT]) == ["host", "host"]
        assert w._pending_bytes == 0 and not w._gathered
        want = kv_of(a, 0, A_BLOCKS)
    finally:
        gate.set()
        a.close()
    b = Engine(tmp_path, tiers(tmp_path), tp=1)
    try:
        assert b.serve(Request("b", PROMPT), B_BLOCKS) == HIT
        assert all(torch.equal(g, x) for g, x in zip(kv_of(b, 0, B_BLOCKS), want, strict=True))
    finally:
        b.close()


def test_without_layerwise_the_whole_prefix_is_in_the_cache_before_the_forward(tmp_path, saved, monkeypatch):
    """layerwise=False: start_load_kv returns only once every layer of every load is written."""
    scattered, at_return = [], []
    scatter, start = PagedTransfer.scatter, WorkerSide.start_load

    def slow_scatter(self, layer, pieces, staged):
        time.sleep(0.02)
        scatter(self, layer, pieces, staged)
        scattered.append(layer)

    def observed(self):
        start(self)
        at_return.append(len(scattered))

    monkeypatch.setattr(PagedTransfer, "scatter", slow_scatter)
    monkeypatch.setattr(WorkerSide, "start_load", observed)
    b = Engine(tmp_path, tiers(tmp_path), layerwise=False)
    try:
        assert b.serve(Request("b", PROMPT), B_BLOCKS) == HIT
        assert at_return == [len(LAYER_NAMES), 2 * len(LAYER_NAMES)], "start_load returned before its load"
        for rank in range(2):
            assert all(torch.equal(g, w) for g, w in zip(kv_of(b, rank, B_BLOCKS), saved[rank], strict=True))
    finally:
        b.close()


def test_options_are_checked():
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorOptions.parse({"config": {"tiers": []}, "chunk": 3})
    with pytest.raises(ConfigError):
        ConnectorOptions.parse({"config": {}, "lookup_timeout_s": -1})
    opts = ConnectorOptions.parse({"config": {"tiers": [{"kind": "host", "capacity": "1MiB"}]}})
    assert opts.chunk_size(16) == 256 and opts.chunk_size(128) == 256 and opts.chunk_size(512) == 512
    with pytest.raises(ConfigError, match="multiple"):
        ConnectorOptions.parse({"config": {}, "chunk_tokens": 100}).chunk_size(16)
    assert ConnectorOptions.parse({"config": {}, "save_memory": "256MiB"}).save_memory == 256 << 20
    assert ConnectorOptions.parse({"config": {}}).save_memory == 1 << 30
    for bad in ("lots", -1, 0, True):
        with pytest.raises(ConfigError, match="save_memory"):
            ConnectorOptions.parse({"config": {}, "save_memory": bad})
    assert ConnectorOptions.parse({"config": {}}).layerwise is True
    assert ConnectorOptions.parse({"config": {}, "layerwise": False}).layerwise is False
    with pytest.raises(ConfigError, match="layerwise"):
        ConnectorOptions.parse({"config": {}, "layerwise": "no"})


def test_the_fakes_never_import_vllm():
    assert "vllm" not in sys.modules


def test_many_tenants_keep_bounded_state_and_still_hit(tmp_path):
    from tierstore_vllm.worker import TENANTS_KEPT

    e = Engine(tmp_path, tiers(tmp_path), caches_seed=1)
    try:
        n = TENANTS_KEPT + 20
        for t in range(n):
            e.serve(Request(f"t{t}", PROMPT, cache_salt=f"tenant-{t}"), A_BLOCKS)
        for w in e.workers:  # one cache object per recent tenant, all on one set of staging buffers and loaders
            assert len(w._kvs) == TENANTS_KEPT
            assert len({id(kv._shared) for kv in w._kvs.values()}) == 1
        assert e.matched(Request("t0-again", PROMPT, cache_salt="tenant-0")) == HIT  # dropped, rebuilt, hits
        assert e.matched(Request("stranger", PROMPT, cache_salt="tenant-x")) == 0
    finally:
        e.close()


def test_an_in_place_save_never_stalls_the_forward_on_a_host_tier_full_of_dirty_chunks(tmp_path):
    """The host pool full of chunks not yet written below (disk writes held up): wait_for_save, on vLLM's forward
    thread, neither writes them down nor waits for room; it saves nothing (a later recompute) and returns at
    once, and every chunk the store held is still there once the writes go through."""
    import tierstore

    a = Engine(tmp_path, [{"kind": "host", "capacity": "64KiB", "pool": True},
                          {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"}], tp=1, caches_seed=1)
    (w,) = a.workers
    disk = w.store.tiers[1].backend
    gate, write_many = threading.Event(), disk.write_many
    disk.write_many = lambda items, *args, **kw: (gate.wait(5), write_many(items, *args, **kw))[1]
    try:
        held = {tierstore.ChunkKey.from_tensors({"x": torch.full((1,), i)}):
                {"x": torch.full((4096,), i, dtype=torch.uint8)} for i in range(16)}
        assert all(w.store.put_many(list(held.items())))  # exactly the tier's 64 KiB, all dirty
        t0 = time.monotonic()
        a.step(SchedulerOutput([NewRequestData("r", PROMPT, (A_BLOCKS,), 0)],
                               num_scheduled_tokens={"r": len(PROMPT)}), drain=False)
        took = time.monotonic() - t0
        assert took < 1.0, took  # a write-down would wait for the gate (5 s)
        assert w.counters["saved_tokens"] == 0 and w.kv(None).stats()["unsaved_chunks"] == 2
    finally:
        gate.set()
        del disk.write_many
    try:
        w.store.flush(timeout=30)
        assert all(torch.equal(w.store.get(k)["x"], v["x"]) for k, v in held.items())
    finally:
        a.close()
