"""Forgery on a shared prefix: a co-writer without the key gets nothing loaded, on file:// and on S3.

The attacker holds what the probe's attacker held (reliability_turn3 §5.7): write access to the bucket or
mount, our own functions to derive chunk keys of a guessed prompt, and every object's bytes. Each
attack ends in a miss that is counted, and the attacked object stays where it is.
"""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

import tierstore
from tierstore import KVCacheStore, KVNamespace, objformat
from tierstore.backends.layout import object_relpath
from tierstore.keyring import format_entries, new_secret
from tierstore.keys import ChunkKey
from tierstore.testing.data import reencode

NS = KVNamespace(model="guessable/model", dtype="float32")
C = 16
PROMPT = torch.arange(4 * C)  # a system prompt anyone could guess
SECRETS = {"k2": new_secret(), "k1": new_secret()}


def kv_layers(seed: int, n: int = 4 * C) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, 2, 8, generator=g) for _ in range(2)]


def write_keys(path, keys) -> str:
    path.write_text(format_entries(keys))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(params=["file", "s3"])
def prefix(request, tmp_path):
    """``(url, storage_options)`` of an empty shared prefix."""
    if request.param == "file":
        return (tmp_path / "shared").as_uri(), None
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.new_bucket()}/kv", server.storage_options


class CoWriter:
    """Raw access to the prefix, as anyone who may write the bucket or mount has it."""

    def __init__(self, url: str, options) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **{"skip_instance_cache": True, **(options or {})})
        self.root = root.rstrip("/")

    def path(self, key: ChunkKey) -> str:
        return f"{self.root}/{object_relpath(key)}"

    def read(self, key: ChunkKey) -> bytes:
        self.fs.invalidate_cache()
        return self.fs.cat_file(self.path(key))

    def write(self, key: ChunkKey, data: bytes) -> None:
        self.fs.makedirs(os.path.dirname(self.path(key)), exist_ok=True)
        self.fs.pipe_file(self.path(key), data)

    def exists(self, key: ChunkKey) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self.path(key))


def config(url, options, keys_file=None, **auth):
    tier = {"kind": "remote", "url": url, "storage_options": options, "touch_after": None}
    if keys_file is not None:
        tier["auth"] = {"keys_file": keys_file, **auth}
    return {"tiers": [tier], "write_policy": "write_through"}


def save(cfg, layers, prompt=PROMPT) -> list[ChunkKey]:
    with tierstore.open(cfg) as store:
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        assert kv.save(prompt, layers) == len(prompt)
        store.flush()
        return kv.keys(prompt)


def load(cfg, prompt=PROMPT):
    """``(loaded layers or None, the remote tier's counters)`` from a fresh process-like store."""
    with tierstore.open(cfg) as store:
        loaded = KVCacheStore(store, NS, chunk_tokens=C).load(prompt)
        return loaded, store.stats()["tiers"]["remote"]


@pytest.fixture
def keys_file(tmp_path):
    return write_keys(tmp_path / "keys", SECRETS)


def test_with_the_key_objects_are_sealed_and_load_as_before(prefix, keys_file):
    url, options = prefix
    genuine = kv_layers(1)
    keys = save(config(url, options, keys_file), genuine)
    raw = CoWriter(url, options).read(keys[0])
    hdr = objformat.parse_header(raw)
    assert raw[8:12] == objformat.SEALED_PREFIX and hdr.seal is not None and hdr.seal.kid == "k2"
    loaded, counts = load(config(url, options, keys_file))
    assert loaded is not None and all(torch.equal(a, b) for a, b in zip(loaded, genuine, strict=True))
    assert counts["forged"] == counts["corrupt"] == 0 and counts["hits"] == len(keys)


def test_a_prompt_guessed_and_published_first_is_refused_then_replaced(prefix, keys_file, tmp_path):
    url, options = prefix
    forged = kv_layers(666)
    wrong = write_keys(tmp_path / "wrong", {"k2": new_secret()})
    keys = save(config(url, options, wrong), forged)  # sealed, with a key id the victim uses, another secret
    attacker = CoWriter(url, options)
    for key in keys[:2]:  # the first two unsealed
        attacker.write(key, _strip_seal(attacker.read(key), {}))
    victim = config(url, options, keys_file)
    with tierstore.open(victim) as store:  # an engine: the load misses, it recomputes and saves
        assert store.get_many(keys) == [None] * len(keys)
        assert store.stats()["tiers"]["remote"]["forged"] == len(keys)
        kv = KVCacheStore(store, NS, chunk_tokens=C)
        assert kv.load(PROMPT) is None and kv.lookup(PROMPT) == 0  # refused objects do not look held
        assert all(attacker.exists(k) for k in keys)  # a reader never deletes what it cannot open
        genuine = kv_layers(2)
        assert kv.save(PROMPT, genuine) == len(PROMPT)  # replacing the forgeries
        store.flush()
    loaded, counts = load(victim)
    assert loaded is not None and all(torch.equal(a, b) for a, b in zip(loaded, genuine, strict=True))
    assert counts["forged"] == 0


