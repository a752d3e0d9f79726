"""Several OS processes share one remote prefix (S3 or a shared file:// mount); each has its own
host and disk tiers. Readers see what others publish; concurrent publishers of a key are harmless."""

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "store_worker.py")


def config(tmp_path, name, remote):
    return {"tiers": [{"kind": "host", "capacity": "256KiB", "pinned": False},
                      {"kind": "disk", "path": str(tmp_path / name), "capacity": "64MiB"},
                      remote]}


def spawn(cfg, role, first, count):
    env = {**os.environ, "PYTHONHASHSEED": {"publish": "1", "read": "2"}[role]}  # different seeds on purpose
    return subprocess.Popen([sys.executable, WORKER, json.dumps(cfg), role, str(first), str(count)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err[-2000:])
    return json.loads(out.strip().splitlines()[-1])


pytestmark = pytest.mark.slow  # each test runs several Python processes


@pytest.fixture(params=["s3", "file"])
def remote(request, tmp_path):
    if request.param == "file":
        return {"kind": "remote", "url": f"file://{tmp_path}/shared"}
    s3 = request.getfixturevalue("s3_server")
    return {"kind": "remote", "url": f"s3://{s3.new_bucket()}/kv", "storage_options": s3.storage_options}


def test_reader_sees_what_another_process_published(tmp_path, remote):
    reader = spawn(config(tmp_path, "b", remote), "read", 0, 24)  # starts first and waits
    writer = spawn(config(tmp_path, "a", remote), "publish", 0, 24)
    assert finish(writer) == {"published": 24}
    result = finish(reader)
    assert result["verified"] == 24
    assert "host" in result["tiers"]  # retain promoted what it read


def test_concurrent_publishers_of_the_same_keys(tmp_path, remote):
    writers = [spawn(config(tmp_path, f"w{i}", remote), "publish", 0, 16) for i in range(3)]
    for w in writers:
        assert finish(w) == {"published": 16}
    assert finish(spawn(config(tmp_path, "r", remote), "read", 0, 16))["verified"] == 16
