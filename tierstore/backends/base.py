"""The :class:`Backend` interface: plain storage of chunks by key, in the shape of zarr's ``Store``.

A backend stores, reads, deletes and lists; it knows nothing of capacity, LRU order, pins, dirty chunks or
other backends — that is the store's control plane (:mod:`tierstore.residency`) — and it never calls back
into the store. What it can do is declared as data in :class:`Capabilities`, not in methods that change
control flow.

Batched methods are the interface (a backend runs a batch on its own parallelism: memory inline, a disk
directory on a small pool, a remote prefix as one ``asyncio.gather`` on its filesystem's event loop). Each
returns one result per item, in order, and raises only for a malformed call: an item's failure is its result —
a :class:`Hit` (the chunk and its stored size), ``None`` where nothing is stored, or the exception that says
why (:class:`~tierstore.CorruptObjectError`,
:class:`~tierstore.UnsupportedObjectError`, :class:`~tierstore.ForgedObjectError`, ``OSError``,
``MemoryError``; :class:`~tierstore.InvalidInputError` for an ``out`` that does not fit the chunk).

What a backend holds is either **tensors** (memory: a chunk as its tensors, written and read with a copy) or
**objects** (the self-describing, checksummed encoding of :mod:`tierstore.objformat`): between two object
backends with the same codec, write-back moves an object's bytes as they are (no decode, no re-encode, one
checksum pass, on the read).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from .. import objformat
from ..errors import ConfigError
from ..keys import ChunkKey
from ..tensors import TensorDict

if TYPE_CHECKING:
    from typing_extensions import Self

Chunk = Mapping[str, torch.Tensor] | objformat.Encoded


class Hit(NamedTuple):
    """One item a read found: the chunk (tensors, the filled ``out``, or an object) and the bytes it occupies
    in the backend (what the store counts as read, and indexes for a key it did not know)."""

    value: Any
    size: int


#: what one item of a batched read gives: a :class:`Hit`, ``None`` (not stored) or why it could not be read
ReadResult = Hit | BaseException | None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. The store decides from these, never from a backend's type.

    Attributes:
        objects: it stores encoded objects (else tensors in memory).
        shared: other processes write it too: its listing is a partial view of what it holds (the store
            asks it about keys its index lacks), and a reader never deletes from it, not even a damaged object.
        persistent: what it holds survives the process (its listing rebuilds the index at open).
        writable: the store writes it (a read-only view serves reads only).
        probe_on_read: reading a key it was never told about is its own existence check (an S3 GET: 404 is
            the miss), so batched reads skip a separate probe.
        zero_copy: :meth:`Backend.borrow` lends its own memory (else it reads a copy).
        codec: the codec of the objects it writes (write-back moves objects as they are between backends
            with the same codec).
    """

    objects: bool = False
    shared: bool = False
    persistent: bool = False
    writable: bool = True
    probe_on_read: bool = False
    zero_copy: bool = False
    codec: str | None = None


class Prepared(NamedTuple):
    """A chunk ready for :meth:`Backend.write_many`: what is written and the bytes it occupies there."""

    payload: Any
    size: int


class Listed(NamedTuple):
    """One stored chunk found by :meth:`Backend.list`."""

    key: ChunkKey
    size: int
    mtime: float


