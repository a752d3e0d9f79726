"""A cold instance reading a prefix only the remote holds: requests counted at the S3 shim.

Another engine published the chunks; this store's local tiers are empty and its remote tier has not
listed the prefix. A read of such a key needs no HEAD: its GET answers whether the object exists (a 404
is the miss), and the hit joins the index. A lookup costs one HEAD per key, in a few concurrent waves.
"""

from __future__ import annotations

import logging
import math
import sys
import uuid

import pytest
import torch

import tierstore
from tierstore.backends.base import Hit
from tierstore.backends.fsspec import FsspecBackend
from tierstore.backends.layout import object_relpath
from tierstore.bench.s3shim import S3Shim
from tierstore.store import TieredStore
from tierstore.testing.data import assert_same, chunk, key_of, run_threads

N = 16


@pytest.fixture
def published(s3_server, shim):
    """``(url, options through the shim)`` of a fresh prefix where another engine published keys 0..N-1."""
    url = f"s3://{s3_server.new_bucket('cold')}/kv-{uuid.uuid4().hex[:8]}"
    with FsspecBackend(url=url, storage_options=s3_server.storage_options) as writer:
        assert writer.write_many([(key_of(i), writer.prepare(key_of(i), chunk(i))) for i in range(N)]) == [None] * N
    shim.set_fault("pass")
    yield url, shim.storage_options(s3_server.storage_options)
    shim.set_fault("pass")


def cold_store(url: str, options: dict, **remote) -> tierstore.TieredStore:
    return tierstore.open({"tiers": [{"kind": "host", "capacity": "16MiB", "pinned": False},
                                     {"kind": "remote", "url": url, "storage_options": options,
                                      "list_on_open": False, **remote}],
                           "prefetch_policy": "transient"})


def requests(shim: S3Shim) -> dict[str, int]:
    return dict(shim.stats()["by_method"])


def remote_stats(store: TieredStore) -> dict:
    return store.stats()["tiers"]["remote"]


def indexed(store: TieredStore, keys) -> list[bool]:
    """Whether the remote tier's index holds each key (no I/O)."""
    return [store.holders(k) == ["remote"] for k in keys]


def test_cold_get_many_is_one_get_per_key_and_no_head(published, shim):
    """Before: a HEAD to probe each key, a second HEAD inside s3fs's cat_file, then the GET."""
    url, options = published
    keys = [key_of(i) for i in range(N)] + [key_of(100), key_of(101)]  # two keys nobody published
    with cold_store(url, options) as store:
        shim.reset()
        got = store.get_many(keys)
        assert requests(shim) == {"GET": len(keys)}
        for i in range(N):
            assert_same(got[i], chunk(i))
        assert got[N:] == [None, None]
        assert indexed(store, keys) == [True] * N + [False, False]  # hits were indexed
        stats = remote_stats(store)
        assert stats["hits"] == N and stats["misses"] == 2 and stats["errors"] == 0
        assert stats["objects"] == N and stats["used_bytes"] == stats["bytes_out"] > 0

        shim.reset()
        again = store.get_many(keys[:N])  # indexed now: still one GET each
        assert requests(shim) == {"GET": N}
        for i in range(N):
            assert_same(again[i], chunk(i))


def test_cold_reads_into_buffers_and_single_gets_issue_no_head(published, shim):
    url, options = published
    keys = [key_of(i) for i in range(N)] + [key_of(100)]
    outs = [{n: torch.empty_like(t) for n, t in chunk(i).items()} for i in range(N)]
    outs.append({n: torch.empty_like(t) for n, t in chunk(0).items()})
    with cold_store(url, options) as store:
        shim.reset()
        got = store.get_many(keys, out=outs)
        assert requests(shim) == {"GET": len(keys)}
        for i in range(N):
            assert got[i]["k"] is outs[i]["k"]
            assert_same(outs[i], chunk(i))
        assert got[N] is None
    for single in ("get", "get_out"):
        with cold_store(url, options) as store:
            shim.reset()
            out = {n: torch.empty_like(t) for n, t in chunk(3).items()}
            value = store.get(key_of(3)) if single == "get" else store.get(key_of(3), out=out)
            assert_same(value, chunk(3))
            if single == "get_out":
                assert value["k"] is out["k"]
            assert store.get(key_of(100)) is None
            assert requests(shim) == {"GET": 2}
            stats = remote_stats(store)
            assert stats["bytes_out"] == stats["used_bytes"] > 0  # the hit's stored size
    with FsspecBackend(url=url, storage_options=options, list_on_open=False) as backend:  # the backend alone
        shim.reset()
        out = {n: torch.empty_like(t) for n, t in chunk(4).items()}
        (hit,) = backend.read_into_many([key_of(4)], [out])
        assert isinstance(hit, Hit) and hit.value["v"] is out["v"]
        assert_same(out, chunk(4))
        assert backend.read(key_of(100)) is None and backend.read_objects([key_of(101)]) == [None]
        assert requests(shim) == {"GET": 3}


