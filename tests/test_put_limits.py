"""``put`` refuses, whole and before any tier is touched, every chunk the object format could not read back;
views it can store (conjugate, negative) are stored as their values (probe rows 4.3, 4.9, 4.10)."""

import pytest
import torch

import tierstore
from tierstore import objformat
from tierstore.backends.file import FileBackend
from tierstore.backends.memory import HostBackend
from tierstore.errors import InvalidInputError, TierstoreError
from tierstore.keys import ChunkKey
from tierstore.testing.data import assert_same, key_of


@pytest.fixture
def store(tmp_path):
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False},
                                   {"kind": "disk", "path": str(tmp_path / "disk")},
                                   {"kind": "remote", "url": (tmp_path / "remote").as_uri()}],
                         "write_policy": "write_through"}) as s:
        yield s


UNREADABLE = {
    "65 dims": lambda: {"x": torch.zeros([1] * (objformat.MAX_DIMS + 1))},
    "a dimension over 2^40": lambda: {"x": torch.empty(0, 2 * objformat.MAX_RAW)},
    "a 9 MiB name": lambda: {"n" * (9 << 20): torch.zeros(1)},
    "a header over 8 MiB from many tensors": lambda: {f"{i:04d}" + "t" * 3000: torch.zeros(1) for i in range(3000)},
    "a meta tensor": lambda: {"ok": torch.zeros(2), "m": torch.empty(4, device="meta")},
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_store_refuses_what_the_format_cannot_read_back(store, case):
    tensors = UNREADABLE[case]()
    with pytest.raises(InvalidInputError) as err:
        store.put(key_of(0), tensors)
    assert isinstance(err.value, ValueError) and isinstance(err.value, TierstoreError)
    assert store.holders(key_of(0)) == [] and all(t.backend.stat_many([key_of(0)]) == [None] for t in store.tiers)
    assert store.stats()["tiers"]["disk"]["corrupt"] == 0


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_every_tier_refuses_it_too(tmp_path, case):
    for backend in (HostBackend(capacity=64 << 20, pinned=False), FileBackend(path=tmp_path / "d")):
        with backend, pytest.raises(InvalidInputError):
            backend.write(key_of(0), UNREADABLE[case]())
        with pytest.raises(InvalidInputError):
            objformat.encode(key_of(0), UNREADABLE[case]())


def test_largest_readable_header_is_accepted(tmp_path):
    # just under the cap: validation measures the real header instead of refusing on an estimate
    per_entry = objformat.MAX_HEADER // 3000  # ~70 bytes of each entry are not the name
    names = {f"{i:05d}" + "t" * (per_entry - 5 - 75): torch.zeros(1) for i in range(3000)}
    data = objformat.encode(key_of(0), names).tobytes()
    hdr = objformat.parse_header(data)
    assert objformat.MAX_HEADER - 32768 < hdr.payload_offset - objformat.PREFIX_SIZE <= objformat.MAX_HEADER
    assert set(objformat.decode(data, key_of(0))) == set(names)


def test_conjugate_and_negative_views_are_stored_as_their_values(store):
    x = torch.randn(8, dtype=torch.complex64)
    chunk = {"conj": x.conj(), "neg": x.conj().imag, "plain": x}
    assert chunk["conj"].is_conj() and chunk["neg"].is_neg()
    expected = {name: t.resolve_conj().resolve_neg().clone() for name, t in chunk.items()}
    key = ChunkKey.from_tensors(chunk)
    assert key == ChunkKey.from_tensors(expected)  # a view's key is the key of its values
    store.put(key, chunk)
    store.flush()
    for tier in store.tiers:
        got = tier.backend.read(key)
        assert_same(got, expected)
        assert not got["conj"].is_conj() and not got["neg"].is_neg()


def test_key_of_a_meta_tensor_is_refused():
    with pytest.raises(InvalidInputError):
        ChunkKey.from_tensors({"m": torch.empty(4, device="meta")})
