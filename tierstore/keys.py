"""Typed, content-derived chunk keys.

A :class:`ChunkKey` is a 32-byte blake2b digest. It never depends on Python's ``hash()`` or on
``PYTHONHASHSEED``: the same inputs give the same key in every process on every machine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn

from .errors import InvalidInputError, InvalidTypeError

if TYPE_CHECKING:  # torch loads only when tensors are keyed (from_tensors): `import tierstore` stays cheap
    import torch

DIGEST_SIZE = 32
# blake2b personalisations (<= 16 bytes): one per constructor, so no two can mint the same key
_PERSON_TENSORS = b"tierstore.tens"
_PERSON_CHAIN = b"tierstore.chain"
_PERSON_BYTES = b"tierstore.bytes"


def _frame(data: bytes) -> bytes:
    """Length-prefix ``data`` so concatenations are unambiguous."""
    return struct.pack("<Q", len(data)) + data


class ChunkKey(bytes):
    """Immutable 32-byte digest naming one chunk; hashable, and equal only to a ChunkKey of the same digest.

    A ``bytes`` subclass so that hashing and comparing it (several dict lookups per key per call) run in C;
    it never compares equal to plain ``bytes``."""

    __slots__ = ()

    def __new__(cls, digest: bytes) -> ChunkKey:
        if not isinstance(digest, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"ChunkKey takes {DIGEST_SIZE} bytes, got {type(digest).__name__}")
        key = super().__new__(cls, digest)
        if len(key) != DIGEST_SIZE:
            raise InvalidInputError(f"ChunkKey takes {DIGEST_SIZE} bytes, got {len(key)}")
        return key

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("ChunkKey is immutable")

    @property
    def digest(self) -> bytes:
        return bytes(self)

    @classmethod
    def from_hex(cls, text: str) -> ChunkKey:
        if not isinstance(text, str):
            raise InvalidTypeError(f"ChunkKey.from_hex takes a str, got {type(text).__name__}")
        if len(text) != 2 * DIGEST_SIZE:
            raise InvalidInputError(f"ChunkKey hex must be {2 * DIGEST_SIZE} characters, got {len(text)}")
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise InvalidInputError(f"ChunkKey hex is not hexadecimal: {text!r}") from exc

    @classmethod
    def from_bytes(cls, data: bytes) -> ChunkKey:
        """Digest of arbitrary bytes (e.g. a file identity plus a byte range); never equal to a
        :meth:`chain` or :meth:`from_tensors` key."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"ChunkKey.from_bytes takes bytes, got {type(data).__name__} (encode a str first)")
        return cls(hashlib.blake2b(bytes(data), digest_size=DIGEST_SIZE, person=_PERSON_BYTES).digest())

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> ChunkKey:
        """Content digest over the sorted names, dtypes, shapes and bytes of ``tensors``."""
        from .tensors import tensor_bytes, validate_tensors

        validate_tensors(tensors)
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON_TENSORS)
        for name in sorted(tensors):
            t = tensors[name]
            h.update(_frame(name.encode()))
            h.update(_frame(str(t.dtype).encode()))
            h.update(_frame(struct.pack(f"<{t.dim()}q", *t.shape)))
            data = tensor_bytes(t)
            h.update(struct.pack("<Q", len(data)))
            h.update(data)
        return cls(h.digest())

    @classmethod
    def chain(cls, parent: ChunkKey | None, namespace: bytes, payload: bytes) -> ChunkKey:
        """``H(parent ‖ namespace ‖ payload)``: the prefix-chained keys of the KV layer."""
        if parent is not None and not isinstance(parent, ChunkKey):
            raise InvalidTypeError(f"parent must be a ChunkKey or None, got {type(parent).__name__}")
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON_CHAIN)
        h.update(_frame(parent.digest if parent is not None else b""))
        h.update(_frame(bytes(namespace)))
        h.update(_frame(bytes(payload)))
        return cls(h.digest())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkKey) and bytes.__eq__(self, other)

    def __ne__(self, other: object) -> bool:  # bytes' own would compare equal to plain bytes
        return not self.__eq__(other)

    __hash__ = bytes.__hash__  # the C slot itself (bytes cache their hash): no Python call per dict lookup

    def __repr__(self) -> str:
        return f"ChunkKey({self.hex()[:16]}…)"

    __str__ = __repr__

    # copy/deepcopy support; tierstore itself never pickles
    def __reduce__(self) -> tuple[type[ChunkKey], tuple[bytes]]:
        return (ChunkKey, (bytes(self),))


def check_key(key: object) -> ChunkKey:
    """Return ``key`` if it is a ChunkKey, else raise a clear :class:`InvalidTypeError`."""
    if not isinstance(key, ChunkKey):
        raise InvalidTypeError(f"expected a tierstore.ChunkKey, got {type(key).__name__}")
    return key
