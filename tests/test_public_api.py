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
    code = "import json, sys, tierstore; print(json.dumps([m for m in sys.modules if m.startswith('tierstore.')]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert not loaded & {"tierstore.store", "tierstore.kv", "tierstore.weights", "tierstore.tiers"}, loaded
