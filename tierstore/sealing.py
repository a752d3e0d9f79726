"""Sealed objects: a MAC over each object's identity and bytes, for tiers other writers can reach.

A checksum catches damage, not forgery: whoever can write a shared bucket or mount can publish an object
for a guessed prompt's chunk key, or rewrite one in place, and every reader would load it. A tier with
keys (:class:`~tierstore.keyring.Keyring`) therefore **seals** what it writes — format version 2
(:mod:`tierstore.objformat`) — and **opens** what it reads: an object counts only when its tag is
keyed BLAKE3 of ``CONTEXT``, the prefix's magic, version and header length, the header JSON (chunk key,
codec, sizes, tensor layout, key id) and the stored payload, under a key this reader holds. So an object
is valid only for the key it names, only with the layout it was written with, and only from someone
who holds the key; a reader that cannot open one counts it ``forged`` and leaves it in place
(:class:`~tierstore.errors.ForgedObjectError`).

Keyed BLAKE3 (the ``blake3`` package) is a PRF needing no nonce; measured here at 6.7 GB/s a thread
against 1.9 for HMAC-SHA256 and 1.1 for keyed BLAKE2b (4 MiB inputs), it releases the GIL, so a
remote tier's readers check tags in parallel. Sealing rewrites only the header: the payload's buffers
are reused (write-back of a disk object to the remote moves its bytes, it does not re-encode them).

Not covered: a replayed older object *of the same key* still opens (the tag says who wrote which
key's bytes, not when); content-addressed KV keys have one value, and a retired key id makes its
objects fail. Anyone with write access can still delete objects (a miss, never wrong data).
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import replace
from typing import Any

import blake3

from .errors import ForgedObjectError
from .keyring import Keyring
from .objformat import (
    MAGIC,
    PREFIX_SIZE,
    SEALED_VERSION,
    TAG_SIZE,
    Encoded,
    Header,
    Seal,
    checksum,
    header_region,
)

CONTEXT = b"tierstore sealed object v2\0"
ALG = "blake3"
_HEAD = struct.Struct("<8sII")  # magic, version, header length: the prefix before its checksum


def _begin(key: bytes, head: memoryview, region: memoryview) -> Any:
    """The keyed hasher fed what the tag covers before the payload: context, prefix, header JSON."""
    h = blake3.blake3(key=key)
    h.update(CONTEXT)
    h.update(head)
    h.update(region)
    return h


def _tag(key: bytes, head: memoryview, region: memoryview, payload: list[object]) -> bytes:
    h = _begin(key, head, region)
    for part in payload:
        h.update(part)  # buffers
    return bytes(h.digest())


def seal(enc: Encoded, keyring: Keyring) -> Encoded:
    """``enc`` sealed with the keyring's write key: a new header region (same fields plus the seal and
    its tag) over the same payload buffers."""
    payload = enc.parts[1:]
    region = bytearray(header_region(enc.header, {"alg": ALG, "kid": keyring.write_id}))
    head = _HEAD.pack(MAGIC, SEALED_VERSION, len(region))
    key = keyring.mac_key(keyring.write_id)
    assert key is not None  # Keyring checks that write_id is among its keys
    tag = _tag(key, memoryview(head), memoryview(region)[:-TAG_SIZE], payload)
    region[-TAG_SIZE:] = tag
    hdr = replace(enc.header, payload_offset=PREFIX_SIZE + len(region), seal=Seal(ALG, keyring.write_id, tag))
    return Encoded([head + checksum(region, payload) + bytes(region), *payload], hdr)


def open_sealed(enc: Encoded, keyring: Keyring) -> None:
    """Check a parsed object's seal against ``keyring``; raise :class:`ForgedObjectError` saying why it
    does not open. An unsealed object passes only under ``legacy: read``."""
    if enc.header.seal is None:
        if keyring.legacy == "read":
            return
        raise ForgedObjectError(f"object {enc.header.key.hex()} is not sealed (written without a key, or before "
                                f"sealing was turned on: auth.legacy: read accepts those)")
    h = start(enc.header, memoryview(enc.parts[0]).cast("B"), keyring)
    for part in enc.parts[1:]:
        h.update(part)
    finish(enc.header, h)


def start(hdr: Header, first: memoryview, keyring: Keyring) -> Any:
    """The MAC of the sealed object whose bytes before the payload are ``first``, fed up to its payload: feed
    the payload, then :func:`finish` (a reader can hash the payload as it reads it). Raises
    :class:`ForgedObjectError` when the object is sealed with a key id ``keyring`` lacks."""
    assert hdr.seal is not None
    key = keyring.mac_key(hdr.seal.kid)
    if key is None:
        raise ForgedObjectError(f"object {hdr.key.hex()} is sealed with key id {hdr.seal.kid!r}, which this reader "
                                f"does not hold (it holds {', '.join(keyring.keys)})")
    return _begin(key, first[:_HEAD.size], first[PREFIX_SIZE:hdr.payload_offset - TAG_SIZE])


def finish(hdr: Header, mac: Any) -> None:
    """Compare the MAC fed by :func:`start` and the payload with the object's tag."""
    assert hdr.seal is not None
    if not hmac.compare_digest(mac.digest(), hdr.seal.tag):
        raise ForgedObjectError(f"object {hdr.key.hex()}: its seal (key id {hdr.seal.kid!r}) does not match its "
                                f"bytes (altered, or sealed without the key)")
