"""Reading a chunk a client has read before straight out of the server's pool, without asking the server.

A get through the server costs a round trip, and on a small machine the server's share of the CPU, before
the one copy it exists for. A client that read a chunk through the server knows where it lies in the pool
(mapped read-only here) and the *stamp* of the write that put it there (``tierstore.backends.memory``: a
64-bit word at the chunk's start, unique for the server's life, zeroed under the server's lock the moment the
chunk is replaced, deleted or evicted — before its memory can be reused). The next get of that chunk into an
``out`` of the same shape reads the word, copies the tensors, and reads the word again: the same stamp both
times means no write touched those bytes in between, so the copy is the chunk's value at that moment. Then
one non-blocking peek at the connection to that server: a server that died (and a new one that might have
taken a newer value since) shows as a closed socket, and the read goes to the socket path instead. Anything
else — another stamp, a zero, another server, an ``out`` of another shape — and the chunk is asked for as
usual; its answer overwrites what the check rejected, and a miss leaves ``out`` unspecified (as a disk read that
fails its checksum does). The hits are reported with the next request (the server's LRU and hit counts see
them).

The two reads of the word around the copy order the copy's loads only where loads are not reordered with
loads (x86-64); elsewhere every get asks the server.
"""

from __future__ import annotations

import platform
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..keys import ChunkKey
from ..tensors import TensorDict, byte_alias
from .protocol import ProtocolError

#: loads are not reordered with other loads here (x86-64's memory model)
DIRECT = platform.machine().lower() in ("x86_64", "amd64")
#: an ``out`` as the server checks it: ``(name, dtype, shape)`` per tensor, in order
OutSpec = tuple[tuple[str, str, tuple[int, ...]], ...]
#: chunks remembered per client (the least recently learned forgotten first)
REMEMBERED = 1 << 16


class Places:
    """Per key, where it was last read: the server, the ``out`` shape, its stamp, its word, its offsets."""

    def __init__(self, limit: int = REMEMBERED):
        self.limit = limit
        self._seen: dict[ChunkKey, tuple[str, OutSpec, int, int, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self.counts = {"direct_hits": 0, "direct_misses": 0}

    def learn(self, server: str, key: ChunkKey, out: OutSpec, item: Sequence[Any]) -> None:
        """``item``: a get reply's ``[0, stamp, word, offset, ...]`` for ``key`` read into ``out``."""
        stamp, word, offsets = item[1], item[2], tuple(item[3:])
        if not DIRECT or not stamp or type(stamp) is not int or type(word) is not int or word < 0 or word % 8:
            return
        with self._lock:
            self._seen.pop(key, None)
            self._seen[key] = (server, out, stamp, word, offsets)
            if len(self._seen) > self.limit:
                del self._seen[next(iter(self._seen))]

    def read(self, server: str, pool: torch.Tensor, words: torch.Tensor, sock: socket.socket,
             keys: Sequence[ChunkKey], outs: Sequence[OutSpec], out: Sequence[Mapping[str, torch.Tensor]],
             todo: Sequence[int], results: list[TensorDict | None]) -> list[int]:
        """Read what can be read straight from ``pool`` (``server``'s, mapped here, ``words`` its 8-byte
        view) into ``out``; returns the indices of ``todo`` that were (``results`` set for them)."""
        seen = self._seen
        done = []
        for j, i in enumerate(todo):
            entry = seen.get(keys[i])
            if entry is None or entry[0] != server or entry[1] != outs[j]:
                continue
            stamp, word = entry[2], entry[3] // 8
            if word >= words.numel() or int(words[word]) != stamp:
                self._forget(keys[i])
                continue
            copy_out(pool, entry[4], out[i], wait=True)  # done reading the pool before the stamp is read again
            if int(words[word]) != stamp:  # rewritten while being copied: out holds a mix, copied again below
                self._forget(keys[i])
                continue
            done.append(j)
        if done and not _alive(sock):
            return []
        for j in done:
            results[todo[j]] = dict(out[todo[j]])
        with self._lock:
            self.counts["direct_hits"] += len(done)
        return [todo[j] for j in done]

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self.counts["direct_misses"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "places_known": len(self._seen)}


def stamp_holds(words: torch.Tensor, stamp: Any, word: Any) -> bool:
    """Whether pool chunk's ``stamp``, whose word lies at byte offset ``word``, is still there (no stamp: nothing to
    check)."""
    if not stamp:
        return True
    return type(word) is int and 0 <= word < 8 * words.numel() and not word % 8 and int(words[word // 8]) == stamp


def _alive(sock: socket.socket) -> bool:
    """The server at the other end of ``sock`` (idle, nothing owed) has not gone away."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def copy_out(region: torch.Tensor, offsets: Sequence[Any], out: Mapping[str, torch.Tensor],
             wait: bool = False) -> TensorDict:
    """Copy the tensors lying at ``offsets`` of ``region`` (in ``out``'s order) into ``out``: one copy each. A
    copy to a GPU is asynchronous unless ``wait``."""
    size = region.numel()
    for (name, dst), off in zip(out.items(), offsets, strict=True):
        n = dst.nbytes
        if type(off) is not int or off < 0 or off + n > size:
            raise ProtocolError(f"tensor {name!r} does not lie inside the shared region")
        src = region[off:off + n]
        if dst.is_contiguous():
            byte_alias(dst).copy_(src, non_blocking=dst.is_cuda and not wait)
        else:
            dst.copy_((src.view(dst.dtype) if dst.dtype != torch.uint8 else src).reshape(dst.shape))
    return dict(out)