class Backend(ABC):
    """Storage of chunks by :class:`~tierstore.ChunkKey` (see the module docstring). Thread-safe.

    Subclasses set :attr:`kind`, :attr:`capabilities` and implement the abstract methods; the single-key
    methods and the option check come with this class.
    """

    kind: ClassVar[str] = ""
    capabilities: Capabilities = Capabilities()
    #: the capacity the backend itself imposes (a memory pool's bytes); ``None``: the config's
    capacity: int | None = None
    #: whether a store lists it at open to rebuild its index (a huge shared prefix may say no)
    list_on_open: bool = True
    #: how many items a batched call runs at once (its own pool or request limit); ``None``: unknown. Write-back
    #: sizes its batches into this backend from it
    concurrency: int | None = None

    # ------------------------------------------------------------------ writes
    @abstractmethod
    def prepare(self, key: ChunkKey, chunk: Chunk) -> Prepared:
        """Turn a chunk (tensors, or an object another backend read) into what this backend writes, and say how
        many bytes it will occupy. CPU work only, no I/O. Raises :class:`~tierstore.InvalidInputError` for a
        chunk it cannot store."""

    @abstractmethod
    def write_many(self, items: Sequence[tuple[ChunkKey, Prepared]]) -> list[BaseException | None]:
        """Store each prepared chunk so that a reader sees all of it or nothing, replacing what the key held.
        Per item ``None`` (stored) or the exception (``OSError`` with ``errno.ENOSPC`` when the storage is
        full, ``errno.ENOMEM`` when memory has no contiguous room left)."""

    # ------------------------------------------------------------------ reads
    @abstractmethod
    def read_many(self, keys: Sequence[ChunkKey], device: str | torch.device = "cpu") -> list[ReadResult]:
        """Each key's tensors as fresh tensors on ``device`` that the caller owns (``Hit.value``)."""

    def read_into_many(self, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]) -> list[ReadResult]:
        """Fill ``outs[i]`` (same names, shapes, dtypes as stored) from ``keys[i]``; a hit's value is ``outs[i]``
        as a dict. The caller checked that no two ``out`` tensors overlap. Default: read, then copy."""
        from ..tensors import fill_out

        results: list[ReadResult] = []
        for out, got in zip(outs, self.read_many(keys), strict=True):
            if isinstance(got, Hit):
                try:
                    got = Hit(fill_out(out, got.value), got.size)
                except Exception as exc:  # noqa: BLE001 - the item's result
                    got = exc
            results.append(got)
        return results

    def read_objects(self, keys: Sequence[ChunkKey]) -> list[ReadResult]:
        """Each key's stored object as an :class:`~tierstore.objformat.Encoded`, verified but not decoded
        (backends that hold objects; a decrypting one gives the plain object, its ``Hit.size`` the stored one)."""
        raise NotImplementedError(f"{type(self).__name__} does not hold encoded objects")

    @contextmanager
    def borrow(self, key: ChunkKey) -> Iterator[TensorDict | None]:
        """The chunk's tensors for the ``with`` body, read-only: a memory backend lends its own memory (it is not
        reused before the body ends); others read a copy. ``None`` if not stored; raises as a read fails."""
        (got,) = self.read_many([key])
        if isinstance(got, BaseException):
            raise got
        yield None if got is None else got.value

    # ------------------------------------------------------------------ the rest
    @abstractmethod
    def delete_many(self, keys: Sequence[ChunkKey]) -> list[BaseException | None]:
        """Remove each key's chunk (absent is fine)."""

    def stat_many(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """The stored size of each key's chunk, ``None`` where there is none (a lookup: on shared backends one
        request per key, concurrently). A failure is ``None`` (counted by the backend)."""
        return [None] * len(keys)

    def list(self) -> Iterator[Listed]:
        """Every chunk stored, least recently used first where the backend knows (by modification time)."""
        return iter(())

    def free_space(self) -> int | None:
        """Bytes free on the underlying storage (after ENOSPC); ``None``: unknown."""
        return None

    def note_use(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` were just served from a tier above this one (a shared backend may refresh their last use)."""

    def stats(self) -> dict[str, Any]:
        """Backend-specific figures (path, URL, failures by reason ...) for ``store.stats()``."""
        return {}

    def close(self) -> None:
        """Release resources; idempotent. Work still running may fail with :class:`~tierstore.ClosedError`."""

    # ------------------------------------------------------------------ single-key conveniences
    def write(self, key: ChunkKey, chunk: Chunk) -> None:
        """Prepare and store one chunk; raises what :meth:`write_many` reports."""
        (err,) = self.write_many([(key, self.prepare(key, chunk))])
        if err is not None:
            raise err

    def read(self, key: ChunkKey, device: str | torch.device = "cpu") -> TensorDict | None:
        """One chunk, or ``None``; raises what :meth:`read_many` reports."""
        (got,) = self.read_many([key], device)
        if isinstance(got, BaseException):
            raise got
        return None if got is None else got.value

    def delete(self, key: ChunkKey) -> None:
        (err,) = self.delete_many([key])
        if err is not None:
            raise err

    @classmethod
    def check_options(cls, options: Mapping[str, Any], where: str) -> dict[str, Any]:
        """Validate a config entry's options for this backend (``where`` names the entry in messages) and return
        them as the constructor takes them. Default: the names its ``__init__`` accepts, values as given."""
        params = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = set(options) - set(params) - {"self"}
        if unknown and not takes_any:
            raise ConfigError(f"{where}: unknown key(s) for a {cls.kind} backend: {', '.join(sorted(unknown))}")
        return dict(options)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind}>"


def results_of(fn: Any, items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` with each item's exception as its result (a batched method's convention)."""
    out: list[Any] = []
    for x in items:
        try:
            out.append(fn(x))
        except Exception as exc:  # noqa: BLE001 - the item's result
            out.append(exc)
    return out
