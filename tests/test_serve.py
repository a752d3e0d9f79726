"""``tierstore serve``: the node server and its client, with real sockets, shared memory and processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import tierstore
from tierstore import errors
from tierstore.serve import protocol
from tierstore.serve.server import NodeServer
from tierstore.testing.data import assert_same, chunk, key_of

SIZE = 100_000


def node_config(tmp_path, host="8MiB", **serve):
    return {"tiers": [{"kind": "host", "capacity": host, "pinned": False},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}],
            "on_pressure": "keep", "serve": {"socket": str(tmp_path / "run" / "ts.sock"), **serve}}


@pytest.fixture
def node(tmp_path):
    server = NodeServer(node_config(tmp_path)).start()
    yield server
    server.close()


def url_of(server):
    return f"unix://{server.config.socket}"


def raw_client(server, hello=True):
    """A socket speaking the protocol by hand (what a misbehaving client sends)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(server.config.socket)
    if hello:
        sock.sendall(protocol.encode({"op": "hello", "version": protocol.VERSION}))
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
        for fd in fds:
            os.close(fd)
        assert protocol.Reader(sock, data).frame()["ok"]
    return sock


def ask(sock, msg):
    sock.sendall(protocol.encode(msg) if isinstance(msg, dict) else msg)
    return protocol.Reader(sock).frame()


# ---------------------------------------------------------------------- the API through the server
def test_the_store_api_through_the_server_returns_exact_bytes(node):
    with tierstore.open({"server": url_of(node)}) as store:
        items = [(key_of(i), chunk(i, SIZE)) for i in range(120)]  # 12 MB: most go to disk past the 8 MiB host
        assert store.put_many(items) == [True] * len(items)
        keys = [k for k, _ in items]
        for (_, value), got in zip(items, store.get_many(keys), strict=True):
            assert_same(got, value)
        outs = [{n: torch.empty_like(t) for n, t in v.items()} for _, v in items]
        got = store.get_many(keys, out=outs)
        for (_, value), g, o in zip(items, got, outs, strict=True):
            assert_same(g, value)
            assert all(g[n] is o[n] for n in o)  # filled the caller's buffers
        assert {store.where(k) for k in keys} == {"host", "disk"}
        assert store.lookup(keys) == len(keys) and store.contains(keys[0])
        assert store.get(key_of(999)) is None and not store.contains(key_of(999))
        assert store.delete(keys[:3]) == 3 and store.contains_many(keys[:3]) == [False] * 3
        pin = store.pin(keys[3:6])
        assert pin.ready == 3 and node.stats()["pins"] == 1
        store.release(pin)
        assert node.stats()["pins"] == 0
        assert store.flush(timeout=30).dropped == {}
        assert store.prefetch(keys[50:52]).result(timeout=30) == 2
        stats = store.stats()
        assert stats["server"]["clients"] == 1 and stats["tiers"]["host"]["hits"] > 0
        assert node.stats()["leases"] == 0  # every get gave its lease back


def test_batches_larger_than_the_staging_area_go_in_several_requests_in_order(tmp_path):
    with NodeServer(node_config(tmp_path, host="1MiB", staging="512KiB")).start() as server, \
            tierstore.open({"server": url_of(server)}) as store:
        items = [(key_of(i % 20), chunk(i, SIZE)) for i in range(30)]  # 3 MB; keys 0-9 put twice, last wins
        assert store.put_many(items) == [True] * 30
        keys = [key_of(i) for i in range(20)]
        want = {k: v for k, v in items}
        for got, k in zip(store.get_many(keys), keys, strict=True):  # mostly from disk, staged 5 at a time
            assert_same(got, want[k])
        outs = [{n: torch.empty_like(t) for n, t in want[k].items()} for k in keys]
        for got, k in zip(store.get_many(keys, out=outs), keys, strict=True):
            assert_same(got, want[k])
        huge = chunk(99, 600_000)  # larger than the staging area: refused, never half-written
        assert store.put_many([(key_of(99), huge)]) == [False] and store.get(key_of(99)) is None


def test_a_get_with_a_wrong_out_is_a_miss_and_a_put_is_copied_before_it_is_acknowledged(node):
    with tierstore.open({"server": url_of(node)}) as store:
        value = chunk(1, SIZE)
        buf = {n: t.clone() for n, t in value.items()}
        assert store.put(key_of(1), buf)
        for t in buf.values():
            t.fill_(7)  # the caller reuses its buffer; the store kept its own copy
        assert store.put(key_of(2), chunk(2, SIZE))  # and the staging area is reused by the next put
        assert_same(store.get(key_of(1)), value)
        wrong = {n: torch.empty(3, dtype=t.dtype) for n, t in value.items()}
        assert store.get(key_of(1), out=wrong) is None
        with pytest.raises(errors.InvalidInputError):
            store.get_many([key_of(1), key_of(2)], out=[buf, buf])  # overlapping outs, refused before I/O