def _flip_payload(data: bytes, keys: dict) -> bytes:
    hdr = objformat.parse_header(data)
    payload = bytearray(data[hdr.payload_offset:])
    payload[len(payload) // 2] ^= 0x40
    return reencode(data, payload=bytes(payload))  # checksum made valid again, seal left as it was


def _damage_payload(data: bytes, keys: dict) -> bytes:
    hdr = objformat.parse_header(data)
    out = bytearray(data)
    out[hdr.payload_offset + (len(data) - hdr.payload_offset) // 3] ^= 0x01  # checksum left stale: damage
    return bytes(out)


def _copy_from_other_key(data: bytes, keys: dict) -> bytes:
    other = keys["other"]
    return reencode(other, lambda h: h.update(key=keys["this"].hex()))


def _truncate_and_fix(data: bytes, keys: dict) -> bytes:
    hdr = objformat.parse_header(data)
    last = hdr.tensors[-1]

    def shorter(h):
        h["raw_size"] = h["stored_size"] = last.offset
        h["tensors"] = h["tensors"][:-1]
    return reencode(data, shorter, payload=bytes(data[hdr.payload_offset:hdr.payload_offset + last.offset]))


def _swap_kid(kid: str):
    def attack(data: bytes, keys: dict) -> bytes:
        return reencode(data, lambda h: h["seal"].update(kid=kid))
    return attack


def _strip_seal(data: bytes, keys: dict) -> bytes:
    hdr = objformat.parse_header(data)
    return objformat.encode(hdr.key, objformat.decode(data)).tobytes()  # the same tensors, unsealed


ATTACKS = {  # name: (rewrite the stored object, counter that must see it)
    "overwrite in place": (_flip_payload, "forged"),
    "a damaged byte (checksum stale)": (_damage_payload, "corrupt"),  # the MAC stands for the checksum
    "copy a valid object to another key": (_copy_from_other_key, "forged"),
    "copy it byte for byte": (lambda data, keys: keys["other"], "corrupt"),  # the header names another key
    "truncate": (lambda data, keys: data[:-100], "corrupt"),
    "truncate and fix the header": (_truncate_and_fix, "forged"),
    "swap to the other accepted key id": (_swap_kid("k1"), "forged"),
    "swap to an unknown key id": (_swap_kid("k9"), "forged"),
    "strip the seal": (_strip_seal, "forged"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_co_writer_without_the_key_gets_nothing_loaded(prefix, keys_file, attack):
    url, options = prefix
    victim = config(url, options, keys_file)
    keys = save(victim, kv_layers(3))
    other = save(victim, kv_layers(4), PROMPT + 1000)  # another prompt's valid objects
    attacker = CoWriter(url, options)
    rewrite, counter = ATTACKS[attack]
    for key, donor in zip(keys, other, strict=True):
        attacker.write(key, rewrite(attacker.read(key), {"this": key, "other": attacker.read(donor)}))
    with tierstore.open(victim) as store:
        got = store.get_many(keys)
        counts = store.stats()["tiers"]["remote"]
    assert got == [None] * len(keys)
    assert counts[counter] == len(keys) and counts["hits"] == 0
    if counter == "forged":  # left in place: it may open in another trust domain
        assert all(attacker.exists(k) for k in keys)


def test_a_replayed_object_of_a_retired_key_is_refused(prefix, tmp_path):
    url, options = prefix
    old_ring = write_keys(tmp_path / "old", {"k1": SECRETS["k1"]})
    key = ChunkKey(bytes(range(32)))
    with tierstore.open(config(url, options, old_ring)) as store:
        assert store.put(key, {"x": torch.zeros(64)})
    attacker = CoWriter(url, options)
    replay = attacker.read(key)
    rotated = write_keys(tmp_path / "new", {"k2": SECRETS["k2"]})  # k1 retired after the rotation
    with tierstore.open(config(url, options, rotated)) as store:
        assert store.put(key, {"x": torch.ones(64)})
        store.flush()
    attacker.write(key, replay)
    with tierstore.open(config(url, options, rotated)) as store:
        assert store.get(key) is None
        assert store.stats()["tiers"]["remote"]["forged"] == 1


def test_rotation_reads_both_keys_and_writes_the_first(prefix, tmp_path):
    url, options = prefix
    a, b = ChunkKey(bytes(32)), ChunkKey(bytes([1] * 32))
    with tierstore.open(config(url, options, write_keys(tmp_path / "old", {"k1": SECRETS["k1"]}))) as store:
        assert store.put(a, {"x": torch.full((8,), 1.0)})
    both = write_keys(tmp_path / "both", {"k2": SECRETS["k2"], "k1": SECRETS["k1"]})
    with tierstore.open(config(url, options, both)) as store:
        assert store.put(b, {"x": torch.full((8,), 2.0)})
        assert torch.equal(store.get(a)["x"], torch.full((8,), 1.0))
    attacker = CoWriter(url, options)
    assert objformat.parse_header(attacker.read(b)).seal.kid == "k2"
    with tierstore.open(config(url, options, both, write_key="k1")) as store:
        assert store.put(b, {"x": torch.full((8,), 3.0)})
        store.flush()
    assert objformat.parse_header(attacker.read(b)).seal.kid == "k1"


def test_legacy_objects_are_read_only_when_the_config_says_so(prefix, keys_file):
    url, options = prefix
    key = ChunkKey(bytes([7] * 32))
    with tierstore.open(config(url, options)) as store:  # written before sealing was turned on
        assert store.put(key, {"x": torch.arange(5)})
    with tierstore.open(config(url, options, keys_file)) as store:
        assert store.get(key) is None and store.stats()["tiers"]["remote"]["forged"] == 1
    with tierstore.open(config(url, options, keys_file, legacy="read")) as store:
        assert torch.equal(store.get(key)["x"], torch.arange(5))
    with tierstore.open(config(url, options)) as store:  # a reader without keys reads sealed objects too
        store_key = ChunkKey(bytes([8] * 32))
        with tierstore.open(config(url, options, keys_file)) as sealer:
            assert sealer.put(store_key, {"y": torch.arange(3)})
        assert torch.equal(store.get(store_key)["y"], torch.arange(3))


def test_tenants_under_one_master_cannot_open_each_others_objects(prefix, keys_file, tmp_path):
    url, options = prefix
    key = ChunkKey(bytes([9] * 32))
    with tierstore.open(config(url, options, keys_file, tenant="acme")) as store:
        assert store.put(key, {"x": torch.arange(4)})
    with tierstore.open(config(url, options, keys_file, tenant="globex")) as store:
        assert store.get(key) is None and store.stats()["tiers"]["remote"]["forged"] == 1
    with tierstore.open(config(url, options, keys_file)) as store:  # the master itself is another domain
        assert store.get(key) is None
    # the tenant's own keys, derived offline (`tierstore keygen --tenant`), open them without the master
    from tierstore.keyring import read_keys_file, tenant_secret

    derived = {kid: tenant_secret(s, "acme") for kid, s in read_keys_file(keys_file, "t").items()}
    with tierstore.open(config(url, options, write_keys(tmp_path / "acme", derived))) as store:
        assert torch.equal(store.get(key)["x"], torch.arange(4))


# ---------------------------------------------------------------- encryption at rest (auth.encrypt)

def _held(layers, raw: bytes) -> bool:
    """Whether a 64-byte run of the KV's bytes appears in ``raw`` (the first layer, its middle)."""
    flat = layers[0].reshape(-1).numpy().tobytes()
    return flat[len(flat) // 2:len(flat) // 2 + 64] in raw


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_encrypted_objects_hide_the_kv_and_load_as_before(prefix, keys_file, codec):
    url, options = prefix
    genuine = kv_layers(11)
    cfg = config(url, options, keys_file, encrypt=True)
    cfg["tiers"][0]["compression"] = codec
    keys = save(cfg, genuine)
    attacker = CoWriter(url, options)
    stored = {k: attacker.read(k) for k in keys}
    plain = save(config(url + "-plain", options, keys_file), genuine)  # the same KV sealed, not encrypted
    assert any(_held(genuine, CoWriter(url + "-plain", options).read(k)) for k in plain)
    assert not any(_held(genuine, raw) for raw in stored.values())
    hdr = objformat.parse_header(stored[keys[0]])
    assert hdr.seal is not None and hdr.seal.enc is not None and hdr.seal.enc.alg == "aes-256-gcm"
    for reader in (cfg, config(url, options, keys_file)):  # a reader that does not encrypt still decrypts
        loaded, counts = load(reader)
        assert loaded is not None and all(torch.equal(a, b) for a, b in zip(loaded, genuine, strict=True))
        assert counts["forged"] == counts["corrupt"] == 0
    with tierstore.open(cfg) as store:  # the same values put again: the same objects (a synthetic IV)
        assert all(store.put_many(list(zip(keys, store.get_many(keys), strict=True))))
        store.flush()
    assert {k: attacker.read(k) for k in keys} == stored


def test_a_tier_reading_encrypted_objects_counts_their_stored_size(prefix, keys_file):
    # what a cold read indexes (and counts as read) is the object as stored, not the plain copy it decrypts to
    from tierstore.backends.base import Hit
    from tierstore.backends.fsspec import FsspecBackend

    url, options = prefix
    keys = save(config(url, options, keys_file, encrypt=True), kv_layers(14))
    sizes = [len(CoWriter(url, options).read(k)) for k in keys]
    with FsspecBackend(url=url, storage_options=options, list_on_open=False, touch_after=None,
                       auth={"keys_file": keys_file}) as remote:
        got = remote.read_many(keys)
        assert all(isinstance(g, Hit) for g in got) and [g.size for g in got] == sizes
        objects = remote.read_objects(keys)
        assert [o.size for o in objects] == sizes
        assert all(o.value.header.seal is None and o.value.size < size for o, size in zip(objects, sizes, strict=True))
        assert remote.stat_many(keys) == sizes
    cold = config(url, options, keys_file)
    cold["tiers"][0]["list_on_open"] = False
    with tierstore.open(cold) as store:  # a cold store indexes what its reads found
        assert all(g is not None for g in store.get_many(keys))
        counts = store.stats()["tiers"]["remote"]
        assert counts["used_bytes"] == counts["bytes_out"] == sum(sizes)


def test_an_encrypted_object_is_a_miss_without_keys_and_is_left_in_place(prefix, keys_file):
    url, options = prefix
    keys = save(config(url, options, keys_file, encrypt=True), kv_layers(12))
    loaded, counts = load(config(url, options))  # a tier with no keys at all
    assert loaded is None and counts["unsupported"] == len(keys) and counts["hits"] == 0
    assert counts["forged"] == counts["corrupt"] == counts["errors"] == 0
    assert all(CoWriter(url, options).exists(k) for k in keys)


def test_ciphertext_is_bound_to_its_identity(keys_file):
    # the AEAD's associated data is the chunk key and key id: ciphertext under another identity does not
    # decrypt, even for a writer who could make the MAC (the two checks are independent)
    from tierstore import sealing
    from tierstore.errors import ForgedObjectError
    from tierstore.keyring import Keyring

    ring = Keyring.from_options({"keys_file": keys_file, "encrypt": True})
    a, b = ChunkKey.from_bytes(b"a"), ChunkKey.from_bytes(b"b")
    sealed = sealing.seal(objformat.encode(a, {"x": torch.arange(1000.0)}), ring)
    plain = sealing.decrypted(sealed, ring)
    assert torch.equal(objformat.decode_encoded(plain)["x"], torch.arange(1000.0))
    assert plain.header.seal is None and plain.intact()  # what local tiers keep: a plain, checksummed object
    from dataclasses import replace
    moved = objformat.Encoded(sealed.parts, replace(sealed.header, key=b))
    with pytest.raises(ForgedObjectError, match="does not decrypt"):
        sealing.decrypted(moved, ring)
    flipped = bytearray(sealed.parts[1])
    flipped[10] ^= 1
    with pytest.raises(ForgedObjectError, match="does not decrypt"):
        sealing.decrypted(objformat.Encoded([sealed.parts[0], flipped], sealed.header), ring)


def test_promotion_from_an_encrypted_tier_keeps_plain_objects_locally(prefix, keys_file, tmp_path):
    url, options = prefix
    genuine = kv_layers(13)
    keys = save(config(url, options, keys_file, encrypt=True), genuine)
    remote = config(url, options, keys_file)["tiers"][0]
    disk = {"kind": "disk", "path": str(tmp_path / "disk")}
    with tierstore.open({"tiers": [disk, remote], "prefetch_policy": "retain"}) as store:
        assert all(g is not None for g in store.get_many(keys))
        store.flush()
    with tierstore.open({"tiers": [disk]}) as store:  # the disk alone: plain objects it reads itself
        loaded = KVCacheStore(store, NS, chunk_tokens=C).load(PROMPT)
        assert loaded is not None and all(torch.equal(a, b) for a, b in zip(loaded, genuine, strict=True))
        assert store.stats()["tiers"]["disk"]["hits"] == len(keys)


def test_encrypt_must_be_a_boolean(keys_file):
    with pytest.raises(tierstore.ConfigError, match="encrypt"):
        tierstore.open({"tiers": [{"kind": "remote", "url": "memory://x",
                                   "auth": {"keys_file": keys_file, "encrypt": "yes"}}]})


def test_a_keys_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    """Reliability probe 2.11: a FIFO nobody writes blocked tierstore.open in open()."""
    import threading

    from tierstore.keyring import read_keys_file

    fifo = tmp_path / "keys"
    os.mkfifo(fifo, 0o600)
    raised: list = []
    t = threading.Thread(daemon=True, target=lambda: raised.append(
        pytest.raises(tierstore.ConfigError, read_keys_file, str(fifo), "auth")))
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the open so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO keys_file blocked")
    assert raised and "not a regular file" in str(raised[0].value)
