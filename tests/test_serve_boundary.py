"""The node server as a boundary (reliability probe turn 4, rows 1.4, 1.7, 1.8, 5.4): a client of another
account cannot write the pool by any route, a client never talks to a server of an account it does not
trust nor maps a region that is not sealed, and a client in a forked child raises ``ForkedError``. The
cross-user cases run as root with children that drop to another uid."""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore.serve import protocol, shm
from tierstore.serve.server import NodeServer
from tierstore.testing.data import assert_same, chunk, key_of

OTHER = 65534  # nobody
as_root = pytest.mark.skipif(os.getuid() != 0, reason="cross-user cases fork children to another uid")
SIZE = 100_000


@pytest.fixture
def shared_tmp():
    """A folder in /tmp every account can reach (``sticky`` and world-writable, as /tmp is)."""
    d = Path(tempfile.mkdtemp(prefix="tierstore-boundary-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def node_config(base, **serve):
    return {"tiers": [{"kind": "host", "capacity": "4MiB", "pinned": False}], "on_pressure": "keep",
            "serve": {"socket": str(base / "run" / "ts.sock"), **serve}}


def in_child(fn, uid: int | None = OTHER) -> int:
    """Run ``fn()`` in a forked child (as ``uid``, if given); its exit status (0: ``fn`` returned)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            fn()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the exit status
            print(f"child: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("child hung")


# ---------------------------------------------------------------------- a pool no client can write
def _hello(path: str) -> tuple[socket.socket, int, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(protocol.encode({"op": "hello", "version": protocol.VERSION}))
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
    reply = protocol.Reader(sock, data).frame()
    assert reply["ok"] and len(fds) == 2
    return sock, fds[0], reply["pool"]


def _write_every_way(path: str, pool_size: int) -> list[str]:
    """Every route a client might take to write the pool it was handed; the ones that worked."""
    libc = ctypes.CDLL(None, use_errno=True)
    sock, fd, _ = _hello(path)
    worked = []

    def attempt(name, fn):
        try:
            fn()
            worked.append(name)
        except OSError:
            pass

    def via(fd_, name):
        attempt(f"{name}: pwrite", lambda: os.pwrite(fd_, b"\xff" * 4096, 0))
        attempt(f"{name}: mmap shared writable", lambda: mmap.mmap(
            fd_, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)[0:4096].__len__())
        attempt(f"{name}: ftruncate", lambda: os.ftruncate(fd_, 0))
        if libc.fallocate(fd_, 3, ctypes.c_long(0), ctypes.c_long(pool_size)) == 0:  # punch a hole
            worked.append(f"{name}: fallocate punch")
        attempt(f"{name}: add seals", lambda: fcntl.fcntl(fd_, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
        attempt(f"{name}: fchmod", lambda: os.fchmod(fd_, 0o777))

    via(fd, "handed fd")
    for flags in (os.O_RDWR, os.O_WRONLY):
        try:
            again = os.open(f"/proc/self/fd/{fd}", flags)
        except OSError:
            continue
        worked.append(f"reopen {flags}")
        via(again, f"reopened {flags}")
    ro = mmap.mmap(fd, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.frombuffer(ro, dtype=torch.uint8).data_ptr()
    if libc.mprotect(ctypes.c_void_p(base), ctypes.c_size_t(pool_size), 3) == 0:
        worked.append("mprotect writable")
    sock.close()
    return worked


@as_root
def test_a_client_of_another_account_cannot_write_the_pool_by_any_route(shared_tmp):
    with NodeServer(node_config(shared_tmp, allow_uids=[0, OTHER])).start() as server:
        with tierstore.open({"server": f"unix://{server.config.socket}"}) as store:
            assert store.put(key_of(1), chunk(1, SIZE))
            report = shared_tmp / "worked.json"

            def attack():
                report.write_text(json.dumps(_write_every_way(server.config.socket, server.pool.capacity)))

            assert in_child(attack) == 0
            assert json.loads(report.read_text()) == []
            assert_same(store.get(key_of(1)), chunk(1, SIZE))
        # the server itself still writes its pool (through the mapping it made before the seals)
        seals = fcntl.fcntl(server.pool.memfd, fcntl.F_GET_SEALS)
        assert seals & shm.POOL_SEALS == shm.POOL_SEALS


# ---------------------------------------------------------------------- servers a client does not trust
def _impostor(path: Path, got: Path, ready: Path, uid: int, make_dir: bool) -> int:
    """A fake server at ``path`` run by ``uid`` (made in a child); it writes how many bytes it received
    to ``got``. Its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            if make_dir:
                os.setgid(uid)
                os.setuid(uid)
                path.parent.mkdir(mode=0o755, exist_ok=True)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(str(path))
            os.chmod(path, 0o777)
            if not make_dir:  # bound in a directory of root's, listening as uid: SO_PEERCRED says uid
                os.setgid(uid)
                os.setuid(uid)
            srv.listen(8)
            ready.touch()
            srv.settimeout(20)
            total = 0
            while True:
                conn, _ = srv.accept()
                conn.settimeout(1)
                try:
                    total += len(conn.recv(1 << 16))
                except OSError:
                    pass
                got.write_text(str(total))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid


@as_root
@pytest.mark.parametrize("where", ["their directory", "a directory anyone may write", "root's directory"])
def test_a_client_sends_nothing_to_a_server_of_an_account_it_does_not_trust(shared_tmp, where):
    if where == "their directory":
        path, make_dir = shared_tmp / "tierstore" / "ts.sock", True
    elif where == "a directory anyone may write":
        path, make_dir = shared_tmp / "ts.sock", True
    else:
        mine = shared_tmp / "mine"
        mine.mkdir(mode=0o755)
        path, make_dir = mine / "ts.sock", False
    got, ready = shared_tmp / "got", shared_tmp / "ready"
    pid = _impostor(path, got, ready, OTHER, make_dir and where == "their directory")
    try:
        store = tierstore.open({"server": f"unix://{path}", "timeout": 1})
        try:
            assert store.get(key_of(1)) is None
            assert store.put(key_of(1), chunk(1, 1000)) is False
            time.sleep(0.3)
            assert not got.exists() or got.read_text() == "0"  # not even the hello
            assert store.stats()["client"]["untrusted"] >= 1
        finally:
            store.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


@as_root
def test_server_uid_names_the_account_a_client_trusts(shared_tmp):
    """A server run by another account is used when the client names it (and the peer check still holds)."""
    config = node_config(shared_tmp, allow_uids=[0])
    config["tiers"][0]["capacity"] = "1MiB"
    served = shared_tmp / "served"

    def serve():
        with NodeServer(config).start():
            served.touch()
            time.sleep(8)

    os.chmod(shared_tmp, 0o1777)
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            config["serve"]["allow_uids"] = [0, OTHER]
            serve()
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 20
        while not served.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"unix://{config['serve']['socket']}"
        with tierstore.open({"server": url, "server_uid": OTHER}) as store:
            assert store.put(key_of(2), chunk(2, 1000))
            assert_same(store.get(key_of(2)), chunk(2, 1000))
        with tierstore.open({"server": url}) as store:  # not named: not trusted
            assert store.get(key_of(2)) is None and store.stats()["client"]["untrusted"] >= 1
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


FAKE_POOL_CLIENT = """
import sys, torch, tierstore
from tierstore.testing.data import key_of
store = tierstore.open({"server": "unix://" + sys.argv[1], "timeout": 2})
out = {"x": torch.empty(1024, dtype=torch.uint8)}
got = store.get(key_of(1), out=out)
print("miss" if got is None else "hit", store.stats()["client"].get("untrusted"), flush=True)
"""


def test_a_pool_that_is_not_sealed_is_never_mapped(tmp_path):
    """A server of a trusted account that hands an unsealed pool and truncates it: the client refuses it (a
    miss) instead of dying of SIGBUS."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = str(run / "ts.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(30)

    def fake():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        reader = protocol.Reader(conn)
        reader.request()
        pool = os.memfd_create("fake-pool")
        staging = os.memfd_create("fake-staging")
        os.ftruncate(pool, 1 << 20)
        os.ftruncate(staging, 1 << 20)
        socket.send_fds(conn, [protocol.encode({"ok": True, "version": protocol.VERSION, "server": "fake",
                                                "pool": 1 << 20, "staging": 1 << 20, "tiers": []})],
                        [pool, staging])
        try:
            reader.request()
        except (OSError, protocol.ProtocolError):
            return
        os.ftruncate(pool, 0)
        conn.sendall(protocol.encode({"ok": True, "items": [[0, 0, 0, 4096]]}))
        time.sleep(1)

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    try:
        proc = subprocess.run([sys.executable, "-c", FAKE_POOL_CLIENT, path], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert proc.stdout.split() == ["miss", "1"]
    finally:
        srv.close()
        t.join(5)


# ---------------------------------------------------------------------- fork
FORK_SCRIPT = r"""
import os, sys, threading
import torch
import tierstore
from tierstore import errors
from tierstore.testing.data import assert_same, chunk, key_of

torch.set_num_threads(1)  # torch's own OpenMP pool does not survive a fork either (not what this tests)
url = sys.argv[1]
store = tierstore.open({"server": url})
assert store.put(key_of(1), chunk(1, 100_000))
assert_same(store.get(key_of(1)), chunk(1, 100_000))
stop = threading.Event()

def reader():  # the parent's client is in use at the moment of the fork
    while not stop.is_set():
        assert_same(store.get(key_of(1)), chunk(1, 100_000))

t = threading.Thread(target=reader)
t.start()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        calls = [lambda: store.get(key_of(1)), lambda: store.put(key_of(2), chunk(2, 10)),
                 lambda: store.contains(key_of(1)), lambda: store.lookup([key_of(1)]), store.flush,
                 store.stats, lambda: store.pin([key_of(1)]), lambda: store.get_many_async([key_of(1)])]
        for call in calls:
            try:
                call()
            except errors.ForkedError:
                continue
            raise AssertionError(f"call {calls.index(call)} did not raise ForkedError")
        store.close()  # returns at once
        with tierstore.open({"server": url}) as mine:
            for _ in range(200):
                assert_same(mine.get(key_of(1)), chunk(1, 100_000))
            assert mine.put(key_of(3), chunk(3, 100_000))
        code = 0
    finally:
        sys.stdout.flush()
        os._exit(code)
_, status = os.waitpid(pid, 0)
stop.set()
t.join()
assert_same(store.get(key_of(3)), chunk(3, 100_000))  # what the child's own client put
store.close()
print("child", status, flush=True)
"""


def test_a_client_used_after_fork_raises_forked_error_and_the_child_opens_its_own(tmp_path):
    with NodeServer(node_config(tmp_path)).start() as server:
        proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, f"unix://{server.config.socket}"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["child", "0"], (proc.stdout, proc.stderr[-3000:])
