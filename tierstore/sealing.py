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

**Encryption** (``auth.encrypt: true``): the payload is also encrypted with AES-256-GCM (``cryptography``)
before it is sealed, for tenants whose prompts must not be readable on shared storage. The IV is
synthetic — keyed BLAKE3 of the chunk key and plaintext — and the object's AES key is derived from it, so
the nonce can never repeat under one key with another plaintext (saving the same value twice writes the
same object: nothing leaks but that equality, which content addressing implies anyway); the associated
data is the object's identity (chunk key and key id), so ciphertext moved to another key does not decrypt
even before the MAC says so. Headers (tensor names, shapes, sizes) stay readable. Readers decrypt what
they open, into a plain object for the local tiers (which never hold ciphertext).

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
import torch

from .errors import CorruptObjectError, ForgedObjectError, UnsupportedObjectError
from .keyring import Keyring
from .objformat import (
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    SEALED_VERSION,
    TAG_SIZE,
    VERSION,
    Encoded,
    Encryption,
    Header,
    Seal,
    alloc_bytes,
    checksum,
    header_region,
)

CONTEXT = b"tierstore sealed object v2\0"
ALG = "blake3"
ENCRYPTION_ALG = "aes-256-gcm"
_IV_CONTEXT = b"tierstore synthetic iv v2\0"
_KEY_CONTEXT = b"tierstore object key v2\0"
_AAD_CONTEXT = b"tierstore encrypted object v2\0"
_NONCE = bytes(12)  # every object has its own key (derived from its IV): a fixed nonce never repeats a pair
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
    its tag) over the same payload buffers — or over their ciphertext when the keyring encrypts."""
    kid = keyring.write_id
    payload = enc.parts[1:]
    encryption = None
    if keyring.encrypt:
        payload, encryption = _encrypt(enc.header, payload, keyring)
    unsealed = Seal(ALG, kid, b"", encryption)
    region = bytearray(header_region(enc.header, unsealed.fields()))
    head = _HEAD.pack(MAGIC, SEALED_VERSION, len(region))
    key = keyring.mac_key(kid)
    assert key is not None  # Keyring checks that write_id is among its keys
    tag = _tag(key, memoryview(head), memoryview(region)[:-TAG_SIZE], payload)
    region[-TAG_SIZE:] = tag
    hdr = replace(enc.header, payload_offset=PREFIX_SIZE + len(region), seal=replace(unsealed, tag=tag))
    return Encoded([head + checksum(region, payload) + bytes(region), *payload], hdr)


def _cipher(keyring: Keyring, kid: str, iv: bytes, tag: bytes | None = None) -> Any:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    base = keyring.encryption_key(kid)
    assert base is not None  # the caller opened (or is making) a seal with this id
    key = blake3.blake3(_KEY_CONTEXT + iv, key=base).digest()
    return Cipher(algorithms.AES(key), modes.GCM(_NONCE, tag))


def _aad(hdr: Header, kid: str) -> bytes:
    return _AAD_CONTEXT + hdr.key.digest + kid.encode()


def _crypt(ctx: Any, parts: list[Any], size: int) -> torch.Tensor:
    """Run ``parts`` through an encryptor or decryptor into one fresh buffer of ``size`` bytes."""
    out = alloc_bytes(size + 15)  # update_into wants room for a block's worth more
    mv = out.numpy().data
    pos = 0
    for part in parts:
        pos += ctx.update_into(part, mv[pos:])
    if pos != size:
        raise CorruptObjectError(f"payload of {pos} bytes, the header says {size}")
    return out[:size]


def _encrypt(hdr: Header, payload: list[Any], keyring: Keyring) -> tuple[list[Any], Encryption]:
    kid = keyring.write_id
    base = keyring.encryption_key(kid)
    assert base is not None
    h = blake3.blake3(_IV_CONTEXT + hdr.key.digest, key=base)
    for part in payload:
        h.update(part)
    iv = h.digest()
    ctx = _cipher(keyring, kid, iv).encryptor()
    ctx.authenticate_additional_data(_aad(hdr, kid))
    out = _crypt(ctx, payload, hdr.stored_size)
    ctx.finalize()
    return [out.numpy().data], Encryption(ENCRYPTION_ALG, iv, ctx.tag)


def decrypted(enc: Encoded, keyring: Keyring) -> Encoded:
    """The plain (version 1) object of an opened, encrypted one: its payload decrypted, a fresh checksum.

    Raises:
        ForgedObjectError: the ciphertext does not decrypt under its identity.
        UnsupportedObjectError: this reader lacks the ``cryptography`` package.
    """
    hdr = enc.header
    assert hdr.seal is not None and hdr.seal.enc is not None
    try:
        ctx = _cipher(keyring, hdr.seal.kid, hdr.seal.enc.iv, hdr.seal.enc.tag).decryptor()
    except ImportError:
        raise UnsupportedObjectError(f"object {hdr.key.hex()} is encrypted; reading it needs the cryptography "
                                     f"package (tierstore's 'encryption' extra: pip install cryptography)") from None
    from cryptography.exceptions import InvalidTag

    ctx.authenticate_additional_data(_aad(hdr, hdr.seal.kid))
    plain = _crypt(ctx, enc.parts[1:], hdr.stored_size)
    try:
        ctx.finalize()
    except InvalidTag:
        raise ForgedObjectError(f"object {hdr.key.hex()}: its payload does not decrypt under its identity") from None
    region = header_region(hdr)
    payload = [plain.numpy().data]
    plain_hdr = replace(hdr, payload_offset=PREFIX_SIZE + len(region), seal=None)
    return Encoded([PREFIX.pack(MAGIC, VERSION, len(region), checksum(region, payload)) + region, *payload], plain_hdr)


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
