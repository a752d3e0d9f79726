"""``tierstore``'s public names: all resolve, and the heavy ones still load lazily."""

import json
import subprocess
import sys

import tierstore


def test_every_public_name_resolves():
    assert all(isinstance(name, str) for name in tierstore.__all__)
    for name in tierstore.__all__:
        assert getattr(tierstore, name) is not None, name


def test_import_stays_lazy():
    """Importing tierstore and using ChunkKey loads no torch and no tier code; ``tierstore.open`` loads the store."""
    code = "\n".join([
        "import json, sys, tierstore",
        "tierstore.ChunkKey.from_bytes(b'x').hex()",
        "before = sorted(sys.modules)",
        "tierstore.open",
        "print(json.dumps({'before': before, 'after': sorted(sys.modules)}))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    mods = json.loads(out)
    heavy = {"torch", "tierstore.store", "tierstore.kv", "tierstore.weights", "tierstore.backends.base"}
    assert not heavy & set(mods["before"]), heavy & set(mods["before"])
    assert "tierstore.store" in mods["after"]
