"""Users' type checkers see tierstore's annotations (issue 38): the wheel ships ``py.typed``, and
``tierstore.open()`` is typed as the :class:`tierstore.Store` protocol both stores implement."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import ChunkKey, InvalidInputError

ROOT = Path(__file__).resolve().parents[1]
USER_SCRIPT = """
import tierstore
from tierstore import ChunkKey

with tierstore.open({"tiers": [{"kind": "host", "capacity": "1MiB"}]}) as store:
    got = store.get_many([ChunkKey.from_bytes(b"x")])
    reveal_type(tierstore.open)
    reveal_type(store)
    reveal_type(got)
    reveal_type(store.put(ChunkKey.from_bytes(b"y"), {"k": got[0]["k"]} if got[0] else {}))
    store.get_many("not a list of keys", device=3)
    kv = tierstore.KVCacheStore(store, tierstore.KVNamespace(model="m", dtype="float32", layout="mha"))
    reveal_type(kv.lookup([1, 2, 3]))
    reveal_type(tierstore.weights.load("model.safetensors", store=store))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """tierstore as pip installs it (the built wheel, unpacked): what a user's mypy reads."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp.glob("tierstore-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "tierstore/py.typed" in z.namelist()
        z.extractall(tmp / "site")
    return tmp / "site"


@pytest.mark.slow
def test_mypy_on_a_user_script_sees_the_real_types(installed, tmp_path):
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(installed), "MYPY_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(script)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    out = proc.stdout
    assert "missing library stubs or py.typed marker" not in out, out
    assert 'Revealed type is "def (config: ' in out and ') -> tierstore.api.Store"' in out, out
    assert 'Revealed type is "tierstore.api.Store"' in out, out
    assert 'Revealed type is "builtins.list[builtins.dict[builtins.str, torch._tensor.Tensor] | None]"' in out \
        or 'Revealed type is "list[dict[str, torch._tensor.Tensor] | None]"' in out, out
    assert 'Revealed type is "builtins.bool"' in out or 'Revealed type is "bool"' in out, out
    # the wrong call is caught: a str is not a sequence of ChunkKey, 3 is not a device
    assert 'Argument 1 to "get_many" of "Store" has incompatible type "str"' in out, out
    assert 'Argument "device" to "get_many" of "Store" has incompatible type "int"' in out, out
    assert out.count("error:") == 2, out  # the store from open() fits KVCacheStore and the weights loader
    assert 'Revealed type is "builtins.int"' in out or 'Revealed type is "int"' in out, out


def test_both_stores_implement_the_protocol(tmp_path):
    from tierstore.api import Store

    names = [n for n in Store.__dict__ if not n.startswith("_") or n in ("__enter__", "__exit__")]
    socket = f"unix://{tmp_path}/none.sock"  # a client may open before its server: every call a miss
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "1MiB"}]}) as embedded, \
            tierstore.open({"server": socket}) as client:
        for store in (embedded, client):
            missing = [n for n in names if not hasattr(store, n)]
            assert not missing, (type(store).__name__, missing)
            assert all(isinstance(t.name, str) and isinstance(t.kind, str) for t in store.tiers)
        assert client.get(ChunkKey.from_bytes(b"k")) is None
    assert tierstore.Store is Store


@pytest.mark.parametrize("device", ["bogus", "cuda:99", "meta:0x"])
def test_get_on_a_device_that_does_not_exist_raises(device, tmp_path):
    if device == "cuda:99" and not torch.cuda.is_available():
        device = "cuda"
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False}]}) as store:
        key = ChunkKey.from_bytes(b"k")
        store.put(key, {"x": torch.arange(4)})
        with pytest.raises(InvalidInputError, match="device"):
            store.get(key, device=device)
        with pytest.raises(InvalidInputError, match="device"):
            store.get_many([key], device=device)
        assert store.stats()["tiers"]["host"].get("failures", {}) == {}  # not counted as a tier's failure
        assert torch.equal(store.get(key, device="cpu")["x"], torch.arange(4))
