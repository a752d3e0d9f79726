"""A node server with ``serve.trusted_writers``: its clients map the pool writable and a KV save gathers straight
into pool runs the server reserved (one copy), committed with one request. Nothing of an aborted, failed, killed
or timed-out reservation is visible or held; a reservation under pressure evicts like a put; and the default
server still hands out a pool no client can map writable."""

from __future__ import annotations

import mmap
import os
import socket
import sys
import threading
import time

import pytest
import test_kv_one_copy as one_copy
import torch
from test_kv_one_copy import BS, LAYERS, NS, C, D, H, caches, save_failing_mid_gather
from test_serve_kv import KILLED_SAVER, client, host, killed_mid_save, loads_back, node_config, saved, settle

import tierstore
from tierstore import ConfigError, KVCacheStore
from tierstore.kv.rows import PagedTransfer
from tierstore.serve import client as client_module
from tierstore.serve import protocol
from tierstore.serve.client import ServerStore
from tierstore.serve.connection import Connection
from tierstore.serve.server import NodeServer

CHUNK = 2 * C * H * D * 4 * LAYERS  # bytes of one chunk of the KV below


@pytest.fixture
def trusted(tmp_path):
    server = NodeServer(node_config(tmp_path, trusted_writers=True)).start()
    yield server
    server.close()


def like() -> dict[str, torch.Tensor]:
    return {f"layer.{j}": torch.empty(2, C, H, D, device="meta") for j in range(LAYERS)}


