"""The vLLM connector's scheduler-to-worker lookup sockets against another local account (reliability
probe 3.2-3.5), run as root with children that drop to another uid: a socket directory another account
made (wide, private to it, or a symlink) is never used and the engine still starts; a socket served by
another uid is never asked; a worker answers only its own user; two live engines with one engine_id are an
error; an oversize request is answered with an error and the connection stays in step; a closed server
answers nothing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
from tierstore_vllm import lookup
from tierstore_vllm.lookup import LookupClient, LookupServer
from tierstore_vllm.options import socket_path

from tierstore.errors import ConfigError

OTHER = 65534  # nobody
as_root = pytest.mark.skipif(os.getuid() != 0, reason="cross-user cases fork children to another uid")


def as_other(fn) -> int:
    """Run ``fn()`` in a forked child as uid/gid ``OTHER``; its exit status (0: fn returned)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1]


@pytest.fixture
def shared_tmp():
    """A sticky, world-writable folder (what /tmp is) that the other account can reach."""
    d = Path(tempfile.mkdtemp(prefix="tierstore-sockets-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def echo(request):
    return {"ready": len(request.get("tokens", []))}


@as_root
@pytest.mark.parametrize("made", ["wide", "private-to-them", "symlink"])
def test_a_socket_directory_another_account_made_is_never_used(shared_tmp, made, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))  # $TMPDIR
    base = shared_tmp / "tierstore-vllm-0"

    def squat():
        if made == "symlink":
            theirs = shared_tmp / "theirs"
            theirs.mkdir(mode=0o777)
            os.symlink(theirs, base)
        else:
            base.mkdir()
            os.chmod(base, 0o777 if made == "wide" else 0o700)

    assert as_other(squat) == 0
    path = Path(socket_path(None, "engine-a", 0, 0))
    got = path.parent
    assert got == shared_tmp / "tierstore-vllm-0.1"
    st = os.lstat(got)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert socket_path(None, "engine-a", 0, 0) == str(path)  # the scheduler and the workers agree
    server = LookupServer(str(path), echo)  # the engine starts
    try:
        assert LookupClient([server.path]).ask({"tokens": [1, 2, 3]}) == [{"ready": 3}]
    finally:
        server.close()


@as_root
def test_a_socket_served_by_another_uid_is_never_asked(shared_tmp):
    path = shared_tmp / "forged.sock"
    ready = shared_tmp / "ready"

    def forge():
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        os.chmod(path, 0o777)
        srv.listen(1)
        ready.touch()
        srv.settimeout(10)
        conn, _ = srv.accept()
        conn.recv(1 << 16)
        conn.sendall(json.dumps({"ready": 1000000}).encode() + b"\n")
        time.sleep(0.5)

    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            forge()
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConnectionRefusedError, match="served by uid"):
            LookupClient([str(path)], timeout=5).ask({"tokens": [1]})
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


@as_root
def test_a_worker_answers_only_its_own_user(shared_tmp):
    d = shared_tmp / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    server = LookupServer(str(d / "w.sock"), echo)
    os.chmod(server.path, 0o777)  # as if the file modes were bypassed: the peer check still holds
    got = shared_tmp / "got"

    def ask():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(server.path)  # the file modes let it in
        try:
            s.sendall(b'{"tokens": [1]}\n')
            data = s.recv(1 << 16)  # b"": closed without an answer
        except OSError:  # reset or broken pipe: the worker closed first
            data = b""
        Path(got).write_bytes(b"connected:" + data)

    try:
        assert as_other(ask) == 0
        assert got.read_bytes() == b"connected:"
        assert LookupClient([server.path]).ask({"tokens": [1]}) == [{"ready": 1}]
    finally:
        server.close()


def test_two_live_engines_with_one_engine_id_are_an_error_and_a_stale_socket_is_replaced(tmp_path):
    path = str(tmp_path / "w.sock")
    first = LookupServer(path, echo)
    try:
        with pytest.raises(ConfigError, match="engine_id"):
            LookupServer(path, echo)
        assert LookupClient([path]).ask({"tokens": [1]}) == [{"ready": 1}]  # the first still serves
    finally:
        first.close()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a dead worker's socket file: nobody listens
    dead.close()
    again = LookupServer(path, echo)
    try:
        assert LookupClient([path]).ask({"tokens": [1, 2]}) == [{"ready": 2}]
    finally:
        again.close()


def test_an_oversize_request_gets_an_error_and_the_connection_stays_in_step(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup, "MAX_LINE", 1000)
    server = LookupServer(str(tmp_path / "w.sock"), echo)
    client = LookupClient([server.path])
    try:
        (big,) = client.ask({"tokens": list(range(5000))})
        assert "over 1000 bytes" in big["error"]
        assert client.ask({"tokens": [1, 2]}) == [{"ready": 2}]  # the next answer is its own
    finally:
        client.close()
        server.close()


def test_a_closed_server_answers_nothing_on_open_connections(tmp_path):
    server = LookupServer(str(tmp_path / "w.sock"), echo)
    client = LookupClient([server.path], timeout=5)
    assert client.ask({"tokens": [1]}) == [{"ready": 1}]
    server.close()
    with pytest.raises(OSError):
        client.ask({"tokens": [1]})
