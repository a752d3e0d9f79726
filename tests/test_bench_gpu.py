"""``tierstore bench gpu``: one line and exit 0 without CUDA; every section's code path with tiny sizes, on CPU
(``--device cpu``, a dry run) and on CUDA when there is one, each transfer checked value for value."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tierstore.cli import main

TINY = ["--h2d-size", "8MiB", "--chunk", "256KiB", "--store-total", "4MiB", "--kv-tokens", "512", "--kv-layers", "3",
        "--kv-heads", "2", "--kv-head-dim", "64", "--kv-chunk", "128", "--weights-size", "4MiB", "--repeats", "2"]
#: tierstore.weights needs blake3 (a bare GPU box may lack it: the weights rows are then left out here)
SECTIONS = "h2d,store,kv,weights" if importlib.util.find_spec("blake3") else "h2d,store,kv"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_gpu_without_cuda_prints_one_line_and_exits_0(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "no CUDA" in lines[0]
    assert "no CUDA" in json.loads(out.read_text())["meta"]["skipped"]


def run_tiny(tmp_path, capsys, device: str) -> dict:
    out = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--device", device, *TINY, "--only", SECTIONS, "--dir", str(tmp_path),
               "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0 and result["meta"]["errors"] == [], printed
    names = [r["name"] for r in result["rows"]]
    assert names[0] == "H2D from pinned (limit)" and any(n.startswith("KV load_into") for n in names)
    assert ("weights.load" in names) == ("weights" in SECTIONS)
    for r in result["rows"]:
        assert r["value"] > 0 and r["unit"] == "GB/s", r
        assert r["ratio"] is not None or r["name"] == names[0], r  # everything against the limit or a baseline
        assert "DIFFER" not in r["note"], r
    assert sum("exact" in r["note"] for r in result["rows"]) >= 4 and result["meta"]["h2d_round_trip"] == "exact"
    assert list(tmp_path.iterdir()) == [out]  # the scratch directory is gone
    return result


def test_bench_gpu_dry_run_on_cpu_runs_every_section(tmp_path, capsys):
    result = run_tiny(tmp_path, capsys, "cpu")
    assert "dry run" in result["title"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_gpu_tiny_on_cuda(tmp_path, capsys):
    result = run_tiny(tmp_path, capsys, "cuda")
    assert result["meta"]["gpu"] and result["meta"]["h2d_round_trip"] == "exact"
