import json

import pytest
import torch

import tierstore
from tierstore.backends.layout import object_relpath
from tierstore.cli import main
from tierstore.testing.data import chunk, key_of


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


def test_verify_reports_corrupt_objects_and_repair_removes_them(config_file, tmp_path, capsys):
    victim = tmp_path / "disk" / object_relpath(key_of(2))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["verify", "--config", str(config_file)]) == 1
    assert "1 corrupt (kept" in capsys.readouterr().out
    assert victim.exists()  # plain verify is read-only
    assert main(["verify", "--repair", "--config", str(config_file)]) == 1
    assert "1 corrupt (1 removed)" in capsys.readouterr().out
    assert not victim.exists()
    assert main(["verify", "--config", str(config_file)]) == 0
    assert main(["gc", "--config", str(config_file)]) == 0


def test_bench_tiers_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "tiers", "--chunk", "64KiB", "--count", "2", "--repeats", "1", "--no-s3",
                 "--lookup-keys", "100", "--dir", str(tmp_path), "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["disk backend read"]["value"] > 0 and rows["lookup over 100 keys"]["unit"] == "us/key"
    assert "bench tiers: 5/5 sections (100%)" in capsys.readouterr().err  # progress while it runs


def test_unknown_verb_exits_nonzero():
    with pytest.raises(SystemExit) as ei:
        main(["frobnicate"])
    assert ei.value.code == 2  # argparse's usage error


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
    assert fresh.exists()  # within the grace period: its writer may still be filling it
    assert main(["gc", "--config", str(path), "--stale-after", "0", "--grace", "0"]) == 0
    assert not fresh.exists() and obj.exists() and foreign.exists()
    with tierstore.open(str(path)) as store:
        assert torch.equal(store.get(key_of(1))["k"], chunk(1)["k"])
    assert main(["gc", "--config", str(path), "--older-than", "3600"]) == 0
    assert obj.exists()
    os.utime(obj, (hour_ago, hour_ago))
    assert main(["gc", "--config", str(path), "--older-than", "1h"]) == 0
    assert "removed 1 objects" in capsys.readouterr().out
    assert not obj.exists() and foreign.exists()


