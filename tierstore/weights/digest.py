"""Check a content-addressed object against its name while it loads.

A published object is named by the digest of its bytes: ``blake3-<hex>.safetensors`` (BLAKE3-256, what
:func:`object_name` gives; it hashes at ~5 GB/s per core, 10 on this machine's two) or, as published before,
``<hex>.safetensors`` (blake2b-256, ~0.9 GB/s, still checked). The loader feeds every byte of such a shard
to a :class:`DigestCheck` as its pieces land, in file order, and the last piece compares the digest with
the name: an object with a changed byte fails the load with :class:`CheckpointError` instead of handing
out a wrong tensor.

A piece's thread waits for the pieces before it. That cannot deadlock: pieces of a shard are submitted in
file order to one FIFO pool, so every earlier piece is already running (or done) and never waits on a
later one; :meth:`DigestCheck.abort` releases the waiters when a load fails or is abandoned.

BLAKE3 hashes a large buffer on a pool of threads that does not survive ``fork()``: a child forked after
this process hashed that way would wait on it forever, so such a child hashes on one thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterable
from typing import Any

import blake3

from .header import CheckpointError

_CAS_NAME = re.compile(r"(?:(blake3)-)?([0-9a-f]{64})\.safetensors")


#: threads BLAKE3 may use here: its own pool, or one thread in a child forked after that pool started
_threads = blake3.blake3.AUTO


def _single_threaded_after_fork() -> None:
    global _threads
    _threads = 1


os.register_at_fork(after_in_child=_single_threaded_after_fork)


def _hasher(algorithm: str, data: bytes = b"") -> Any:
    if algorithm == "blake3":
        return blake3.blake3(data, max_threads=_threads)
    return hashlib.blake2b(data, digest_size=32)


def object_name(data: Iterable[bytes | memoryview]) -> str:
    """The name of the object whose bytes are ``data`` (in order): ``blake3-<digest>.safetensors``."""
    h = _hasher("blake3")
    for block in data:
        h.update(block)
    return f"blake3-{h.hexdigest()}.safetensors"


def expected_digest(basename: str) -> str | None:
    """The digest an object named ``basename`` must have, as ``"<algorithm>:<hex>"``, or None if the name
    is not a digest."""
    m = _CAS_NAME.fullmatch(basename)
    return f"{m.group(1) or 'blake2b'}:{m.group(2)}" if m else None


class DigestCheck:
    """The running digest of one shard, fed in order from ``len(head)`` to ``size``.

    Args:
        name: the shard's path or URL (for errors).
        expected: the digest its name promises (:func:`expected_digest`).
        size: the file's size.
        head: the file's first bytes (prefix and JSON header), already read when the header was parsed.
    """

    def __init__(self, name: str, expected: str, size: int, head: bytes):
        self.name, self.expected, self.size = name, expected, size
        self._algorithm, self._hex = expected.split(":")
        self._hash = _hasher(self._algorithm, head)
        self._next = len(head)
        self._aborted = self._compared = False
        self._cond = threading.Condition()

    def feed(self, offset: int, bufs: list[memoryview]) -> None:
        """Hash ``bufs`` (consecutive bytes from ``offset``) once every byte before them is hashed.

        Raises:
            CheckpointError: the digest of the whole file does not match its name (on the last piece),
                or the load was aborted while this piece waited its turn.
        """
        with self._cond:
            while self._next != offset:
                if self._aborted:
                    raise CheckpointError(self.name, "load aborted before this object's digest was checked")
                if self._next > offset:
                    raise CheckpointError(self.name, f"bytes at offset {offset} fed twice to the digest check")
                self._cond.wait()
            for b in bufs:
                self._hash.update(b)  # both release the GIL for large buffers
            self._next += sum(len(b) for b in bufs)
            self._cond.notify_all()
            if self._next == self.size:
                self._compare()

    def final(self) -> None:
        """Raise :class:`CheckpointError` unless every byte was fed and the digest matches the name."""
        with self._cond:
            if self._next != self.size:
                raise CheckpointError(self.name, f"only {self._next} of {self.size} bytes reached the digest check")
            if not self._compared:
                self._compare()

    def _compare(self) -> None:
        self._compared = True
        actual = self._hash.hexdigest()
        if actual != self._hex:
            raise CheckpointError(self.name, f"content does not match its name: its {self._algorithm} digest is "
                                             f"{actual[:16]}…, the name says {self._hex[:16]}… (the object was "
                                             f"altered; publish the checkpoint again to replace it)")

    def abort(self) -> None:
        """Release every piece waiting for its turn (they raise)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()
