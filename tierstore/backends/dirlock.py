"""One owning process per directory: an ``flock`` on the directory itself, released when the process dies.

The lock is taken on a descriptor of the directory, not on a file inside it, so deleting or replacing a
lock file cannot let a second owner in (``rm .lock`` while the owner runs). ``.lock`` tells a refused
opener who holds the directory (``"<pid> <hostname>"``), and is flock'ed as well: older versions lock
only that file, so a mixed-version pair still excludes each other. Where a directory cannot be locked
(NFS emulates ``flock`` with POSIX locks, which need a descriptor open for writing), ``.lock`` is the only
lock; it is re-checked after locking that the name still refers to the locked file (retrying otherwise),
but there removing ``.lock`` while the owner runs does let a second owner in.

The descriptors are close-on-exec, but a ``fork``ed child shares the lock until it exits.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from collections.abc import Sequence

from ..errors import ConfigError, LockedError

NOTE_NAME = ".lock"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
#: flock errors meaning "this filesystem cannot lock a directory descriptor"
_NO_DIR_LOCK = (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


class DirLock:
    """An exclusive, non-blocking lock on the directory open as ``dir_fd`` (which the caller keeps open).

    Raises:
        LockedError: another process (or another lock in this one) holds the directory; the message
            names the holder's pid and host when its note is readable.
        ConfigError: the directory cannot be locked or ``.lock`` is not a regular file we can write
            (e.g. a symlink: it is never followed).
    """

    def __init__(self, dir_fd: int, path: str, file_mode: int = 0o600):
        self.path = path
        self._locked_dir_fd: int | None = dir_fd
        self._note_fd: int | None = None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                raise self._locked(dir_fd) from None
            if exc.errno not in _NO_DIR_LOCK:
                raise ConfigError(f"directory {path!r} cannot be locked: {exc}") from None
            self._locked_dir_fd = None  # this filesystem cannot: the note file is the lock
        try:
            self._note_fd = self._lock_note_file(dir_fd, file_mode)
        except BaseException:
            self.release()
            raise
        try:
            os.fchmod(self._note_fd, file_mode)
            os.ftruncate(self._note_fd, 0)
            os.pwrite(self._note_fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the lock itself is what counts; the note is for humans

    def _lock_note_file(self, dir_fd: int, file_mode: int) -> int:
        while True:
            try:
                fd = os.open(NOTE_NAME, os.O_RDWR | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW, file_mode, dir_fd=dir_fd)
            except OSError as exc:
                raise ConfigError(f"directory {self.path!r}: cannot open {NOTE_NAME}: {exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
                now = os.stat(NOTE_NAME, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:
                os.close(fd)
                if exc.errno == errno.ENOENT:
                    continue  # unlinked after we opened it: lock the file that is there now
                if exc.errno in _BUSY:
                    raise self._locked(dir_fd) from None
                raise ConfigError(f"directory {self.path!r}: cannot lock {NOTE_NAME}: {exc}") from None
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                return fd
            os.close(fd)  # replaced after we opened it: lock the file that is there now

    def _locked(self, dir_fd: int) -> LockedError:
        who = holder(dir_fd)
        return LockedError(errno.EWOULDBLOCK,
                           f"directory {self.path!r} is in use by {who}; a directory belongs "
                           "to one process at a time (open it with read_only=True to inspect it)")

    def release(self) -> None:
        """Unlock (idempotent). The caller still owns and closes ``dir_fd``."""
        note_fd, self._note_fd = self._note_fd, None
        dir_fd, self._locked_dir_fd = self._locked_dir_fd, None
        try:
            if dir_fd is not None:
                fcntl.flock(dir_fd, fcntl.LOCK_UN)
        finally:
            if note_fd is not None:
                os.close(note_fd)  # closing drops its flock


def open_dir(path: str) -> int:
    """A descriptor of directory ``path`` (:class:`ConfigError` naming it if that fails)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"directory {path!r} cannot be opened: {exc}") from None


def lock_first_free(paths: Sequence[str], dir_mode: int, file_mode: int) -> tuple[int, DirLock, str]:
    """Open and lock the first of ``paths`` no other process holds, creating it (with exactly
    ``dir_mode``) if missing; return its descriptor, lock and path. Raises :class:`LockedError` when
    every one is held, :class:`ConfigError` when one cannot be created or opened."""
    refused: list[LockedError] = []
    for path in paths:
        _make_dir(path, dir_mode)
        fd = open_dir(path)
        try:
            return fd, DirLock(fd, path, file_mode), path
        except BaseException as exc:
            os.close(fd)
            if not isinstance(exc, LockedError):
                raise
            refused.append(exc)
    if len(refused) == 1:
        raise refused[0]
    raise LockedError(errno.EWOULDBLOCK, f"all {len(refused)} directories are in use: "
                      + "; ".join(str(e) for e in refused))


def _make_dir(path: str, mode: int) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, mode)
        os.chmod(path, mode)  # ours: exactly the mode asked for, whatever the umask
    except FileExistsError:
        if not os.path.isdir(path):
            raise ConfigError(f"path {path!r} is not a writable directory: it is a file") from None
    except OSError as exc:
        raise ConfigError(f"path {path!r} is not a writable directory: {exc}") from None


def holder(dir_fd: int) -> str:
    """Who the note in the directory says holds it: ``"pid N on host H"`` (or ``"another process"``)."""
    try:
        fd = os.open(NOTE_NAME, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC | _O_NOFOLLOW, dir_fd=dir_fd)
        try:
            words = os.read(fd, 256).decode(errors="replace").split()
        finally:
            os.close(fd)
    except OSError:
        words = []
    if not words:
        return "another process"
    return f"pid {words[0]} on host {words[1] if len(words) > 1 else '?'}"


__all__ = ["DirLock", "NOTE_NAME", "holder"]
