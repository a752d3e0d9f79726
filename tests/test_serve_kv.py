"""KV through a node server with the fewest copies: ``load_into`` scatters straight from the server's pool (lent
under a lease, its stamps checked after the copy), ``save_from`` gathers straight into the connection's staging
area (a reservation there, committed by one put). Nothing of an aborted, failed or killed save is visible, a
chunk whose lease ran out mid-copy is never used with another value's bytes, and bad requests get an error
reply while the server goes on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import test_kv_one_copy as one_copy
import torch
from test_kv_one_copy import BS, LAYERS, NS, C, D, H, caches, save_failing_mid_gather  # the in-process tests' shapes

import tierstore
from tierstore import KVCacheStore
from tierstore.kv import gather_layers, rows, transfer
from tierstore.serve import connection, protocol
from tierstore.serve.client import ServerStore
from tierstore.serve.server import NodeServer


def node_config(tmp_path, host="32MiB", **serve):
    return {"tiers": [{"kind": "host", "capacity": host, "pinned": False},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}],
            "serve": {"socket": str(tmp_path / "run" / "ts.sock"), **serve}}


@pytest.fixture
def node(tmp_path):
    server = NodeServer(node_config(tmp_path)).start()
    yield server
    server.close()


def client(server) -> ServerStore:
    return tierstore.open({"server": f"unix://{server.config.socket}", "timeout": 30})  # a busy machine is no miss


def saved(store, chunks: int, seed: int):
    """A KVCacheStore over ``store`` and ``chunks`` chunks of KV saved from vLLM caches: (kv, tokens, table, src)."""
    kv = KVCacheStore(store, NS, chunk_tokens=C)
    n = chunks * C
    table = list(range(n // BS))
    src = caches(len(table), seed=seed)
    assert kv.save_from(list(range(n)), src, "vllm", table) == n
    return kv, n, table, src


def loads_back(kv, n: int, table: list[int], src: list[torch.Tensor]) -> None:
    dst = caches(len(table), seed=None)
    assert kv.load_into(list(range(n)), dst, "vllm", table) == n
    assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))


def host(server) -> dict:
    return server.store.stats()["tiers"]["host"]


def settle(server, clients: int) -> None:
    """Wait until the server has ``clients`` clients and no lease (what closed ones held goes back as they close)."""
    deadline = time.monotonic() + 10
    while (server.stats()["clients"] != clients or server.stats()["leases"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats()["clients"] == clients and server.stats()["leases"] == 0


# ---------------------------------------------------------------------- round trips
def test_kv_round_trips_bit_exact_through_the_server_lent_and_reserved_for_every_layout(node, monkeypatch, tmp_path):
    """save_from then load_into through the server, random layouts, tables, chunk sizes and windows (the in-process
    store's property, test_kv_one_copy's, over a client of the server): the bytes come back exactly, the loads
    read nothing through get (every chunk lent from the pool) and the saves put nothing through put_many (every
    chunk gathered into a reservation)."""
    staged: list[str] = []
    for name in ("get_many_async", "put_many"):
        real = getattr(ServerStore, name)
        monkeypatch.setattr(ServerStore, name, lambda self, *a, _real=real, _name=name, **kw:
                            staged.append(_name) or _real(self, *a, **kw))
    opened: list[ServerStore] = []
    monkeypatch.setattr(one_copy, "host_store",  # its property, over a client of the server
                        lambda capacity=None, disk=None: opened.append(client(node)) or opened[-1])
    one_copy.test_load_into_after_save_from_round_trips_bit_exact_for_random_tables_and_layouts(tmp_path)
    (store,) = opened  # closed by the property's own ``with``
    assert store._counts["lent_chunks"] > 0 and store._counts["reserved_chunks"] > 0
    assert staged == []
    settle(node, 0)
    assert host(node)["pinned"] == 0


def test_a_save_larger_than_the_staging_area_goes_in_reservations_that_fit(tmp_path):
    """A staging area of 3 chunks: a 10-chunk save is gathered into it three chunks at a time."""
    chunk_bytes = 2 * C * H * D * 4 * LAYERS
    with NodeServer(node_config(tmp_path, staging=3 * chunk_bytes)).start() as server, client(server) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        n = 10 * C
        table = list(range(n // BS))
        src = caches(len(table), seed=4)
        old = transfer.STAGING_BYTES
        transfer.STAGING_BYTES = chunk_bytes  # one chunk per window
        try:
            assert kv.save_from(list(range(n)), src, "vllm", table) == n
        finally:
            transfer.STAGING_BYTES = old
        assert store.stats()["client"]["reserved_chunks"] == 10
        loads_back(kv, n, table, src)


def test_a_server_that_does_not_lend_is_read_and_written_the_usual_way(tmp_path, monkeypatch):
    """A server from before ``lend`` (no features in its hello): loads and saves still round-trip."""
    monkeypatch.setattr(connection, "FEATURES", ())
    with NodeServer(node_config(tmp_path)).start() as server, client(server) as store:
        loads_back(*saved(store, 4, seed=2))
        assert store.stats()["client"]["lent_chunks"] == 0


# ---------------------------------------------------------------------- saves that do not finish
def test_an_aborted_or_failed_save_through_the_server_leaves_nothing_visible(node, monkeypatch):
    with client(node) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        n = 4 * C
        tokens, table, src = list(range(n)), list(range(n // BS)), caches(n // BS, seed=1)
        store.flush()
        before = host(node)
        like = {f"layer.{j}": torch.empty(2, C, H, D, device="meta") for j in range(LAYERS)}
        keys = kv.keys(tokens)
        with store.reserve([(k, like) for k in keys]) as r:  # filled, then left without a commit
            for t in r.tensors:
                for v in t.values():
                    v.fill_(7)
            assert store.lookup(keys) == 0
        r = store.reserve([(k, like) for k in keys])
        for t in r.tensors:
            for v in t.values():
                v.fill_(8)
        assert r.commit([True, False, False, False]) == [True, False, False, False]
        assert r.commit() == [False] * 4  # once only
        assert store.lookup(keys) == 1 and all(bool((v == 8).all()) for v in store.get(keys[0]).values())
        store.delete(keys)
        store.flush()
        save_failing_mid_gather(monkeypatch, kv, tokens, src, table)
        assert kv.lookup(tokens) == 0 and store.contains_many(keys) == [False] * 4
        after = host(node)
        for what in ("objects", "used_bytes", "reserved_bytes", "pinned"):
            assert after[what] == before[what], what
        assert kv.save_from(tokens, src, "vllm", table) == n  # the connection it held is usable again
        loads_back(kv, n, table, src)


KILLED_SAVER = """
import sys, time, torch, tierstore
from tierstore.serve.client import ServerStore
from tierstore.kv.rows import PagedTransfer
store = tierstore.open({"server": sys.argv[1]})
gather = PagedTransfer.gather
def mapped_from(address):
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line.strip()
def stuck(self, layer, pieces, staged):
    gather(self, layer, pieces, staged)
    where = mapped_from(staged[0].data_ptr())  # the server's shared staging area, not memory of this process's
    print("reserved" if "memfd:tierstore-staging" in where else f"gathered into {where!r}", flush=True)
    time.sleep(60)  # SIGKILLed here, its reservation filled in part