def test_cold_batch_keeps_per_key_results(published, s3_server, shim):
    """Duplicates, a damaged object, an ``out`` that does not fit and a miss in one cold batch: each key
    gets its own answer, nothing else is affected, and the damaged object is not indexed (nor deleted)."""
    url, options = published
    fs = s3_server.filesystem()
    bad = f"{url[len('s3://'):]}/{object_relpath(key_of(5))}"
    data = bytearray(fs.cat_file(bad))
    data[-1] ^= 0x10
    fs.pipe_file(bad, bytes(data))
    with cold_store(url, options) as store:
        shim.reset()
        got = store.get_many([key_of(1), key_of(1), key_of(5), key_of(2)])
        assert_same(got[0], chunk(1))
        assert_same(got[1], chunk(1))
        assert got[0]["k"].data_ptr() != got[1]["k"].data_ptr()  # each slot owns its tensors
        assert got[2] is None and got[3] is not None
        assert requests(shim) == {"GET": 4}  # the damaged object was read once
        assert remote_stats(store)["corrupt"] == 1
        assert indexed(store, [key_of(1), key_of(5), key_of(2)]) == [True, False, True]
        assert fs.exists(bad)  # a shared tier's reader never deletes

        wrong = {"x": torch.empty(3)}
        fits = {n: torch.empty_like(t) for n, t in chunk(7).items()}
        other = {n: torch.empty_like(t) for n, t in chunk(7).items()}  # every out owns its memory
        res = store.get_many([key_of(6), key_of(7), key_of(100)], out=[wrong, fits, other])
        assert res[0] is None  # an out that does not fit its chunk: a miss for the store's caller (warned)
        assert_same(res[1], chunk(7))
        assert res[1]["k"] is fits["k"]
        assert res[2] is None
    with FsspecBackend(url=url, storage_options=options, list_on_open=False) as backend:  # the same, per item
        wrong = {"x": torch.empty(3)}
        fits = {n: torch.empty_like(t) for n, t in chunk(7).items()}
        other = {n: torch.empty_like(t) for n, t in chunk(7).items()}
        res = backend.read_into_many([key_of(6), key_of(7), key_of(100), key_of(5)],
                                     [wrong, fits, other, {n: torch.empty_like(t) for n, t in chunk(5).items()}])
        assert isinstance(res[0], tierstore.InvalidInputError)
        assert isinstance(res[1], Hit)
        assert_same(fits, chunk(7))
        assert res[2] is None
        assert isinstance(res[3], tierstore.CorruptObjectError)


def test_cold_get_denied_as_a_missing_key_is_a_quiet_miss(published, shim, caplog):
    """Without s3:ListBucket, S3 answers a GET of a missing key with 403: a miss, not an error storm."""
    caplog.set_level(logging.WARNING, logger="tierstore")
    url, options = published
    with cold_store(url, options) as store:
        backend = store.tier("remote").backend
        shim.set_fault("status", status=403, methods=["GET"])
        for i in range(100, 110):
            assert store.get(key_of(i)) is None
        assert store.get_many([key_of(110), key_of(111)]) == [None, None]
        assert backend.read_many([key_of(112), key_of(113)]) == [None, None]
        stats = remote_stats(store)
        assert stats["errors"] == 0 and stats["misses"] == 12 and stats["backoff_s"] == 0
        assert set(stats["failures"]) == {"get-403"}, stats["failures"]
        assert len([r for r in caplog.records if "denied" in r.getMessage()]) == 1
        shim.set_fault("pass")
        assert_same(store.get(key_of(1)), chunk(1))  # the tier never backed off: a 403 is an answer