def test_overwrites_are_never_served_stale_through_the_server(node):
    with tierstore.open({"server": url_of(node)}) as store:
        for version in range(30):
            assert store.put(key_of(5), chunk(version, SIZE))
            assert_same(store.get(key_of(5)), chunk(version, SIZE))


# ---------------------------------------------------------------------- bad input costs the server nothing
def test_bad_frames_get_an_error_reply_and_other_clients_are_not_affected(node):
    with tierstore.open({"server": url_of(node)}) as good:
        assert good.put(key_of(1), chunk(1, SIZE))
        sock = raw_client(node)
        reply = ask(sock, {"op": "no-such-op"})
        assert not reply["ok"] and "unknown message type" in reply["message"]
        reply = ask(sock, struct.pack("<I", 5) + b"{oops")
        assert not reply["ok"] and "not JSON" in reply["message"]
        reply = ask(sock, {"op": "get", "keys": "nope"})
        assert not reply["ok"] and reply["error"] == "ProtocolError"
        reply = ask(sock, {"op": "get", "keys": "00" * 32 * (protocol.MAX_KEYS + 1)})
        assert not reply["ok"]
        bad_put = {"op": "put", "items": [{"k": key_of(9).hex(), "t": [["x", "float32", [10], 1 << 40]]}]}
        reply = ask(sock, bad_put)
        assert not reply["ok"] and "inside the shared region" in reply["message"]
        assert ask(sock, {"op": "ping"})["ok"]  # the connection still works after each error
        reply = ask(sock, struct.pack("<I", protocol.MAX_FRAME + 1))
        assert not reply["ok"] and "over the" in reply["message"]
        assert sock.recv(1) == b""  # an oversized frame ends the connection
        sock.close()
        assert_same(good.get(key_of(1)), chunk(1, SIZE))
        assert node.stats()["protocol_errors"] == 6


def test_a_wrong_protocol_version_is_refused_with_a_reply(node):
    sock = raw_client(node, hello=False)
    reply = ask(sock, {"op": "hello", "version": protocol.VERSION + 1})
    assert not reply["ok"] and "protocol" in reply["message"]
    assert sock.recv(1) == b""
    sock = raw_client(node, hello=False)
    reply = ask(sock, {"op": "get", "keys": []})  # anything before hello
    assert not reply["ok"]


def test_a_client_that_never_reads_is_dropped_and_others_go_on(tmp_path):
    with NodeServer(node_config(tmp_path, send_timeout=0.5)).start() as server, \
            tierstore.open({"server": url_of(server)}) as good:
        assert good.put(key_of(1), chunk(1, SIZE))
        keys = [key_of(i) for i in range(protocol.MAX_KEYS)]
        sock = raw_client(server)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        request = protocol.encode({"op": "contains", "keys": protocol.hexes(keys)})
        for _ in range(400):  # replies pile up unread until the server's send buffer is full
            try:
                sock.sendall(request)
            except OSError:
                break
        deadline = time.monotonic() + 10
        while server.stats()["dropped"] == 0 and time.monotonic() < deadline:
            assert good.put(key_of(2), chunk(2, SIZE))  # served meanwhile
            time.sleep(0.05)
        assert server.stats()["dropped"] == 1
        assert_same(good.get(key_of(1)), chunk(1, SIZE))
        sock.close()


# ---------------------------------------------------------------------- who may connect
def test_the_socket_directory_is_made_private_and_a_wider_or_linked_one_is_refused(tmp_path):
    with NodeServer(node_config(tmp_path)) as server:
        run = os.path.dirname(server.config.socket)
        assert os.stat(run).st_mode & 0o777 == 0o700
        assert os.stat(server.config.socket).st_mode & 0o777 == 0o600
    os.chmod(tmp_path / "run", 0o755)
    with pytest.raises(errors.ConfigError, match="wider"):
        NodeServer(node_config(tmp_path))
    os.rmdir(tmp_path / "run")
    os.mkdir(tmp_path / "elsewhere", 0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / "run")
    with pytest.raises(errors.ConfigError, match="symlink"):
        NodeServer(node_config(tmp_path))


