"""Who may reach a node server: its socket directory and the peer credentials of each connection.

The server makes the socket's directory itself. One that already exists is used only if it is a real
directory (not a symlink) owned by the server's user with no wider mode than the server asks for; a
socket file left there by a server that died is replaced, one a live server answers on is not. Each
connection's ``SO_PEERCRED`` (pid, uid, gid of the process that connected) is checked against the
configured users and groups: one trust domain per server (run two servers for two).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections.abc import Collection
from dataclasses import dataclass

from ..errors import ConfigError

_CRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Peer(pid, uid, gid)


def allowed(peer: Peer, uids: Collection[int], gids: Collection[int]) -> bool:
    """Whether ``peer`` is one of ``uids`` or its primary group one of ``gids`` (root is never implied)."""
    return peer.uid in uids or peer.gid in gids


def modes(uids: Collection[int], gids: Collection[int]) -> tuple[int, int]:
    """(directory mode, socket mode) just wide enough for the allowed users: the owner alone; the owner and
    a group; anyone (then ``SO_PEERCRED`` alone decides)."""
    me = os.getuid()
    if set(uids) <= {me} and not gids:
        return 0o700, 0o600
    if set(uids) <= {me}:
        return 0o710, 0o660
    return 0o711, 0o666


def bind(path: str, uids: Collection[int], gids: Collection[int], backlog: int = 128) -> socket.socket:
    """A listening Unix socket at ``path`` in a directory checked (or made) as the module docstring says.

    Raises:
        ConfigError: the directory is a symlink, belongs to someone else, is wider than asked, or a live
            server already listens at ``path``.
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    dir_mode, sock_mode = modes(uids, gids)
    _check_directory(directory, dir_mode)
    group = next(iter(gids), None) if dir_mode == 0o710 else None
    if group is not None:
        os.chown(directory, -1, group)
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o777 & ~sock_mode)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, sock_mode)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def _check_directory(directory: str, mode: int) -> None:
    try:
        os.mkdir(directory, mode)
        os.chmod(directory, mode)  # mkdir's mode passes through the umask
        return
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {directory!r} is a symlink or not a directory: refusing it")
    if st.st_uid != os.getuid():
        raise ConfigError(f"socket directory {directory!r} belongs to uid {st.st_uid}, not to this server's "
                          f"uid {os.getuid()}: refusing it")
    wider = stat.S_IMODE(st.st_mode) & ~mode
    if wider:
        raise ConfigError(f"socket directory {directory!r} has mode {stat.S_IMODE(st.st_mode):o}, wider than "
                          f"{mode:o}: refusing it (remove it, or chmod {mode:o})")


def _clear_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path!r} exists and is not a socket: refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        os.unlink(path)  # left by a server that died
        return
    finally:
        probe.close()
    raise ConfigError(f"a server already listens at {path!r}")


# ---------------------------------------------------------------------- the client's side
class UntrustedServer(PermissionError):
    """The socket's directory or the process listening on it belongs to an account the client does not trust."""


def trusted_uids(server_uid: int | None) -> frozenset[int]:
    """Who a client trusts to serve it: its own user, root (who could read its memory anyway), and
    ``server_uid`` (the account a shared server runs as)."""
    return frozenset({os.getuid(), 0} | ({server_uid} if server_uid is not None else set()))


def check_directory(path: str, uids: Collection[int]) -> None:
    """Refuse a socket whose directory another account made or may write (it could have put its own server
    there). Raises :class:`UntrustedServer`."""
    directory = os.path.dirname(path)
    st = os.stat(directory)
    if st.st_uid not in uids:
        raise UntrustedServer(f"socket directory {directory!r} belongs to uid {st.st_uid}, which this client "
                              f"does not trust (server_uid names the server's account)")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise UntrustedServer(f"socket directory {directory!r} has mode {stat.S_IMODE(st.st_mode):o}: other "
                              "accounts may create sockets in it; serve from a directory only the server's "
                              "account may write (e.g. /run/tierstore)")


def check_server(sock: socket.socket, uids: Collection[int]) -> None:
    """Refuse a connected socket whose listening process runs as an account outside ``uids``."""
    peer = peer_of(sock)
    if peer.uid not in uids:
        raise UntrustedServer(f"the socket is served by uid {peer.uid} (pid {peer.pid}), which this client does "
                              "not trust (server_uid names the server's account)")
