"""Two MLA engines (TP=2 each, ranks in their own processes under one launcher each, as SGLang starts
them) on one host with a disk tier that has ``instances``: the second engine's writer rank takes the second
directory, and its reader rank must read that one, not the first engine's (reliability probe 4.5: engine
2's reader found 0 of its 10 pages while its writer found 10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tierstore

ADAPTERS = Path(__file__).resolve().parent

_RANK = r"""
import json, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/../../adapters/sglang"]
from sglang_fakes import PAGE, PROMPT, Instance
root, rank, offset, work = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
extra = {"config": {"tiers": [{"kind": "disk", "path": root, "capacity": "64MiB", "instances": 8}]}}
prompt = [t + offset for t in PROMPT]  # each engine serves its own prompt
inst = Instance(extra, mla=True, seed=rank + offset, tp_rank=rank, tp_size=2)
if rank == 0:
    assert inst.ctl.backup(inst.pool.alloc(10 * PAGE), prompt) == 10
    (work / "written").touch()
    result = {"dir": inst.backend.store.tiers[0].backend.path}
else:
    while not (work / "written").exists():
        time.sleep(0.02)
    loaded, _ = inst.ctl.prefetch(prompt)
    result = {"dir": inst.backend.store.tiers[0].backend.path, "loaded": loaded}
print(json.dumps(result), flush=True)
while not (work / "stop").exists():
    time.sleep(0.02)
inst.backend.close()
"""

_LAUNCHER = r"""
import subprocess, sys
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:4], str(r), *sys.argv[4:]],
                          stdout=subprocess.PIPE, text=True) for r in range(2)]
for p in ranks:
    print(p.stdout.readline().strip(), flush=True)
for p in ranks:
    p.wait()
"""


def _engine(tmp_path: Path, name: str, root: Path, offset: int) -> tuple[subprocess.Popen, Path]:
    work = tmp_path / name
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(tierstore.__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, str(ADAPTERS), str(root), str(offset),
                             str(work)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, work


def _results(proc: subprocess.Popen, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    lines = []
    while len(lines) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(json.loads(line))
    assert len(lines) == 2, proc.stderr.read()[-3000:] if proc.poll() is not None else "timed out"
    return lines


def test_the_second_engines_reader_rank_reads_its_own_writers_directory(tmp_path):
    root = tmp_path / "kv"
    a, a_work = _engine(tmp_path, "a", root, offset=0)
    b = None
    try:
        first = {("loaded" in r): r for r in _results(a)}
        b, b_work = _engine(tmp_path, "b", root, offset=5000)  # while engine a holds the first directory
        second = {("loaded" in r): r for r in _results(b)}
    finally:
        for work in (a_work, tmp_path / "b"):
            if work.exists():
                (work / "stop").touch()
        for p in (a, b):
            if p is not None:
                p.communicate(timeout=60)
    assert first[False]["dir"] == first[True]["dir"] == str(root / "mla-pp0of1")
    assert first[True]["loaded"] == 10
    assert second[False]["dir"] == second[True]["dir"] == str(root / "mla-pp0of1.1")
    assert second[True]["loaded"] == 10  # was 0: it read engine a's directory