def test_a_live_server_is_not_replaced_and_a_dead_ones_socket_is(tmp_path):
    with NodeServer(node_config(tmp_path)) as server:
        with pytest.raises(errors.ConfigError, match="already listens"):
            NodeServer({**node_config(tmp_path), "tiers": [{"kind": "host", "capacity": "8MiB", "pinned": False}]})
        assert os.path.exists(server.config.socket)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "run" / "ts.sock"))  # a socket file nobody listens on
    stale.close()
    with NodeServer(node_config(tmp_path)).start() as server, tierstore.open({"server": url_of(server)}) as c:
        assert c.put(key_of(1), chunk(1, SIZE))


def test_a_peer_whose_uid_is_not_allowed_is_refused(tmp_path):
    other = os.getuid() + 4242
    with NodeServer(node_config(tmp_path, allow_uids=[other])).start() as server:
        sock = raw_client(server, hello=False)
        reply = protocol.Reader(sock).frame()
        assert not reply["ok"] and "may not use this server" in reply["message"]
        with tierstore.open({"server": url_of(server)}) as store:  # a refused client sees misses
            assert store.put(key_of(1), chunk(1, SIZE)) is False and store.get(key_of(1)) is None
        assert server.stats()["refused"] >= 2


def test_a_client_past_max_clients_is_refused_with_a_reply_and_the_others_go_on(tmp_path):
    with NodeServer(node_config(tmp_path, max_clients=2)).start() as server:
        first, second = raw_client(server), raw_client(server)
        third = raw_client(server, hello=False)
        reply = protocol.Reader(third).frame()
        assert not reply["ok"] and "clients" in reply["message"]
        assert ask(first, {"op": "ping"})["ok"] and ask(second, {"op": "ping"})["ok"]
        first.close()
        deadline = time.monotonic() + 5
        while server.stats()["clients"] > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ask(raw_client(server), {"op": "ping"})["ok"]  # a freed place is taken again


# ---------------------------------------------------------------------- clients that die
KILLED_CLIENT = """
import json, socket, struct, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
def send(msg):
    body = json.dumps(msg).encode(); sock.sendall(struct.pack("<I", len(body)) + body)
def read():
    n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
    return json.loads(sock.recv(n, socket.MSG_WAITALL))
send({"op": "hello", "version": %d})
data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
send({"op": "get", "keys": json.loads(sys.argv[2])})
reply = read()
print("leased" if reply.get("lease") else "no lease", flush=True)
time.sleep(60)  # SIGKILLed here, holding its lease
"""


def test_clients_killed_holding_leases_give_everything_back(node):
    with tierstore.open({"server": url_of(node)}) as store:
        keys = [key_of(i) for i in range(20)]
        assert store.put_many([(k, chunk(i, 10_000)) for i, k in enumerate(keys)]) == [True] * 20
        store.flush()  # write-back done: it pins what it copies down
        host_before = node.store.stats()["tiers"]["host"]
        script = KILLED_CLIENT % protocol.VERSION
        for _ in range(4):  # 100 clients, 25 at a time
            procs = [subprocess.Popen([sys.executable, "-c", script, node.config.socket,
                                       json.dumps(protocol.hexes(keys[j % 20:j % 20 + 5]))],
                                      stdout=subprocess.PIPE, text=True) for j in range(25)]
            assert [p.stdout.readline().strip() for p in procs] == ["leased"] * 25
            assert node.stats()["leases"] == 25 and node.stats()["leased_bytes"] > 0
            assert node.store.stats()["tiers"]["host"]["pinned"] > 0
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait()
                p.stdout.close()
            deadline = time.monotonic() + 10
            while node.stats()["clients"] > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            after = node.stats()
            assert (after["clients"], after["leases"], after["leased_bytes"]) == (1, 0, 0)
            host = node.store.stats()["tiers"]["host"]
            for what in ("pinned", "reserved_bytes", "used_bytes", "objects"):
                assert host[what] == host_before[what], what
        for i, k in enumerate(keys):  # and the data is intact
            assert_same(store.get(k), chunk(i, 10_000))


def test_a_client_drops_its_mapping_of_a_restarted_servers_old_pool(tmp_path):
    """Each server has its own pool: a client kept the old one mapped (its memory alive) across restarts."""
    config = node_config(tmp_path)
    with NodeServer(config).start() as first:
        store = tierstore.open({"server": url_of(first)})
        assert store.put(key_of(1), chunk(1, SIZE)) and store.get(key_of(1)) is not None
        old = first.id
    with NodeServer(config).start() as second:
        deadline = time.monotonic() + 5
        while store.get(key_of(1)) is None and time.monotonic() < deadline:  # from the disk tier, via the new pool
            time.sleep(0.05)
        assert store.get(key_of(1)) is not None
        assert set(store._links.pools) == {second.id} and old not in store._links.pools
        store.close()


