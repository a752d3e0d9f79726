"""The one guard every public call of a :class:`~tierstore.TieredStore` runs under, and the close at exit.

A call *enters* before it touches a tier and *leaves* when it is over; an ``*_async`` call enters when it
is submitted and leaves when its future is done, so queued work counts as running. ``close()`` refuses
every call from its first instant, waits (up to its deadline) until no call is running, and only then
flushes and stops. A call still running when the deadline passed is *abandoned*: a write that returns
after that raises :class:`~tierstore.ClosedError` instead of acknowledging what the close no longer
flushed.

A process forked while stores were open (engines fork their workers) inherits them without their I/O
threads, and the disk directories they lock belong to the parent: in the child every call on such a store
raises :class:`~tierstore.ForkedError` at once, ``close()`` returns at once, and the exit-time close skips
them. The child opens its own store.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from .errors import ClosedError, ForkedError


class Lifecycle:
    """Calls in progress, and whether a close has begun (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.closing = False
        self.abandoned = False  #: close() went on while calls were still running
        self.forked_from: int | None = None  #: the parent's pid, in a child forked after this store opened
        _lifecycles.add(self)

    def enter(self) -> None:
        with self._cond:
            if self.closing:
                self.check_fork()
                raise ClosedError("store is closed")
            self._active += 1

    def check_fork(self) -> None:
        """Raise :class:`ForkedError` in a child forked after this store opened."""
        if self.forked_from is not None:
            raise ForkedError(f"this store was opened in process {self.forked_from} before it forked: open a "
                              "store in the child (tierstore.open) after the fork")

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    @contextmanager
    def call(self, acknowledges: bool = False) -> Iterator[None]:
        """Run one public call. With ``acknowledges`` (a write), a call that outlived close's deadline
        raises :class:`ClosedError` rather than return an acknowledgement."""
        self.enter()
        try:
            yield
            if acknowledges and self.abandoned:
                raise ClosedError("store closed while this write ran: not acknowledged")
        finally:
            self.leave()

    def begin_close(self, timeout: float) -> bool:
        """Refuse new calls and wait up to ``timeout`` s for running ones; ``False`` if a close already began."""
        with self._cond:
            if self.closing:
                return False
            self.closing = True
            if not self._cond.wait_for(lambda: self._active == 0, timeout):
                self.abandoned = True
            return True


    def _after_fork_in_child(self, parent: int) -> None:
        self._cond = threading.Condition()  # a thread of the parent may have held the old one at the fork
        self._active = 0
        self.closing = True
        self.forked_from = parent


_lifecycles: weakref.WeakSet[Lifecycle] = weakref.WeakSet()


# ---------------------------------------------------------------------- closing at interpreter exit
class Closable(Protocol):
    def close(self, timeout: float | None = None) -> None: ...


_open: set[Closable] = set()  # strong refs: a store nobody closed still gets flushed at exit
_open_lock = threading.Lock()


def track(store: Closable) -> None:
    with _open_lock:
        _open.add(store)


def untrack(store: Closable) -> None:
    with _open_lock:
        _open.discard(store)


def _close_open_stores() -> None:
    with _open_lock:
        stores = list(_open)
    for s in stores:
        s.close()


def _after_fork_in_child() -> None:
    global _open_lock
    _open_lock = threading.Lock()
    _open.clear()  # the parent's stores: the parent flushes and closes them
    for life in list(_lifecycles):
        life._after_fork_in_child(os.getppid())


os.register_at_fork(after_in_child=_after_fork_in_child)

# Run before the interpreter joins non-daemon threads and shuts thread pools down (the tiers' I/O pools
# are needed to flush); plain atexit handlers run only after that.
_register: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_open_stores)
else:  # pragma: no cover - CPython < 3.9
    import atexit
    atexit.register(_close_open_stores)