def test_cold_lookup_is_one_head_per_key_in_few_waves(published, shim, monkeypatch):
    """``lookup`` of a prefix only the remote holds: one HEAD per key and nothing else, probed in
    concurrent windows; with the default ``max_in_flight`` (32) a 64-key prefix is at most 3 round trips."""
    url, options = published
    n = 64
    with FsspecBackend(url=url, storage_options=options) as writer:
        assert writer.write_many([(key_of(i), writer.prepare(key_of(i), chunk(i, nbytes=256)))
                                  for i in range(N, n)]) == [None] * (n - N)
    keys = [key_of(i) for i in range(n)]
    waves = []
    stat_many = FsspecBackend.stat_many

    def counted(self, batch):
        waves.append(math.ceil(len(batch) / self.max_in_flight))
        return stat_many(self, batch)

    monkeypatch.setattr(FsspecBackend, "stat_many", counted)
    with cold_store(url, options) as store:
        shim.reset()
        assert store.lookup(keys + [key_of(1000)]) == n
        assert requests(shim) == {"HEAD": n + 1}
        assert sum(waves) <= 3
        shim.reset()
        assert store.lookup(keys) == n  # indexed now: no request
        assert requests(shim) == {}


def test_s3_tiers_of_a_process_share_one_botocore_session(s3_server):
    """Each s3fs filesystem made its own botocore session, which loads botocore's models (0.1-0.4 s of CPU)
    before the first request of every store opened; shared, only the first pays. Clients stay per tier."""
    from aiobotocore.session import AioSession

    url = f"s3://{s3_server.new_bucket('session')}/kv"
    fresh = s3_server.storage_options  # skip_instance_cache: a filesystem (and client) per tier
    with FsspecBackend(url=url, storage_options=fresh) as a, FsspecBackend(url=url, storage_options=fresh) as b:
        a.write(key_of(1), chunk(1))
        assert_same(b.read(key_of(1)), chunk(1))
        assert a.fs is not b.fs and a.fs.session is b.fs.session
        assert a.fs._s3 is not b.fs._s3  # separate clients and connection pools
    cached = {k: v for k, v in fresh.items() if k != "skip_instance_cache"}
    with FsspecBackend(url=url, storage_options=cached) as a, FsspecBackend(url=url, storage_options=cached) as b:
        assert a.fs is b.fs  # fsspec's instance cache still recognises the same options
    own = AioSession()
    with FsspecBackend(url=url, storage_options={**fresh, "session": own}) as c:
        assert_same(c.read(key_of(1)), chunk(1))
        assert c.fs.session is own  # a session the caller brings is used as it is


def test_cold_reads_racing_publishes_and_deletes_are_exact_or_miss(s3_server):
    """Readers GET keys their index lacks while another instance publishes and deletes them: every result
    is the exact chunk or a miss, and whatever the readers indexed is still read right or forgotten."""
    url = f"s3://{s3_server.new_bucket('race')}/kv"
    keys = [key_of(i) for i in range(8)]
    reader_backend = FsspecBackend(url=url, storage_options=s3_server.storage_options, list_on_open=False)
    with FsspecBackend(url=url, storage_options=s3_server.storage_options) as writer, \
            TieredStore.from_backends([reader_backend]) as reader:
        def work(i: int) -> None:
            for round_ in range(4):
                if i == 0:
                    assert writer.write_many([(k, writer.prepare(k, chunk(j))) for j, k in enumerate(keys)]) == [
                        None] * len(keys)
                elif i == 1:
                    assert writer.delete_many(keys[round_ % 2::2]) == [None] * (len(keys) // 2)
                else:
                    got = reader.get_many(keys) if i % 2 else reader.get_many(
                        keys, out=[{n: torch.empty_like(t) for n, t in chunk(j).items()} for j in range(len(keys))])
                    for j, g in enumerate(got):
                        if g is not None:
                            assert_same(g, chunk(j))

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            run_threads(work, 6)
        finally:
            sys.setswitchinterval(old)
        held = reader.residency.keys(reader.tier("remote").index)
        for k, g in zip(held, reader.get_many(held), strict=True):  # what it indexed: read right or forgotten
            if g is None:
                assert reader.holders(k) == []
            else:
                assert_same(g, chunk(keys.index(k)))
        for j, g in enumerate(reader.get_many(keys)):
            assert g is None or assert_same(g, chunk(j)) is None
        stats = remote_stats(reader)
        assert stats["corrupt"] == 0 and stats["errors"] == 0