def test_a_lease_past_its_ttl_is_taken_back(tmp_path):
    with NodeServer(node_config(tmp_path, lease_ttl=0.3)).start() as server:
        with tierstore.open({"server": url_of(server)}) as store:
            assert store.put(key_of(1), chunk(1, SIZE))
        sock = raw_client(server)
        reply = ask(sock, {"op": "get", "keys": key_of(1).hex()})
        assert reply["lease"] and server.stats()["leases"] == 1
        deadline = time.monotonic() + 5
        while server.stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["leases"] == 0 and server.stats()["expired_leases"] == 1
        assert server.store.stats()["tiers"]["host"]["pinned"] == 0
        sock.close()


# ---------------------------------------------------------------------- the server that dies
def start_server_process(config_path):
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.cli", "serve", "--config", str(config_path)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "tierstore serve" in line, line
    return proc


def test_a_killed_server_turns_calls_into_misses_within_a_second_and_clients_reconnect(tmp_path):
    config = node_config(tmp_path)
    path = tmp_path / "node.json"
    path.write_text(json.dumps(config))
    proc = start_server_process(path)
    url = f"unix://{config['serve']['socket']}"
    slowest, raised, stop = [0.0], [], threading.Event()
    try:
        with tierstore.open({"server": url}) as store:
            assert store.put(key_of(0), chunk(0, SIZE))

            def hammer(seed):
                i = seed
                while not stop.is_set():
                    i += 1
                    t0 = time.monotonic()
                    try:
                        if i % 3:
                            store.get_many([key_of(j) for j in range(i % 7, i % 7 + 4)])
                        else:
                            store.put(key_of(i % 50), chunk(i % 50, SIZE))
                        store.lookup([key_of(0), key_of(1)])
                    except Exception as exc:  # noqa: BLE001 - what the test looks for
                        raised.append(exc)
                    slowest[0] = max(slowest[0], time.monotonic() - t0)

            threads = [threading.Thread(target=hammer, args=(s * 1000,)) for s in range(4)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            time.sleep(1.5)  # calls go on against the dead server
            assert store.get(key_of(0)) is None  # a miss, not an exception
            proc = start_server_process(path)  # the node's disk tier comes back with the restart
            deadline = time.monotonic() + 10
            while store.get(key_of(0)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()
            for t in threads:
                t.join(10)
            assert_same(store.get(key_of(0)), chunk(0, SIZE))  # served again, same client object
            assert not raised, raised[:3]
            assert slowest[0] < 1.0, slowest[0]
            with pytest.raises(errors.ServerUnavailableError):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                store.flush()
    finally:
        stop.set()
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- many processes, exact model
MIXED_CLIENT = """
import random, sys
import torch
import tierstore
from tierstore.serve.places import DIRECT
from tierstore.testing.data import chunk, key_of


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def outs(nbytes):
    return {n: torch.empty(nbytes // 8) for n in ("k", "v")}

me, ops = int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(me)
model = {}
wrong = lost = 0
with tierstore.open({"server": sys.argv[1], "connections": 2, "timeout": 60}) as store:  # slow is not lost
    base = (me + 1) * 100_000
    for n in range(ops):
        i = rng.randrange(40)
        key, r = key_of(base + i), rng.random()
        if r < 0.3:
            v, size = base + i * 1000 + n, rng.choice((4096, 40_000, 300_000))
            if store.put(key, chunk(v, size)):
                model[i] = v, size
        elif r < 0.4:
            ids = rng.sample(range(40), 4)
            vals = {j: base + j * 1000 + n for j in ids}
            acks = store.put_many([(key_of(base + j), chunk(vals[j], 20_000)) for j in ids])
            model.update({j: (vals[j], 20_000) for j, ok in zip(ids, acks) if ok})
        elif r < 0.45:
            store.delete([key])
            model.pop(i, None)
        elif r < 0.75:  # half of them into an out of the chunk's shape (read straight from the pool when known)
            got = store.get(key, out=outs(model[i][1]) if i in model and r < 0.6 else None)
            if i in model:
                lost += got is None
                wrong += got is not None and not same(got, chunk(*model[i]))
            else:
                wrong += got is not None
        else:
            ids = rng.sample(range(40), 6)
            for j, got in zip(ids, store.get_many([key_of(base + j) for j in ids])):
                if j in model:
                    lost += got is None
                    wrong += got is not None and not same(got, chunk(*model[j]))
                else:
                    wrong += got is not None
    for j, (v, size) in model.items():  # every acknowledged chunk is there at the end
        got = store.get(key_of(base + j), out=outs(size))
        lost += got is None
        wrong += got is not None and not same(got, chunk(v, size))
    direct = store.stats()["client"]["direct_hits"]
print(ops, wrong, lost, int(direct > 0 or not DIRECT), flush=True)
"""


@pytest.mark.slow
def test_eight_client_processes_of_mixed_ops_see_no_wrong_and_no_lost_chunk(tmp_path):
    # the suite runs 1,500 ops per client; TIERSTORE_SERVE_OPS=10000 is the full run (about 10 minutes here)
    ops = int(os.environ.get("TIERSTORE_SERVE_OPS", "1500"))
    with NodeServer(node_config(tmp_path, host="16MiB")).start() as server:
        procs = [subprocess.Popen([sys.executable, "-c", MIXED_CLIENT, url_of(server), str(me), str(ops)],
                                  stdout=subprocess.PIPE, text=True) for me in range(8)]
        results = [p.communicate(timeout=1500)[0].split() for p in procs]
        assert [p.returncode for p in procs] == [0] * 8
        assert results == [[str(ops), "0", "0", "1"]] * 8  # 0 wrong, 0 lost, some read straight from the pool
        assert server.stats()["leases"] == 0 and server.store.stats()["tiers"]["host"]["pinned"] == 0


# ---------------------------------------------------------------------- KV through the server
def test_kv_saved_by_one_process_loads_into_another_ones_paged_cache_through_the_server(node):
    """Two engine processes on one node: the second loads the first's prefix from the node's host tier."""
    from tierstore import KVCacheStore, KVNamespace

    heads, dim, layers, chunk_tokens, block = 2, 4, 3, 16, 5
    ns = KVNamespace(model="m", dtype="float32")
    n = 3 * chunk_tokens
    table = list(range(-(-n // block)))
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(2, len(table), block, heads, dim, generator=g) for _ in range(layers)]
    tokens = list(range(500, 500 + n))
    with tierstore.open({"server": url_of(node)}) as first:
        assert KVCacheStore(first, ns, chunk_tokens=chunk_tokens).save_from(tokens, src, "vllm", table) == n
    with tierstore.open({"server": url_of(node)}) as second:
        kv = KVCacheStore(second, ns, chunk_tokens=chunk_tokens)
        assert kv.lookup(tokens) == n
        for layerwise in (False, True):
            dst = [torch.zeros_like(c) for c in src]
            got = kv.load_into(tokens, dst, "vllm", table, layerwise=layerwise)
            assert (got.result() if layerwise else got) == n
            for a, b in zip(src, dst, strict=True):
                assert torch.equal(a.reshape(2, -1, heads, dim)[:, :n], b.reshape(2, -1, heads, dim)[:, :n])
    deadline = time.monotonic() + 5  # what the closed clients' connections held goes back as they close
    while node.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.stats()["leases"] == 0 and node.store.stats()["tiers"]["host"]["pinned"] == 0


# ---------------------------------------------------------------------- weights through the server
WEIGHTS_CLIENT = """
import json, sys
import tierstore
from tierstore import weights
stats = {}
with tierstore.open({"server": sys.argv[1]}) as store:
    got = weights.load(sys.argv[2], store=store, block_size=60_000, stats=stats)
print(json.dumps({"stats": {k: stats[k] for k in ("source_reads", "cache_hits", "cache_misses")},
                  "sums": {k: float(v.double().sum()) for k, v in got.items()}}), flush=True)
"""


def test_a_checkpoint_is_read_once_per_node_however_many_processes_load_it(node, tmp_path):
    from tierstore.weights.synth import write_llm_checkpoint

    write_llm_checkpoint(str(tmp_path / "ckpt"), 2_000_000, shard_size=1_000_000)

    def load_in_a_process():
        out = subprocess.run([sys.executable, "-c", WEIGHTS_CLIENT, url_of(node), str(tmp_path / "ckpt")],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.splitlines()[-1])

    first = load_in_a_process()
    assert first["stats"]["source_reads"] > 0 and first["stats"]["cache_misses"] > 0
    for _ in range(2):  # every other process on the node loads it from the server, not from the checkpoint
        again = load_in_a_process()
        assert again["stats"]["source_reads"] == 0 and again["stats"]["cache_misses"] == 0
        assert again["stats"]["cache_hits"] > 0 and again["sums"] == first["sums"]