def _owner(config_path, ready: str = "ready"):
    """Another process that opens the store from ``config_path`` and keeps it open (an engine)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    repo = str(Path(tierstore.__file__).resolve().parent.parent)
    code = textwrap.dedent(f"""
        import time
        import tierstore
        from tierstore.testing.data import chunk, key_of
        store = tierstore.open({str(config_path)!r})
        store.put(key_of(9), chunk(9))
        store.flush()
        print({ready!r}, flush=True)
        time.sleep(120)
    """)
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_stats_and_verify_beside_a_live_engine_gc_refuses(config_file, tmp_path, capsys):  # review C10, D.9
    victim = tmp_path / "disk" / object_relpath(key_of(2))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    engine = _owner(config_file)
    try:
        assert engine.stdout.readline().strip() == "ready", engine.stderr.read()
        capsys.readouterr()
        assert main(["stats", "--config", str(config_file), "--json", str(tmp_path / "s.json")]) == 0
        assert json.loads((tmp_path / "s.json").read_text())["tiers"]["disk"]["objects"] == 6
        assert main(["verify", "--config", str(config_file)]) == 1
        assert "6 objects, 5 ok, 1 corrupt" in capsys.readouterr().out
        for verb in (["gc"], ["verify", "--repair"]):
            assert main([*verb, "--config", str(config_file)]) == 2
            err = capsys.readouterr().err
            assert "refused, nothing removed" in err and f"pid {engine.pid}" in err
        assert victim.exists()  # nothing was removed beside the engine
    finally:
        engine.kill()
        engine.wait()
    assert main(["gc", "--config", str(config_file)]) == 0
    assert "removed 1 corrupt" in capsys.readouterr().out and not victim.exists()


def test_verify_and_gc_never_follow_a_symlinked_folder(tmp_path, capsys):  # probe 8.5
    root = tmp_path / "disk"
    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(root)}]}))
    with tierstore.open(str(cfg)) as store:
        store.put(key_of(0), chunk(0))
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = outside / ("ab" + "0" * 62 + ".tso")
    planted.write_bytes(b"someone else's file that happens to have our name")
    for p in (root / "ab").iterdir():
        p.unlink()
    (root / "ab").rmdir()
    (root / "ab").symlink_to(outside)
    assert main(["verify", "--config", str(cfg)]) == 0
    assert main(["verify", "--repair", "--config", str(cfg)]) == 0
    assert main(["gc", "--config", str(cfg)]) == 0
    assert planted.read_bytes().startswith(b"someone else's")
    assert "disk: 1 objects, 1 ok, 0 corrupt" in capsys.readouterr().out


def test_stats_lists_every_instance_directory(tmp_path, capsys):
    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "instances": 3}]}))
    with tierstore.open(str(cfg)) as a, tierstore.open(str(cfg)) as b:
        a.put(key_of(0), chunk(0))
        b.put(key_of(1), chunk(1))
        b.put(key_of(2), chunk(2))
        assert main(["stats", "--config", str(cfg), "--json", str(tmp_path / "s.json")]) == 0
    tiers = json.loads((tmp_path / "s.json").read_text())["tiers"]
    assert {name: t["objects"] for name, t in tiers.items()} == {"disk": 1, "disk.1": 2}
    assert tiers["disk.1"]["path"] == str(tmp_path / "d.1")


def test_repair_leaves_a_read_only_disk_alone(config_file, tmp_path, capsys):
    victim = tmp_path / "disk" / object_relpath(key_of(2))
    victim.write_bytes(victim.read_bytes()[:-1])
    cfg = json.loads(config_file.read_text())
    cfg["tiers"][1]["read_only"] = True
    config_file.write_text(json.dumps(cfg))
    assert main(["gc", "--config", str(config_file)]) == 0
    assert main(["verify", "--repair", "--config", str(config_file)]) == 1
    assert "1 corrupt (0 removed)" in capsys.readouterr().out and victim.exists()


def test_gc_of_the_remote_tier_runs_beside_a_live_engine(tmp_path, capsys):  # review turn 4 #9
    """The ops recipe: ``gc --tier remote`` with the engine's own config (which has a disk tier the engine
    holds) opens only the remote tier, needs no disk lock, and keeps the prefix within budget."""
    root = tmp_path / "shared"
    cfg = {"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                     {"kind": "disk", "path": str(tmp_path / "disk")},
                     {"kind": "remote", "url": root.as_uri()}]}
    path = tmp_path / "store.json"
    path.write_text(json.dumps(cfg))
    with tierstore.open(str(path)) as store:
        for i in range(8):
            store.put(key_of(i), chunk(i))
    engine = _owner(path)
    try:
        assert engine.stdout.readline().strip() == "ready", engine.stderr.read()
        capsys.readouterr()
        assert main(["gc", "--config", str(path), "--max-size", "0", "--grace", "0"]) == 2  # the whole config
        assert "refused, nothing removed" in capsys.readouterr().err
        assert main(["gc", "--config", str(path), "--tier", "remote", "--max-size", "0", "--grace", "0",
                     "--json", str(tmp_path / "gc.json")]) == 0
        assert json.loads((tmp_path / "gc.json").read_text())["remote"]["removed_objects"] == 9
        assert not [p for p in root.rglob("*") if p.is_file()]
        assert (tmp_path / "disk" / object_relpath(key_of(1))).exists()  # the engine's disk: never opened
        capsys.readouterr()
        assert main(["gc", "--config", str(path), "--tier", "nope"]) == 2
        assert "no tier named nope" in capsys.readouterr().err
    finally:
        engine.kill()
        engine.wait()


def test_bench_writeback_smoke(tmp_path, capsys):
    out = tmp_path / "wb.json"
    assert main(["bench", "writeback", "--count", "16", "--size", "4096", "--latency", "0.01", "--repeats", "1",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["reference"]["s"] > 0 and r["writeback"]["s"] > 0 and r["writeback_before"]["s"] > 0
    assert "write-back / reference" in capsys.readouterr().out


def test_bench_hit_smoke(tmp_path, capsys):
    out = tmp_path / "hit.json"
    assert main(["bench", "hit", "--calls", "50", "--blocks", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["now"]["median_us"] > 0 and r["with_future"]["median_us"] > 0
