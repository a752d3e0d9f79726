import json

import pytest
import torch

import tierstore
from tierstore.cli import main
from tierstore.testing.tiers import chunk, key_of
from tierstore.tiers.layout import object_relpath


@pytest.fixture
def config_file(tmp_path):
    cfg = {"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                     {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}]}
    path = tmp_path / "store.json"
    path.write_text(json.dumps(cfg))
    with tierstore.open(str(path)) as store:
        for i in range(5):
            store.put(key_of(i), chunk(i))
    return path


def test_stats(config_file, tmp_path, capsys):
    assert main(["stats", "--config", str(config_file), "--json", str(tmp_path / "s.json")]) == 0
    assert "disk" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["tiers"]["disk"]["objects"] == 5


def test_verify_finds_and_removes_corrupt_objects(config_file, tmp_path, capsys):
    victim = tmp_path / "disk" / object_relpath(key_of(2))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["verify", "--config", str(config_file)]) == 1
    assert "1 corrupt" in capsys.readouterr().out
    assert not victim.exists()
    assert main(["verify", "--config", str(config_file)]) == 0
    assert main(["gc", "--config", str(config_file)]) == 0


def test_bench_tiers_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "tiers", "--chunk", "64KiB", "--count", "2", "--repeats", "1", "--no-s3",
                 "--lookup-keys", "100", "--dir", str(tmp_path), "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["disk tier get"]["value"] > 0 and rows["lookup over 100 keys"]["unit"] == "us/key"


def test_unknown_verb_exits_nonzero():
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_gc_removes_stale_remote_temp_files_only(tmp_path, capsys):
    import os
    import time
    import uuid

    root = tmp_path / "shared"
    cfg = {"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                     {"kind": "remote", "url": root.as_uri()}]}
    path = tmp_path / "store.json"
    path.write_text(json.dumps(cfg))
    with tierstore.open(str(path)) as store:
        store.put(key_of(1), chunk(1))
    obj = root / object_relpath(key_of(1))
    stale, fresh = (obj.parent / f"{obj.name}.{uuid.uuid4().hex}.tmp" for _ in range(2))
    foreign = obj.parent / "crashed.abc.tmp"  # not a name the remote tier writes: never ours to delete
    stale.write_bytes(b"half an object")
    fresh.write_bytes(b"still being written")
    foreign.write_bytes(b"someone else's")
    hour_ago = time.time() - 3700
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(foreign, (hour_ago, hour_ago))
    assert main(["gc", "--config", str(path), "--json", str(tmp_path / "gc.json")]) == 0
    assert "1 stale temp files" in capsys.readouterr().out
    assert not stale.exists() and fresh.exists() and obj.exists()
    assert json.loads((tmp_path / "gc.json").read_text())["remote"]["stale_temp_removed"] == 1
    assert main(["gc", "--config", str(path), "--stale-after", "0"]) == 0
    assert not fresh.exists() and obj.exists() and foreign.exists()
    with tierstore.open(str(path)) as store:
        assert torch.equal(store.get(key_of(1))["k"], chunk(1)["k"])
    assert main(["gc", "--config", str(path), "--older-than", "3600"]) == 0
    assert obj.exists()
    os.utime(obj, (hour_ago, hour_ago))
    assert main(["gc", "--config", str(path), "--older-than", "3600"]) == 0
    assert "1 expired objects" in capsys.readouterr().out
    assert not obj.exists() and foreign.exists()
