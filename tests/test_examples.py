"""The engine-free examples run as a newcomer runs them, and leave nothing behind; so does `bench weights`
(issue 38: load_weights.py left 131 MB per run in $TMPDIR, bench weights two checkpoint copies in
~/.cache/tierstore)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "home").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TIERSTORE_CONFIG", None)
    return env


def _left(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.parametrize("example", ["store_basics.py", "kv_cache.py", "load_weights.py"])
def test_example_runs_and_removes_what_it_wrote(example, tmp_path):
    env = _env(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _left(tmp_path / "tmp") == [] and _left(tmp_path / "home") == []


@pytest.mark.slow
def test_bench_weights_removes_its_checkpoints(tmp_path):
    env = _env(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tierstore", "bench", "weights", "--size", "8MiB", "--shard-size",
                           "4MiB", "--no-s3", "--no-cold", "--only", "tierstore load_into", "--repeat", "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "removed " in proc.stdout
    assert _left(tmp_path / "home") == []
