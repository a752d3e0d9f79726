"""KV moved with one copy: loads scatter straight from host-pool memory the store lends, saves gather straight
into pool memory the store reserves (reserve -> fill -> commit). Nothing reserved is visible before its commit,
an aborted or failed save leaves no trace, a reservation under pressure evicts like a put, a lent chunk never
hands a load bytes of another value, and every store shares one set of loader threads and staging buffers."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore
from tierstore import KVCacheStore, KVNamespace
from tierstore.kv import PagedLayout, gather_layers, rows, transfer
from tierstore.kv.rows import PagedTransfer
from tierstore.store import Loan

H, D, LAYERS, C, BS = 2, 8, 3, 16, 4
NS = KVNamespace(model="m", dtype="float32")


def host_store(capacity="64MiB", disk=None):
    tiers = [{"kind": "host", "capacity": capacity, "pinned": False, "pool": True}]
    if disk is not None:
        tiers.append({"kind": "disk", "path": str(disk), "capacity": "256MiB"})
    return tierstore.open({"tiers": tiers})


def caches(blocks: int, seed: int | None = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    return [torch.randn(2, blocks, BS, H, D, generator=g) if seed is not None else torch.zeros(2, blocks, BS, H, D)
            for _ in range(LAYERS)]


def like(n: int) -> dict[str, torch.Tensor]:
    return {f"layer.{j}": torch.empty(2, n, H, D, device="meta") for j in range(LAYERS)}


def pool_free(store) -> int:
    return store.tiers[0].backend.pool.free_bytes()


# ---------------------------------------------------------------------- the reservation put
def test_reserved_chunks_are_invisible_until_commit_and_an_abort_leaves_nothing():
    with host_store() as store:
        free = pool_free(store)
        k1, k2 = (tierstore.ChunkKey.from_tensors({name: torch.ones(1)}) for name in "ab")
        r = store.reserve([(k1, like(C)), (k2, like(C))])
        assert all(t is not None for t in r.tensors)
        for i, t in enumerate(r.tensors):
            for v in t.values():
                v.fill_(i + 1)
        # filled, not committed: no reader, lookup or stat sees it; its bytes are counted as reserved only
        assert store.get(k1) is None and not store.contains(k2) and store.lookup([k1, k2]) == 0
        assert store.stats()["tiers"]["host"]["objects"] == 0
        assert r.commit([True, False]) == [True, False]  # k2 aborted
        got = store.get(k1)
        assert got is not None and all(bool((v == 1).all()) for v in got.values())
        assert store.get(k2) is None and store.where(k2) is None
        store.delete([k1])
        assert pool_free(store) == free  # every run given back
        r = store.reserve([(k2, like(C))])
        r.abort()
        assert store.get(k2) is None and pool_free(store) == free
        lv = store.residency.tiers[0]
        assert lv.reserved == 0 and lv.used == 0
        with store.reserve([(k2, like(C))]):  # leaving the block without a commit aborts
            pass
        assert store.get(k2) is None and pool_free(store) == free and lv.reserved == 0


def four_chunks(store):
    """A KVCacheStore over ``store`` and the tokens, block table and vLLM caches of 4 chunks of KV."""
    n = 4 * C
    table = list(range(n // BS))
    return KVCacheStore(store, NS, chunk_tokens=C), list(range(n)), table, caches(len(table))


def save_failing_mid_gather(monkeypatch, kv, tokens, src, table) -> None:
    """``kv.save_from`` with the gather of its second layer failing (the first layer's bytes already gathered
    wherever the save gathers them): it raises the injected error; the gather is restored after."""
    gather, calls = PagedTransfer.gather, []

    def failing(self, layer, pieces, staged):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("injected gather failure")
        return gather(self, layer, pieces, staged)

    with monkeypatch.context() as m:
        m.setattr(PagedTransfer, "gather", failing)
        with pytest.raises(RuntimeError, match="injected"):
            kv.save_from(tokens, src, "vllm", table)


def test_a_save_that_fails_mid_gather_leaves_nothing_visible_and_the_next_save_stores_it(monkeypatch):
    with host_store() as store:
        kv, tokens, table, src = four_chunks(store)
        n = len(tokens)
        free = pool_free(store)
        save_failing_mid_gather(monkeypatch, kv, tokens, src, table)
        assert kv.lookup(tokens) == 0 and all(not store.contains(k) for k in kv.keys(tokens))
        assert store.stats()["tiers"]["host"]["objects"] == 0 and pool_free(store) == free
        assert store.residency.tiers[0].reserved == 0
        assert kv.save_from(tokens, src, "vllm", table) == n
        dst = caches(len(table), seed=None)
        assert kv.load_into(tokens, dst, "vllm", table) == n
        assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))


def test_a_reservation_under_pressure_evicts_like_a_put(tmp_path):
    """A full host tier over a disk tier: reserving room evicts the least recently used chunks, writing the
    dirty ones down first (nothing is lost), and never holds more than its capacity."""
    chunk = 2 * C * H * D * 4 * LAYERS  # bytes of one chunk of the KV below
    per = 4 << 20
    with tierstore.open({"tiers": [{"kind": "host", "capacity": per, "pinned": False, "pool": True},
                                   {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}]}) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        n = C * (2 * per // chunk)  # twice what the host tier holds
        table = list(range(n // BS))
        src = caches(len(table), seed=5)
        tokens = list(range(n))
        assert kv.save_from(tokens, src, "vllm", table) == n
        host = store.stats()["tiers"]["host"]
        assert host["used_bytes"] <= host["capacity_bytes"] and host["evictions"] > 0
        where = kv.where(tokens)
        assert where[0] == "disk" and where[-1] == "host"  # the oldest went down, the newest stay on top
        dst = caches(len(table), seed=None)
        assert kv.load_into(tokens, dst, "vllm", table) == n  # every chunk, from whichever tier holds it
        assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))


def test_a_reservation_larger_than_the_tier_never_waits_for_room_it_holds_itself(tmp_path):
    """Keys past what the tier can hold get ``None`` at once (put the usual way, after the commit frees its
    chunks to evict), as a put's next wave would: the room they lack is this reservation's own, so waiting for
    it (the old behaviour) only spent the whole bounded wait. With room held by others' chunks it evicts."""
    with host_store("1MiB") as probe:
        size = probe.tiers[0].backend.reserved_size(like(C))
    host = {"kind": "host", "capacity": 4 * size + size // 2, "pinned": False, "pool": True}
    with tierstore.open({"tiers": [host, {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}
                        ) as store:
        store._transfers.pin_wait = 30.0  # a wait would show; the old code took all of it
        keys = [tierstore.ChunkKey.from_tensors({"i": torch.tensor([i])}) for i in range(12)]
        start = time.monotonic()
        with store.reserve([(k, like(C)) for k in keys[:8]]) as r:
            assert time.monotonic() - start < 10
            assert [t is not None for t in r.tensors] == [True] * 4 + [False] * 4
            for i, t in enumerate(r.tensors[:4]):
                for v in t.values():
                    v.fill_(i)
            assert r.commit() == [True] * 4 + [False] * 4
        with store.reserve([(k, like(C)) for k in keys[8:]]) as r:  # evicts the four, written down first
            assert all(t is not None for t in r.tensors)
            for i, t in enumerate(r.tensors, 8):
                for v in t.values():
                    v.fill_(i)
            assert r.commit() == [True] * 4
        assert store.stats()["tiers"]["host"]["evictions"] == 4
        assert [store.where(k) for k in keys[:4] + keys[8:]] == ["disk"] * 4 + ["host"] * 4
        for i in [*range(4), *range(8, 12)]:  # nothing lost
            got = store.get(keys[i])
            assert got is not None and all(bool((v == i).all()) for v in got.values())


def test_a_reservation_waits_for_room_others_hold_after_it_holds_some(tmp_path):
    """A reservation that already holds some room still waits (bounded) for room the tier's other chunks hold
    — a reader's pin, a write-back batch that still borrows them — as long as its own keys fit the tier: the
    old rule stopped waiting after the first key it held, so a key got ``None`` whenever the last victim was
    busy for a moment (CI: a write-back batch still borrowing it)."""
    with host_store("1MiB") as probe:
        size = probe.tiers[0].backend.reserved_size(like(C))
    host = {"kind": "host", "capacity": 4 * size + size // 2, "pinned": False, "pool": True}
    with tierstore.open({"tiers": [host, {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}
                        ) as store:
        keys = [tierstore.ChunkKey.from_tensors({"i": torch.tensor([i])}) for i in range(8)]
        store.put_many([(k, {n: torch.full(v.shape, i, dtype=v.dtype) for n, v in like(C).items()})
                        for i, k in enumerate(keys[:4])])
        store.flush()
        loan = store.lend([keys[3]])  # the last victim the reservation will need, held by a reader for a while
        assert loan.tensors[0] is not None
        threading.Timer(0.5, loan.close).start()
        start = time.monotonic()
        with store.reserve([(k, like(C)) for k in keys[4:]]) as r:
            assert all(t is not None for t in r.tensors)
            assert time.monotonic() - start >= 0.4  # it waited for the reader
            for i, t in enumerate(r.tensors, 4):
                for v in t.values():
                    v.fill_(i)
            assert r.commit() == [True] * 4
        for i, k in enumerate(keys):
            got = store.get(k)
            assert got is not None and all(bool((v == i).all()) for v in got.values())


@pytest.mark.parametrize("how", ["put", "reserve"])
def test_room_taken_from_chunks_write_back_still_borrows_waits_for_their_memory(tmp_path, monkeypatch, how):
    """Write-back borrows a batch of host-pool chunks and writes them below; once written they are clean, but
    their pool runs stay lent until the whole batch is done. A put or reservation that needs room then waits
    for those runs (the chunks stay pinned) rather than evicting them — their bytes would count free while
    no pool memory comes back, so after a few rounds of evicting more of them it used to skip the host tier:
    the newest chunk went to disk, and chunks were evicted for nothing."""
    k = 8  # one write-back batch (max_in_flight)
    value = {"x": torch.arange(1536, dtype=torch.float32)}
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}
    with host_store("1MiB") as probe:
        size = probe.tiers[0].backend.reserved_size(value)
    host = {"kind": "host", "capacity": k * size + size // 2, "pinned": False, "pool": True}  # k chunks fit, not k+1
    with tierstore.open({"tiers": [host, disk], "max_in_flight": k}) as store:
        res, transfers = store.residency, store._transfers
        go, landed, release = threading.Event(), threading.Event(), threading.Event()
        take_due, land_many, reserve_room = res.take_due, transfers.land_many, res.reserve

        def gated_take_due(tier, limit):
            go.wait(10)  # write-back starts once all k chunks are put: one batch
            return take_due(tier, limit)

        def held_land_many(tier, items, *args, kind="put", **kw):
            out = land_many(tier, items, *args, kind=kind, **kw)
            if kind == "write-back" and not landed.is_set():
                landed.set()
                release.wait(10)  # written below (clean), its pool runs still lent
            return out

        def reserve(key, tier, size, clean=False):
            room = reserve_room(key, tier, size, clean)
            if room.wait and room.reserved is None and not room.victims:
                release.set()  # the put waits for the batch: let it finish
            return room

        monkeypatch.setattr(res, "take_due", gated_take_due)
        monkeypatch.setattr(transfers, "land_many", held_land_many)
        keys = [tierstore.ChunkKey.from_tensors({"i": torch.tensor([i])}) for i in range(k + 1)]
        values = [{"x": value["x"] + i} for i in range(k + 1)]
        assert store.put_many(list(zip(keys[:k], values[:k], strict=True))) == [True] * k
        go.set()
        assert landed.wait(10) and store.stats()["pending_writeback"] == 0
        monkeypatch.setattr(res, "reserve", reserve)
        try:
            if how == "put":
                assert store.put(keys[k], values[k])
            else:
                with store.reserve([(keys[k], value)]) as r:
                    assert r.tensors[0] is not None, "the reservation skipped the host tier"
                    r.tensors[0]["x"].copy_(values[k]["x"])
                    assert r.commit() == [True]
        finally:
            release.set()
        stats = store.stats()["tiers"]["host"]
        assert store.where(keys[k]) == "host"  # the newest chunk is on top
        assert stats["evictions"] == 1 and stats["errors"] == 0  # one victim, and no write refused
        for key, v in zip(keys, values, strict=True):  # nothing lost
            got = store.get(key)
            assert got is not None and torch.equal(got["x"], v["x"])


# ---------------------------------------------------------------------- loads from lent pool memory
def test_a_lent_chunk_replaced_or_evicted_mid_load_never_scatters_another_values_bytes(monkeypatch):
    """Loads scatter from the pool while another thread overwrites the same keys with other values, deletes
    them and fills the tiny pool with other chunks (so freed runs are reused at once), with a delay injected in
    the middle of each scatter. Every chunk a load reports lands whole, as one of the values written: never a
    mix, never bytes of a chunk that took over its memory."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    n = 4 * C
    table = list(range(n // BS))
    values = [caches(len(table), seed=s) for s in (1, 2)]
    chunk_bytes = 2 * C * H * D * 4 * LAYERS
    copy_rows_in = rows._copy_rows_in

    def slow(flat, index, src, *words):
        time.sleep(0.0005)  # a scatter is under way while the writer replaces the chunk being read
        copy_rows_in(flat, index, src, *words)

    monkeypatch.setattr(rows, "_copy_rows_in", slow)
    try:
        with host_store(capacity=6 * chunk_bytes + 4096) as store:
            assert store.tiers[0].backend.pool is not None
            kv = KVCacheStore(store, NS, chunk_tokens=C)
            tokens = list(range(n))
            kv.save_from(tokens, values[0], "vllm", table)
            stop = threading.Event()
            errors: list[BaseException] = []

            def writer():
                i = 0
                try:
                    while not stop.is_set():
                        i += 1
                        kv.save(tokens, gather_layers(values[i % 2], "vllm", table, 0, n))  # skipped if held
                        store.delete(kv.keys(tokens)[i % 4:])
                        filler = torch.full((2, C, H, D), float(i))
                        other = KVCacheStore(store, NS.replace(tenant=f"t{i % 3}"), chunk_tokens=C)
                        other.save(list(range(n)), [torch.cat([filler] * 4, 1)] * LAYERS)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            t = threading.Thread(target=writer)
            t.start()
            try:
                deadline = time.monotonic() + 4.0
                loads = 0
                while time.monotonic() < deadline:
                    dst = caches(len(table), seed=None)
                    got = kv.load_into(tokens, dst, "vllm", table)
                    loads += 1
                    out = gather_layers(dst, "vllm", table, 0, n)
                    for c in range(got // C):
                        mine = [o[:, c * C:(c + 1) * C] for o in out]
                        assert any(all(torch.equal(m, w[:, c * C:(c + 1) * C]) for m, w in zip(
                            mine, gather_layers(v, "vllm", table, 0, n), strict=True)) for v in values), (loads, c)
            finally:
                stop.set()
                t.join(10)
            assert not errors and loads > 3
    finally:
        sys.setswitchinterval(old)


def test_loads_from_the_host_tier_read_nothing_into_staging(monkeypatch):
    with host_store() as store:
        kv, tokens, table, src = four_chunks(store)
        n = len(tokens)
        kv.save_from(tokens, src, "vllm", table)
        reads = []
        get_many_async = type(store).get_many_async
        monkeypatch.setattr(type(store), "get_many_async",
                            lambda self, keys, **kw: reads.append(keys) or get_many_async(self, keys, **kw))
        dst = caches(len(table), seed=None)
        assert kv.load_into(list(range(n)), dst, "vllm", table) == n
        assert reads == [] and all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))
        assert store.stats()["tiers"]["host"]["hits"] >= n // C


# ---------------------------------------------------------------------- one set of threads and staging per store
def test_sixteen_tenants_share_the_loader_threads_and_staging_of_one(monkeypatch, tmp_path):
    """Layer-wise loads of 16 tenants at once use the threads and the staging buffers one tenant uses."""
    with host_store(disk=tmp_path / "disk") as store:
        base = KVCacheStore(store, NS, chunk_tokens=C)
        n = 2 * C
        table = list(range(n // BS))
        tenants = [base.for_tenant(f"t{i}") for i in range(16)]
        for kv in tenants:
            kv.save_from(list(range(n)), caches(len(table)), "vllm", table)
        get_many = type(store).get_many

        def slow(self, keys, out=None, device="cpu"):
            time.sleep(0.05)
            return get_many(self, keys, out=out, device=device)

        monkeypatch.setattr(type(store), "get_many", slow)
        monkeypatch.setattr(type(store), "lend", lambda self, keys: Loan([None] * len(keys)))  # staged reads

        def loader_threads():
            return {t.ident for t in threading.enumerate() if t.name.startswith("tierstore-kv-load")}

        handles = [kv.load_into(list(range(n)), caches(len(table), seed=None), "vllm", table, layerwise=True)
                   for kv in tenants]
        assert all(h.result(30) == n for h in handles)
        threads = loader_threads()
        assert 0 < len(threads) <= 4  # _LOADERS, for the store: not 4 per tenant
        assert all(kv._shared is base._shared for kv in tenants)
        other = KVCacheStore(store, NS.replace(model="other"), chunk_tokens=C)  # same store: same set
        assert other._shared is base._shared
        assert base._shared.staging.kept_bytes() <= 4 * transfer.STAGING_BYTES
        handle = tenants[0].load_into(list(range(n)), caches(len(table), seed=None), "vllm", table, layerwise=True)
        assert handle.result(30) == n and loader_threads() == threads


# ---------------------------------------------------------------------- round trips
LAYOUTS = [PagedLayout.VLLM, PagedLayout.FLASHINFER, PagedLayout.VLLM_CPU, PagedLayout.MLA,
           PagedLayout.SGLANG_PAGE_FIRST, PagedLayout.SGLANG_PAGE_FIRST_DIRECT]


def layout_caches(layout: PagedLayout, blocks: int, bs: int, g: torch.Generator | None) -> torch.Tensor | list:
    shape = {PagedLayout.VLLM: (2, blocks, bs, H, D), PagedLayout.FLASHINFER: (blocks, 2, bs, H, D),
             PagedLayout.VLLM_CPU: (blocks, H, bs, 2 * D), PagedLayout.MLA: (blocks, bs, D),
             PagedLayout.SGLANG_PAGE_FIRST: (2, blocks * bs, LAYERS, H, D),
             PagedLayout.SGLANG_PAGE_FIRST_DIRECT: (2, blocks, LAYERS, bs, H, D)}[layout]
    make = (lambda: torch.randn(shape, generator=g)) if g is not None else (lambda: torch.zeros(shape))
    return make() if layout.multi_layer else [make() for _ in range(LAYERS)]


def test_load_into_after_save_from_round_trips_bit_exact_for_random_tables_and_layouts(tmp_path):
    with host_store(capacity="64MiB", disk=tmp_path / "disk") as store:
        seen = [0]

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(layout=st.sampled_from(LAYOUTS), bs=st.sampled_from([1, 4, 16]), chunk=st.sampled_from([4, 16, 32]),
               n=st.integers(1, 160), spare=st.integers(0, 8), seed=st.integers(0, 2**16),
               start=st.integers(0, 160), per_object=st.sampled_from([None, 1, 2]), windows=st.booleans())
        def prop(layout, bs, chunk, n, spare, seed, start, per_object, windows):
            seen[0] += 1
            g = torch.Generator().manual_seed(seed)
            blocks = -(-n // bs) + spare
            kw = {"block_size": bs} if layout is PagedLayout.SGLANG_PAGE_FIRST else {}
            ns = KVNamespace(model=f"m{seen[0]}", dtype="float32", layout="mla" if layout.is_mla else "mha")
            kv = KVCacheStore(store, ns, chunk_tokens=chunk, layers_per_object=per_object,
                              num_layers=LAYERS if per_object else None)
            src = layout_caches(layout, blocks, bs, g)
            tokens = list(range(n))
            save_table = torch.randperm(blocks, generator=g)[:-(-n // bs)].tolist()
            load_table = torch.randperm(blocks, generator=g)[:-(-n // bs)].tolist()
            full = n // chunk * chunk
            old = transfer.STAGING_BYTES
            transfer.STAGING_BYTES = 1 if windows else old  # one chunk per window, or all in one
            try:
                assert kv.save_from(tokens, src, layout, save_table, **kw) == full
                first = min(start, full)
                dst = layout_caches(layout, blocks, bs, None)
                assert kv.load_into(tokens, dst, layout, load_table, start=first, **kw) == full
            finally:
                transfer.STAGING_BYTES = old
            if full > first:
                want = gather_layers(src, layout, save_table, first, full, **kw)
                got = gather_layers(dst, layout, load_table, first, full, **kw)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            if first > 0 or full < n:  # tokens outside [first, full) were not written
                rest = [gather_layers(dst, layout, load_table, a, b, **kw) for a, b in ((0, first), (full, n)) if b > a]
                assert all(not t.any() for r in rest for t in r)

        prop()


def test_stores_that_cannot_reserve_save_through_staging(tmp_path):
    """``write_through`` (every tier written by the put itself) and a top tier without a pool reserve nothing:
    their saves go through staging and ``put_many``, with the same result."""
    configs = [{"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False, "pool": True},
                          {"kind": "disk", "path": str(tmp_path / "a"), "capacity": "64MiB"}],
                "write_policy": "write_through"},
               {"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False, "pool": False}]},
               {"tiers": [{"kind": "disk", "path": str(tmp_path / "b"), "capacity": "64MiB"}]}]
    for config in configs:
        with tierstore.open(config) as store:
            kv, tokens, table, src = four_chunks(store)
            r = store.reserve([(kv.keys(tokens)[0], like(C))])
            assert r.tensors == [None]
            r.abort()
            assert kv.save_from(tokens, src, "vllm", table) == len(tokens)
            if config.get("write_policy") == "write_through":
                assert kv.where(tokens) == ["host"] * 4 and store.tier("disk").backend.stat_many(kv.keys(tokens))[0]
            dst = caches(len(table), seed=None)
            assert kv.load_into(tokens, dst, "vllm", table) == len(tokens)
            assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))


def test_a_reservation_that_fails_midway_gives_back_its_slot_and_bytes(monkeypatch):
    """The pool raising an unexpected error while a key's room is already reserved: the error propagates and the
    key's slot and bytes are given back (a put of the key right after takes them at once)."""
    from tierstore.backends.memory import HostBackend

    with host_store() as store:
        key = tierstore.ChunkKey.from_tensors({"x": torch.ones(1)})
        reserve_run = HostBackend.reserve_run

        def broken(self, *args):
            raise OSError(5, "injected I/O error")

        monkeypatch.setattr(HostBackend, "reserve_run", broken)
        with pytest.raises(OSError, match="injected"):
            store.reserve([(key, like(C))])
        monkeypatch.setattr(HostBackend, "reserve_run", reserve_run)
        lv = store.residency.tiers[0]
        assert lv.reserved == 0 and not store.residency.writing(key, 0)
        t0 = time.monotonic()
        assert store.put(key, {name: torch.zeros(t.shape) for name, t in like(C).items()})
        assert time.monotonic() - t0 < 1.0  # no wait for a slot left behind


def test_a_reservation_uses_only_what_its_store_hands_it():
    """tierstore/reservation.py reads no private attribute of another object (the store's ``_life``,
    ``_count``, ``_transfers``): what it needs comes in an ``Owner`` the store builds."""
    import ast
    import inspect

    import tierstore.reservation as reservation

    tree = ast.parse(inspect.getsource(reservation))
    private = [f"{ast.unparse(node.value)}.{node.attr}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert private == []


def test_save_from_a_start_copies_only_the_chunks_from_there(tmp_path):
    """``save_from(start=)`` extends a prefix saved before, as ``save`` does: the chunks before ``start`` are
    neither checked nor copied (here: not stored at all), the ones from there are, bit-exact; a ``start`` off a
    chunk boundary is refused before anything is stored. ``probe=False`` saves the same (no shared tier here)."""
    from tierstore.errors import InvalidInputError

    with host_store() as store:
        kv, tokens, table, src = four_chunks(store)
        assert kv.saves_in_place
        with pytest.raises(InvalidInputError, match="start"):
            kv.save_from(tokens, src, "vllm", table, start=C + 1)
        assert kv.save_from(tokens, src, "vllm", table, start=2 * C, probe=False) == 2 * C
        assert kv.where(tokens) == [None, None, "host", "host"]
        assert kv.save_from(tokens, src, "vllm", table) == 4 * C  # from the first miss on (chunk 0)
        dst = caches(len(table), seed=None)
        assert kv.load_into(tokens, dst, "vllm", table) == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pool": False}]}) as store:
        assert not KVCacheStore(store, NS, chunk_tokens=C).saves_in_place


def test_a_layer_the_store_lent_whole_is_resolved_before_the_next_layer_is_lent():
    """Layer-wise from per-layer objects the host tier holds: nothing is read from below, so lending the next
    layer's chunks before this layer is scattered and resolved would only delay the layer an engine waits for."""
    with host_store() as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C, layers_per_object=1, num_layers=LAYERS)
        n = 4 * C
        table = list(range(n // BS))
        src = caches(len(table))
        assert kv.save_from(list(range(n)), src, "vllm", table) == n
        lend = type(store).lend
        seen: list[list[bool]] = []
        handles: list = []
        gate = threading.Event()

        def spying(self, keys):
            gate.wait(10)  # the handle is known before the first lend
            seen.append([handles[0].layer(j).done() for j in range(LAYERS)])
            return lend(self, keys)

        dst = caches(len(table), seed=None)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(store), "lend", spying)
            handles.append(kv.load_into(list(range(n)), dst, "vllm", table, layerwise=True))
            gate.set()
            assert handles[0].result(10) == n
        assert seen == [[j < i for j in range(LAYERS)] for i in range(LAYERS)]
        assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))


def test_a_save_that_must_not_wait_takes_free_room_and_clean_copies_and_never_writes_down(tmp_path):
    """The host tier full of dirty chunks whose writes to disk are held up: a ``wait=False`` save (what an
    engine's forward thread does) returns at once with what fits in free memory, writes nothing down and loses
    nothing; once the chunks are written below their copies are clean, and the next such save evicts them
    (no I/O) to store everything. Every chunk acknowledged reads back exact."""
    chunk = 2 * C * H * D * 4 * LAYERS
    gate = threading.Event()
    with tierstore.open({"tiers": [{"kind": "host", "capacity": 10 * chunk, "pinned": False, "pool": True},
                                   {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}]}) as store:
        disk = store.tiers[1].backend
        write_many, writes = disk.write_many, [0]

        def held_up(items, *args, **kwargs):
            writes[0] += 1
            gate.wait(10)
            return write_many(items, *args, **kwargs)

        disk.write_many = held_up
        try:
            kv = KVCacheStore(store, NS, chunk_tokens=C)
            n = 16 * C
            table = list(range(n // BS))
            old, new = caches(len(table), seed=3), caches(len(table), seed=4)
            tokens, others = list(range(n)), list(range(10**6, 10**6 + n))
            assert kv.save_from(tokens[:8 * C], old, "vllm", table) == 8 * C  # fits: nothing evicted
            time.sleep(0.1)  # write-back has started (held up)
            t0 = time.monotonic()
            got = kv.save_from(others, new, "vllm", table, wait=False)
            took = time.monotonic() - t0
            assert took < 0.5, took  # a write-down would wait for the gate (10 s)
            assert got == 2 * C  # what the free room held; the rest not saved, nothing dirty evicted
            assert kv.stats()["unsaved_chunks"] == 14
            assert store.stats()["tiers"]["host"]["evictions"] == 0 and kv.lookup(tokens[:8 * C]) == 8 * C
        finally:
            gate.set()
            del disk.write_many
        store.flush(timeout=30)
        host, until = store.tiers[0].backend, time.monotonic() + 10
        while host._lent and time.monotonic() < until:  # noqa: SLF001 - write-back gives back the pool runs it
            time.sleep(0.01)  # read just after the flush sees them written (a run still lent is not free room)
        assert kv.where(tokens[:8 * C]) == ["host"] * 8  # still on top, now clean (a copy on disk too)
        # every copy on top is clean now: they make room without I/O, as many as the tier holds
        assert kv.save_from(others, new, "vllm", table, start=2 * C, wait=False) == 10 * C
        assert store.stats()["tiers"]["host"]["evictions"] == 10 and writes[0] > 0
        assert kv.where(tokens[:8 * C]) == ["disk"] * 8 and kv.lookup(others) == 12 * C
        for toks, src, end in ((tokens, old, 8 * C), (others, new, 12 * C)):
            dst = caches(len(table), seed=None)
            assert kv.load_into(toks[:end], dst, "vllm", table) == end
            assert all(torch.equal(a[:, :end // BS], b[:, :end // BS]) for a, b in zip(dst, src, strict=True))