def mapped_from(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.strip()
    return ""


def unchanged(server, before: dict) -> None:
    after = host(server)
    for what in ("objects", "used_bytes", "reserved_bytes", "pinned"):
        assert after[what] == before[what], what
    assert server.stats()["reservations"] == 0 and server.stats()["reserved_bytes"] == 0


def hello_fds(server) -> tuple[socket.socket, dict, list[int]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(server.config.socket)
    sock.sendall(protocol.encode({"op": "hello", "version": protocol.VERSION}))
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
    return sock, protocol.Reader(sock, data).frame(), fds


# ---------------------------------------------------------------------- the mode
@pytest.mark.parametrize("trust", [False, True])
def test_only_a_trusted_writers_server_hands_out_a_pool_clients_can_map_writable(tmp_path, trust):
    with NodeServer(node_config(tmp_path, trusted_writers=trust)).start() as server:
        sock, hello, fds = hello_fds(server)
        try:
            pool_fd, size = fds[0], hello["pool"]
            assert ("reserve" in hello["features"]) is trust
            if trust:
                mmap.mmap(pool_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
            else:
                with pytest.raises(PermissionError):
                    mmap.mmap(pool_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                try:  # nor a descriptor reopened read-write (root may reopen it; the seal still refuses)
                    again = os.open(f"/proc/self/fd/{pool_fd}", os.O_RDWR)
                except PermissionError:
                    pass
                else:
                    try:
                        with pytest.raises(PermissionError):
                            mmap.mmap(again, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    finally:
                        os.close(again)
                sock.sendall(protocol.encode({"op": "reserve", "keys": "00" * 32, "outs": [0], "specs": [[]]}))
                reply = protocol.Reader(sock).frame()
                assert reply["ok"] is False and "unknown message type" in reply["message"]
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()
        assert server.stats()["trusted_writers"] is trust


def test_trusted_writers_must_be_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match="trusted_writers"):
        NodeServer(node_config(tmp_path, trusted_writers="yes"))


# ---------------------------------------------------------------------- one copy
def test_kv_round_trips_bit_exact_gathered_straight_into_the_pool(trusted, monkeypatch, tmp_path):
    """The in-process store's round-trip property over a client of a trusted-writers server: every save is
    gathered into the server's pool itself (the gather's target is the client's mapping of the pool's memfd), never
    through a put, and the server copies nothing (no put request)."""
    targets: set[int] = set()
    mapped: set[str] = set()
    puts: list[int] = []
    gather = PagedTransfer.gather

    def watched(self, layer, pieces, staged):
        targets.update(t.data_ptr() for t in staged)
        return gather(self, layer, pieces, staged)

    monkeypatch.setattr(PagedTransfer, "gather", watched)
    real_put = Connection._put
    monkeypatch.setattr(Connection, "_put", lambda self, msg: puts.append(1) or real_put(self, msg))
    monkeypatch.setattr(ServerStore, "put_many", lambda *a, **kw: pytest.fail("a save went through put_many"))
    opened: list[ServerStore] = []
    monkeypatch.setattr(one_copy, "host_store", lambda capacity=None, disk=None: opened.append(client(trusted))
                        or opened[-1])
    one_copy.test_load_into_after_save_from_round_trips_bit_exact_for_random_tables_and_layouts(tmp_path)
    (store,) = opened
    assert store._counts["reserved_chunks"] > 0 and store._counts["lent_chunks"] > 0
    server = trusted.pool.buffer  # the server's own mapping: the client gathers into its own one of the same memfd
    assert targets and not any(server.data_ptr() <= p < server.data_ptr() + server.numel() for p in targets)
    assert all("memfd:tierstore-host-pool" in m for m in mapped) and puts == []
    settle(trusted, 0)
    assert trusted.stats()["reservations"] == 0 and host(trusted)["reserved_bytes"] == 0


# ---------------------------------------------------------------------- reservations that do not finish
def test_an_aborted_or_failed_reservation_leaves_nothing_visible_and_gives_the_pool_back(trusted, monkeypatch):
    with client(trusted) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        n = 4 * C
        tokens, table, src = list(range(n)), list(range(n // BS)), caches(n // BS, seed=1)
        keys = kv.keys(tokens)
        before = host(trusted)
        with store.reserve([(k, like()) for k in keys]) as r:  # filled, then left without a commit
            for t in r.tensors:
                for v in t.values():
                    v.fill_(7)
            assert store.lookup(keys) == 0 and store.get(keys[0]) is None
            assert trusted.stats()["reservations"] == 1 and host(trusted)["reserved_bytes"] > 0
        unchanged(trusted, before)
        r = store.reserve([(k, like()) for k in keys])
        r.abort()
        r.abort()  # once only
        assert r.commit() == [False] * 4
        unchanged(trusted, before)
        r = store.reserve([(k, like()) for k in keys])
        for t in r.tensors:
            for v in t.values():
                v.fill_(8)
        assert r.commit([True, False, False, False]) == [True, False, False, False]
        assert r.commit() == [False] * 4
        assert store.lookup(keys) == 1 and all(bool((v == 8).all()) for v in store.get(keys[0]).values())
        store.delete(keys)
        store.flush()
        before = host(trusted)
        save_failing_mid_gather(monkeypatch, kv, tokens, src, table)
        assert kv.lookup(tokens) == 0 and store.contains_many(keys) == [False] * 4
        unchanged(trusted, before)
        assert kv.save_from(tokens, src, "vllm", table) == n  # the connection it held is usable again
        loads_back(kv, n, table, src)


def test_a_reservation_of_more_keys_than_a_request_names_reserves_the_first_and_commits_them(trusted,
                                                                                             monkeypatch):
    monkeypatch.setattr(client_module, "MAX_KEYS", 3)
    with client(trusted) as store:
        keys = [tierstore.ChunkKey.from_tensors({"k": torch.full((1,), float(i))}) for i in range(5)]
        r = store.reserve([(k, like()) for k in keys])
        assert [t is not None for t in r.tensors] == [True] * 3 + [False] * 2
        for i, t in enumerate(r.tensors[:3]):
            for v in t.values():
                v.fill_(i)
        assert r.commit([True, False, True, True, True]) == [True, False, True, False, False]
        assert [store.contains(k) for k in keys] == [True, False, True, False, False]
        assert all(bool((v == 2).all()) for v in store.get(keys[2]).values())
        assert trusted.stats()["reservations"] == 0 and host(trusted)["reserved_bytes"] == 0


def test_a_client_killed_mid_fill_leaves_nothing_and_holds_nothing(trusted):
    with client(trusted) as store:
        kv, n, table, mine = saved(store, 4, seed=5)
        store.flush()  # write-back done: it pins what it copies down
        before = host(trusted)
        # each its own keys (a second reservation of a key waits for the first, then puts the usual way)
        script = (KILLED_SAVER % (C, C, BS, BS, H, D, LAYERS, BS)).replace(
            "memfd:tierstore-staging", "memfd:tierstore-host-pool").replace("1000", "int(sys.argv[2])")
        url = f"unix://{trusted.config.socket}"

        def held() -> None:  # gathering into the pool, each in its reservation
            assert trusted.stats()["reservations"] == 3

        killed_mid_save(script, [[url, str(1000 * (i + 1))] for i in range(3)], held)
        settle(trusted, 1)
        assert all(kv.lookup(list(range(1000 * (i + 1), 1000 * (i + 1) + n))) == 0 for i in range(3))
        theirs = list(range(1000, 1000 + n))
        unchanged(trusted, before)
        loads_back(kv, n, table, mine)  # the other keys are intact
        assert kv.save_from(theirs, mine, "vllm", table) == n  # and the killed clients' keys can be saved
        loads_back(kv, n, table, mine)


def test_a_reservation_older_than_lease_ttl_is_taken_back_and_its_commit_stores_nothing(tmp_path):
    with NodeServer(node_config(tmp_path, trusted_writers=True, lease_ttl=0.2)).start() as server, \
            client(server) as store:
        keys = [tierstore.ChunkKey.from_tensors({"k": torch.full((1,), float(i))}) for i in range(3)]
        before = host(server)
        r = store.reserve([(k, like()) for k in keys])
        assert all(t is not None for t in r.tensors)
        deadline = time.monotonic() + 10
        while not server.stats()["expired_reservations"] and time.monotonic() < deadline:  # counted once taken back
            time.sleep(0.02)
        assert server.stats()["expired_reservations"] == 1
        unchanged(server, before)
        assert r.commit() == [False] * 3 and store.lookup(keys) == 0
        assert store.put_many([(keys[0], {"x": torch.ones(4)})]) == [True]  # the connection goes on


# ---------------------------------------------------------------------- pressure
def test_a_reservation_under_pressure_evicts_like_a_put(tmp_path):
    """A host tier three quarters full over a disk tier, then a save of as much again: its reservation takes room
    by evicting the least recently used chunks, writing the dirty ones down first (nothing is lost), and the host
    tier never holds more than its capacity."""
    per = 4 << 20
    with NodeServer(node_config(tmp_path, host=per, trusted_writers=True)).start() as server, \
            client(server) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        n = C * (3 * per // 4 // CHUNK)
        table = list(range(n // BS))
        old, new = caches(len(table), seed=5), caches(len(table), seed=6)
        assert kv.save_from(list(range(n)), old, "vllm", table) == n
        assert host(server)["evictions"] == 0
        assert kv.save_from(list(range(n, 2 * n)), new, "vllm", table) == n
        assert store.stats()["client"]["reserved_chunks"] == 2 * n // C  # every chunk reserved in the pool
        h = host(server)
        assert h["used_bytes"] <= h["capacity_bytes"] and h["evictions"] > 0
        where = store.locate(kv.keys(list(range(2 * n))))
        assert where[0] == "disk" and where[-1] == "host"  # the oldest went down, the newest stay on top
        for first, src in ((0, old), (n, new)):  # every chunk, from whichever tier holds it
            dst = caches(len(table), seed=None)
            assert kv.load_into(list(range(first, first + n)), dst, "vllm", table) == n
            assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))


# ---------------------------------------------------------------------- readers and writers at once
def test_readers_see_a_reserved_value_whole_or_not_at_all_while_writers_race(trusted):
    """Writers in several threads and two processes' worth of connections reserve, fill (slowly, layer by layer)
    and commit or abort values of the same keys while readers get them: every value read is one writer's whole
    committed value, never a reservation's bytes before its commit, never a mix."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    keys = [tierstore.ChunkKey.from_tensors({"race": torch.full((1,), float(i))}) for i in range(4)]
    committed: set[float] = set()
    aborted: set[float] = set()
    bad: list[str] = []
    stop = time.monotonic() + 3
    try:
        with client(trusted) as writers, client(trusted) as readers:
            def write(w: int) -> None:
                n = 0
                while time.monotonic() < stop:
                    n += 1
                    value = float(w * 100_000 + n)
                    keep = n % 3 != 0
                    (aborted if not keep else committed).add(value)
                    with writers.reserve([(k, like()) for k in keys]) as r:
                        for t in r.tensors:
                            for v in (t or {}).values():
                                v.fill_(value)
                                time.sleep(0)  # a reader may run between layers
                        if keep:
                            r.commit()

            def read() -> None:
                while time.monotonic() < stop:
                    for got in readers.get_many(keys):
                        if got is None:
                            continue
                        values = {float(x) for v in got.values() for x in v.unique()}
                        if len(values) != 1:
                            bad.append(f"mixed {sorted(values)[:4]}")
                        elif values & aborted - committed or not values <= committed:
                            bad.append(f"never committed {values}")

            threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
            threads += [threading.Thread(target=read) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not bad, bad[:5]
            assert all(writers.get(k) is not None for k in keys) and len(committed) > 10
    finally:
        sys.setswitchinterval(old)
    settle(trusted, 0)
    assert trusted.stats()["reservations"] == 0 and host(trusted)["reserved_bytes"] == 0