PagedTransfer.gather = stuck
kv = tierstore.KVCacheStore(store, tierstore.KVNamespace(model="m", dtype="float32"), chunk_tokens=%d)
n = 4 * %d
kv.save_from(list(range(1000, 1000 + n)), [torch.ones(2, n // %d, %d, %d, %d) for _ in range(%d)], "vllm",
             list(range(n // %d)))
"""


def killed_mid_save(script: str, argvs: list[list[str]], while_filling=lambda: None) -> None:
    """Run ``script`` once per argv; once every one says it is gathering into its reservation, call
    ``while_filling``, then SIGKILL them all."""
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, text=True)
             for argv in argvs]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["reserved"] * len(procs)
        while_filling()
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
            p.stdout.close()


def test_a_client_killed_mid_reservation_leaves_nothing_and_holds_nothing(node):
    with client(node) as store:
        kv, n, table, mine = saved(store, 4, seed=5)
        store.flush()  # write-back done: it pins what it copies down
        before = host(node)
        script = KILLED_SAVER % (C, C, BS, BS, H, D, LAYERS, BS)
        url = f"unix://{node.config.socket}"
        killed_mid_save(script, [[url]] * 3)
        settle(node, 1)
        theirs = list(range(1000, 1000 + n))
        assert kv.lookup(theirs) == 0
        after = host(node)
        for what in ("objects", "used_bytes", "reserved_bytes", "pinned"):
            assert after[what] == before[what], what
        loads_back(kv, n, table, mine)  # the other keys are intact
        assert kv.save_from(theirs, mine, "vllm", table) == n  # and the killed clients' keys can be saved


# ---------------------------------------------------------------------- the stamp rule
def test_a_chunk_whose_lease_runs_out_mid_load_never_scatters_another_values_bytes(tmp_path, monkeypatch):
    """Leases of 20 ms and a scatter slowed past them, while another client overwrites the same keys with other
    values, deletes them and fills the small pool with other chunks (so freed runs are reused at once): every
    chunk a load reports lands whole, as one of the values written — never a mix, never another chunk's bytes."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    n = 4 * C
    table = list(range(n // BS))
    values = [caches(len(table), seed=s) for s in (1, 2)]
    chunk_bytes = 2 * C * H * D * 4 * LAYERS
    copy_rows_in = rows._copy_rows_in

    def slow(flat, index, src, *words):
        if threading.current_thread().name == "loader":
            time.sleep(0.03)  # past the lease: the server takes it back and the writer reuses the memory
        copy_rows_in(flat, index, src, *words)

    monkeypatch.setattr(rows, "_copy_rows_in", slow)
    config = node_config(tmp_path, host=6 * chunk_bytes + 8192, lease_ttl=0.02)
    config["tiers"] = config["tiers"][:1]
    try:
        with NodeServer(config).start() as server, client(server) as reader, client(server) as writing:
            kv = KVCacheStore(reader, NS, chunk_tokens=C)
            wkv = KVCacheStore(writing, NS, chunk_tokens=C)
            tokens = list(range(n))
            assert wkv.save_from(tokens, values[0], "vllm", table) == n
            stop = threading.Event()
            failures: list[BaseException] = []
            outcome = {"loads": 0, "short": 0}

            def writer():
                i = 0
                try:
                    while not stop.is_set():
                        i += 1
                        writing.delete(wkv.keys(tokens)[i % 4:])
                        wkv.save(tokens, gather_layers(values[i % 2], "vllm", table, 0, n))
                        filler = torch.full((2, C, H, D), float(i))
                        other = KVCacheStore(writing, NS.replace(tenant=f"t{i % 3}"), chunk_tokens=C)
                        other.save(list(range(n)), [torch.cat([filler] * 4, 1)] * LAYERS)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)

            def loader():
                try:
                    deadline = time.monotonic() + 4.0
                    while time.monotonic() < deadline:
                        dst = caches(len(table), seed=None)
                        got = kv.load_into(tokens, dst, "vllm", table)
                        outcome["loads"] += 1
                        outcome["short"] += got < n
                        out = gather_layers(dst, "vllm", table, 0, n)
                        for c in range(got // C):
                            mine = [o[:, c * C:(c + 1) * C] for o in out]
                            assert any(all(torch.equal(m, w[:, c * C:(c + 1) * C]) for m, w in zip(
                                mine, gather_layers(v, "vllm", table, 0, n), strict=True)) for v in values), c
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)

            threads = [threading.Thread(target=writer), threading.Thread(target=loader, name="loader")]
            for t in threads:
                t.start()
            threads[1].join(30)
            stop.set()
            threads[0].join(30)
            assert not failures, failures[0]
            assert outcome["loads"] > 3 and reader.stats()["client"]["lent_chunks"] > 0
            assert server.stats()["expired_leases"] > 0  # the leases did run out under the loads
    finally:
        sys.setswitchinterval(old)


# ---------------------------------------------------------------------- bad input
def raw(server):
    import os
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(server.config.socket)
    sock.sendall(protocol.encode({"op": "hello", "version": protocol.VERSION}))
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
    for fd in fds:
        os.close(fd)
    hello = protocol.Reader(sock, data).frame()
    assert hello["ok"] and "lend" in hello["features"]
    return sock


def ask(sock, msg):
    sock.sendall(protocol.encode(msg))
    return protocol.Reader(sock).frame()


def test_bad_lends_and_staged_puts_get_an_error_reply_and_the_server_goes_on(node):
    with client(node) as store:
        kv, n, table, src = saved(store, 2, seed=3)
        key = kv.keys(list(range(n)))[0]
        sock = raw(node)
        staging = node.config.staging
        bad = [{"op": "lend", "keys": "zz"}, {"op": "lend", "keys": "ab"}, {"op": "lend"},
               {"op": "lend", "keys": "00" * 32 * (protocol.MAX_KEYS + 1)},
               {"op": "put", "items": [{"k": key.hex(), "t": [["x", "float32", [4], staging - 8]]}]},
               {"op": "put", "items": [{"k": key.hex(), "t": [["x", "float32", [-1], 0]]}]},
               {"op": "put", "items": [{"k": key.hex(), "t": [["x", "nope", [4], 0]]}]},
               {"op": "put", "items": [{"k": "12", "t": [["x", "float32", [4], 0]]}]}]
        for msg in bad:
            reply = ask(sock, msg)
            assert reply["ok"] is False and reply["error"] == "ProtocolError", (msg["op"], reply)
        reply = ask(sock, {"op": "lend", "keys": key.hex() + "11" * 32})
        assert reply["ok"] and reply["items"][1] is None and reply["lease"]
        stamp, word, specs = reply["items"][0]
        assert stamp and word % 8 == 0 and [s[0] for s in specs] == [f"layer.{j}" for j in range(LAYERS)]
        assert node.stats()["leases"] == 1
        sock.close()
        settle(node, 1)
        with pytest.raises(tierstore.InvalidInputError):  # a like the client cannot lay out
            store.reserve([(key, {"": torch.empty(3, device="meta")})])
        too_big = store.reserve([(key, {"x": torch.empty(staging + 1, dtype=torch.uint8, device="meta")})])
        assert too_big.tensors == [None] and too_big.commit() == [False]
        loads_back(kv, n, table, src)  # and the server serves on
        assert json.dumps(store.stats()["client"])
