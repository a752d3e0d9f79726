"""A client reads a chunk it read before straight from the server's pool (``tierstore.serve.places``):
never an older value, a torn one or another chunk's, and the server's LRU still sees the reads."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from test_serve import node_config, url_of

import tierstore
from tierstore.serve import places
from tierstore.serve.server import NodeServer
from tierstore.testing.data import assert_same, chunk, key_of

SIZE = 100_000

pytestmark = pytest.mark.skipif(not places.DIRECT, reason="direct reads are taken only on x86-64")


def outs_like(value):
    return {n: torch.empty_like(t) for n, t in value.items()}


def direct_hits(store):
    return store.stats()["client"]["direct_hits"]


def test_a_chunk_read_before_is_copied_straight_from_the_pool_and_the_server_counts_the_hit(tmp_path):
    with NodeServer(node_config(tmp_path)).start() as server, tierstore.open({"server": url_of(server)}) as store:
        value = chunk(1, SIZE)
        assert store.put(key_of(1), value)
        out = outs_like(value)
        assert_same(store.get(key_of(1), out=out), value)  # through the server: learns the place
        assert direct_hits(store) == 0
        hits = server.store.stats()["tiers"]["host"]["hits"]
        for n in range(5):
            for t in out.values():
                t.zero_()
            got = store.get(key_of(1), out=out)
            assert_same(got, value)
            assert all(got[n] is out[n] for n in out)
        assert direct_hits(store) == 5
        assert store.get(key_of(1)) is not None  # another request carries the reads to the server
        deadline = time.monotonic() + 5  # (settled after that request's reply)
        while server.store.stats()["tiers"]["host"]["hits"] < hits + 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.store.stats()["tiers"]["host"]["hits"] == hits + 5 + 1
        other = {"k": torch.empty(3), "v": torch.empty(3)}
        assert store.get(key_of(1), out=other) is None  # an out of another shape still asks (and misses)


def test_an_overwritten_deleted_or_evicted_chunk_is_never_read_from_its_old_place(tmp_path):
    with NodeServer(node_config(tmp_path, host="1MiB")).start() as server, \
            tierstore.open({"server": url_of(server)}) as reader, tierstore.open({"server": url_of(server)}) as writer:
        out = outs_like(chunk(0, SIZE))
        for version in range(20):  # each overwrite lands where the last one's bytes were freed
            assert writer.put(key_of(1), chunk(version, SIZE))
            assert_same(reader.get(key_of(1), out=out), chunk(version, SIZE))
            assert_same(reader.get(key_of(1), out=out), chunk(version, SIZE))
        assert direct_hits(reader) == 20
        assert writer.delete([key_of(1)]) == 1
        assert reader.get(key_of(1), out=out) is None
        assert writer.put(key_of(2), chunk(2, SIZE))
        assert_same(reader.get(key_of(2), out=out), chunk(2, SIZE))
        # the reader's lease on key 2 goes back from its idle pass (RELEASE_AFTER): until then key 2 is pinned in host
        deadline = time.monotonic() + 5
        while server.store.stats()["tiers"]["host"]["pinned"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.store.stats()["tiers"]["host"]["pinned"] == 0
        for i in range(3, 40):  # 3.7 MB through a 1 MiB host tier: key 2 goes to disk, its memory to others
            assert writer.put(key_of(i), chunk(i, SIZE))
        assert server.store.where(key_of(2)) == "disk"
        before = direct_hits(reader)
        assert_same(reader.get(key_of(2), out=out), chunk(2, SIZE))
        assert direct_hits(reader) == before


def test_reads_racing_overwrites_see_whole_values_that_never_go_back(tmp_path):
    """Writers overwrite 4 keys with numbered values in a small pool (memory reused at once) while readers
    copy them straight out of it: every value read is one that was written, whole, and never older than the
    last one the same reader saw."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    stop = threading.Event()
    bad: list[str] = []
    size = 64 << 10

    def value(key: int, version: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((size,), version, dtype=torch.int32),
                "tag": torch.tensor([key, version], dtype=torch.int64)}

    try:
        with NodeServer(node_config(tmp_path, host="1MiB")).start() as server, \
                tierstore.open({"server": url_of(server)}) as writer, \
                tierstore.open({"server": url_of(server)}) as reader:
            for k in range(4):
                assert writer.put(key_of(k), value(k, 0))

            def write() -> None:
                version = 0
                while not stop.is_set():
                    version += 1
                    for k in range(4):
                        writer.put(key_of(k), value(k, version))

            def read(me: int) -> None:
                out = {"x": torch.empty(size, dtype=torch.int32), "tag": torch.empty(2, dtype=torch.int64)}
                last = [0] * 4
                while not stop.is_set():
                    k = (me + last[0]) % 4
                    got = reader.get(key_of(k), out=out)
                    if got is None:
                        continue
                    key, version = got["tag"].tolist()
                    if key != k or not bool((got["x"] == version).all()) or version < last[k]:
                        bad.append(f"key {k}: tag {key}/{version}, x {got['x'].unique()[:4].tolist()}, "
                                   f"last {last[k]}")
                        return
                    last[k] = version

            threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            time.sleep(6)
            stop.set()
            for t in threads:
                t.join(30)
            assert not bad, bad[:3]
            stats = reader.stats()["client"]
            assert stats["direct_hits"] > 100 and stats["direct_misses"] > 10, stats  # both paths were raced
    finally:
        sys.setswitchinterval(old)


def test_chunks_read_straight_from_the_pool_stay_recent_in_its_lru(tmp_path):
    with NodeServer(node_config(tmp_path, host="1MiB")).start() as server, \
            tierstore.open({"server": url_of(server)}) as store:
        hot = chunk(0, SIZE)
        assert store.put(key_of(0), hot)
        out = outs_like(hot)
        store.get(key_of(0), out=out)
        for i in range(1, 40):  # 4 MB through a 1 MiB host tier while key 0 is read between the puts
            assert_same(store.get(key_of(0), out=out), hot)
            assert store.put(key_of(i), chunk(i, SIZE))
        assert direct_hits(store) >= 35
        assert server.store.where(key_of(0)) == "host"
        assert server.store.where(key_of(1)) == "disk"


def test_after_a_server_restart_the_new_server_is_asked_and_not_the_old_pool(tmp_path):
    config = node_config(tmp_path)
    value = chunk(1, SIZE)
    out = outs_like(value)
    with NodeServer(config).start() as first:
        store = tierstore.open({"server": url_of(first)})
        assert store.put(key_of(1), value)
        store.get(key_of(1), out=out)
        assert_same(store.get(key_of(1), out=out), value)
        assert direct_hits(store) == 1
    try:
        with NodeServer(config).start() as second, tierstore.open({"server": url_of(second)}) as other:
            assert other.put(key_of(1), chunk(2, SIZE))  # a newer value on the new server
            deadline = time.monotonic() + 5
            while (got := store.get(key_of(1), out=out)) is None and time.monotonic() < deadline:
                time.sleep(0.05)  # a miss until the client has reconnected, never the old pool's value
            assert_same(got, chunk(2, SIZE))
    finally:
        store.close()
