"""KV namespaces and prefix-chained keys: determinism, isolation, token canonicalisation, bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore
from tierstore import InvalidInputError, InvalidTypeError, KVNamespace
from tierstore.kv import prefix_keys, token_tensor

NS = KVNamespace(model="Qwen/Qwen3-8B", revision="abc123", dtype="bfloat16", chunk_tokens=4)
TOKENS = [5, 17, 2, 9, 100, 3, 3, 7, 1, 0, 42]  # two full chunks of 4, a partial of 3

# Pinned so an accidental change of the canonical bytes (which would orphan every stored KV chunk) fails.
GOLDEN_FIRST_KEY = "9f1b770fbb78ccf8a1e5f65204b6f5fca6762c166169f2da798cf6a10ee05907"


def keys_hex(ns, tokens, partial=False):
    return [k.hex() for k in prefix_keys(ns, token_tensor(tokens), partial=partial)]


def test_one_key_per_full_chunk_and_prefix_property():
    keys = keys_hex(NS, TOKENS)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert keys_hex(NS, TOKENS[:8]) == keys
    assert keys_hex(NS, TOKENS[:7]) == keys[:1]
    assert keys_hex(NS, TOKENS[:3]) == []
    partial = keys_hex(NS, TOKENS, partial=True)
    assert partial[:2] == keys and len(partial) == 3
    assert keys_hex(NS, TOKENS[:10], partial=True)[2] != partial[2]


def test_keys_are_chained_over_the_whole_prefix():
    base = keys_hex(NS, TOKENS)
    changed_second = keys_hex(NS, TOKENS[:5] + [101] + TOKENS[6:])
    assert changed_second[0] == base[0] and changed_second[1] != base[1]
    changed_first = keys_hex(NS, [6] + TOKENS[1:])
    assert all(a != b for a, b in zip(changed_first, base, strict=True))
    # same second chunk after a different first chunk is a different key
    assert keys_hex(NS, [0, 0, 0, 0] + TOKENS[4:8])[1] != base[1]


@pytest.mark.parametrize("make", [
    list, tuple,
    lambda t: torch.tensor(t, dtype=torch.int64), lambda t: torch.tensor(t, dtype=torch.int32),
    lambda t: torch.tensor(t, dtype=torch.int16), lambda t: torch.tensor(t, dtype=torch.uint8),
    lambda t: np.array(t, dtype=np.int64), lambda t: np.array(t, dtype=np.uint16),
    lambda t: np.array(t, dtype=np.int8), lambda t: [np.int32(x) for x in t],
    lambda t: torch.tensor([t], dtype=torch.int64)[0],  # a non-owning view
    lambda t: torch.tensor(t)[torch.arange(len(t))],
])
def test_any_integer_container_gives_the_same_keys(make):
    assert keys_hex(NS, make(TOKENS)) == keys_hex(NS, TOKENS)


def test_non_contiguous_tensor_tokens():
    wide = torch.tensor([[t, -1] for t in TOKENS], dtype=torch.int32)[:, 0]
    assert not wide.is_contiguous()
    assert keys_hex(NS, wide) == keys_hex(NS, TOKENS)


@pytest.mark.parametrize("field,value", [
    ("model", "Qwen/Qwen3-8B-Instruct"), ("revision", "abc124"), ("dtype", "float16"),
    ("layout", "mha:vllm-hnd"), ("tp_rank", 1), ("tp_size", 2), ("pp_size", 2), ("tenant", "acme"),
    ("chunk_tokens", 5), ("format_version", 2),
])
def test_every_namespace_field_separates_keys(field, value):
    changes = {field: value}
    if field == "tp_rank":
        changes["tp_size"] = 2
    other = NS.replace(**changes)
    a, b = keys_hex(NS, TOKENS * 4), keys_hex(other, TOKENS * 4)
    assert not set(a) & set(b)


def test_namespace_normalises_torch_dtype_and_is_hashable():
    ns = KVNamespace(model="m", dtype=torch.bfloat16)
    assert ns.dtype == "bfloat16" and ns.torch_dtype is torch.bfloat16
    assert ns == KVNamespace(model="m", dtype="bfloat16") and hash(ns) == hash(KVNamespace(model="m"))
    assert KVNamespace(model="m", layout="mla").is_mla and not ns.is_mla


def test_golden_key_is_stable():
    first = keys_hex(NS, TOKENS)[0]
    if first != GOLDEN_FIRST_KEY:
        pytest.fail(f"KV key derivation changed: {first} (update GOLDEN_FIRST_KEY only with a format_version bump)")


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["12345", "random"])
def test_keys_are_identical_in_other_processes_without_pythonhashseed(seed):
    code = (
        "import json, tierstore\n"
        "from tierstore.kv import prefix_keys, token_tensor\n"
        f"ns = tierstore.KVNamespace(**json.loads({json.dumps(json.dumps(NS.__dict__))}))\n"
        f"print(json.dumps([k.hex() for k in prefix_keys(ns, token_tensor({TOKENS}), partial=True)]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == keys_hex(NS, TOKENS, partial=True)


@pytest.mark.parametrize("bad,exc", [
    ([1.0, 2.0], InvalidTypeError), ([1, True], InvalidTypeError), (["1"], InvalidTypeError),
    ([1, -2], InvalidInputError), (torch.tensor([1.0]), InvalidTypeError),
    (torch.tensor([True]), InvalidTypeError), (torch.zeros(2, 2, dtype=torch.long), InvalidInputError),
    (np.array([0.5]), InvalidTypeError), ("abc", InvalidTypeError), (None, InvalidTypeError),
    (np.array([2**63], dtype=np.uint64), InvalidInputError), ([2**63], InvalidInputError),
    ([1, 2**70], InvalidInputError), ([-(2**64)], InvalidInputError),
])
def test_bad_token_ids_are_rejected(bad, exc):
    with pytest.raises(exc):
        token_tensor(bad)


@pytest.mark.parametrize("kwargs,exc", [
    ({"model": ""}, InvalidInputError), ({"model": 3}, InvalidTypeError),
    ({"model": "m", "dtype": "float7"}, InvalidInputError),
    ({"model": "m", "tp_rank": 2, "tp_size": 2}, InvalidInputError),
    ({"model": "m", "pp_rank": 1}, InvalidInputError), ({"model": "m", "tp_size": 0}, InvalidInputError),
    ({"model": "m", "tp_rank": True}, InvalidTypeError), ({"model": "m", "tenant": ""}, InvalidInputError),
    ({"model": "m", "chunk_tokens": 0}, InvalidInputError), ({"model": "m", "revision": None}, InvalidTypeError),
])
def test_bad_namespace_fields_are_rejected(kwargs, exc):
    with pytest.raises(exc):
        KVNamespace(**kwargs)


def test_unbound_namespace_cannot_make_keys():
    with pytest.raises(InvalidInputError, match="chunk_tokens"):
        prefix_keys(KVNamespace(model="m"), token_tensor([1, 2]))


def test_public_names():
    assert tierstore.KVNamespace is KVNamespace
    assert tierstore.KVCacheStore.__name__ == "KVCacheStore"
